// MPI bootstrap: under mpirun, rank 0 hands a small blob (the coordinator's or store's
// address) to every rank through MPI. Nothing else in morph uses MPI; this is the only target
// that links it.
//
//   MORPH_ASSIGN_OR_RETURN(MpiBootstrap boot, MpiBootstrap::Share([&]() -> StatusOr<std::string> {
//     MORPH_ASSIGN_OR_RETURN(server, TcpStoreServer::Start("127.0.0.1", 0, token));  // rank 0
//     return server->address();
//   }));
//   auto store = TcpStoreClient::Connect(boot.blob, token, 0, deadline);   // every rank
//   ...
//   MpiBootstrap::Finalize();   // at the end of the program, on every rank
//
// Survivors outlive a killed rank only under `mpirun --enable-recovery` (Open MPI 4.1.4).
#ifndef MORPH_COLLECTIVES_MPI_BOOTSTRAP_H_
#define MORPH_COLLECTIVES_MPI_BOOTSTRAP_H_

#include <functional>
#include <string>

#include "morph/status.h"

namespace morph {

struct MpiBootstrap {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  std::string blob;

  // Collective over MPI_COMM_WORLD: initializes MPI if nobody did (errors returned, not
  // fatal), runs `make_blob` on rank 0 only and broadcasts its result (at most 64 KiB). If
  // rank 0's make_blob fails, every rank gets kUnavailable with rank 0's message;
  // kInvalidArgument if the blob is too large; MPI failures as MpiToStatus. Main thread.
  static StatusOr<MpiBootstrap> Share(const std::function<StatusOr<std::string>()>& make_blob);

  // MPI_Finalize if Share initialized MPI. Collective; call once at the end. Main thread.
  static Status Finalize();
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_MPI_BOOTSTRAP_H_
