// Run by ctest as `mpiexec --allow-run-as-root --oversubscribe -np 4 mpi_bootstrap_test`
// (label mpi): rank 0 starts a TCP store and shares its address through MPI; every rank
// connects, builds a Gloo communicator and checks every collective against the reference.
// Exit code 0 on every rank means success.
#include "collectives/mpi_bootstrap.h"

#include <cstdio>

#include "collectives/testing/collective_checks.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

constexpr char kToken[] = "mpi-bootstrap-token";

Status Run() {
  std::unique_ptr<TcpStoreServer> server;
  MORPH_ASSIGN_OR_RETURN(MpiBootstrap boot, MpiBootstrap::Share([&]() -> StatusOr<std::string> {
                           MORPH_ASSIGN_OR_RETURN(server,
                                                  TcpStoreServer::Start("127.0.0.1", 0, kToken));
                           return server->address();
                         }));
  if (boot.size < 2)
    return InternalError("expected several ranks, got " + std::to_string(boot.size));
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(boot.blob, kToken, 0, Deadline::AfterMs(30000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "world", boot.rank, boot.size,
                                                             nullptr, Deadline::AfterMs(30000)));
  MORPH_RETURN_IF_ERROR(CheckAllCollectives(*comm, std::chrono::seconds(30)));
  comm.reset();
  // Rank 0 keeps the store up until everyone is done with it.
  MORPH_RETURN_IF_ERROR(StoreBarrier(*store, "done", boot.size, Deadline::AfterMs(30000)));
  if (boot.rank == 0)
    std::printf("mpi bootstrap: %d ranks OK via %s\n", boot.size, boot.blob.c_str());
  store.reset();
  // Everybody left the store before rank 0 tears it down.
  MORPH_RETURN_IF_ERROR(MpiBootstrap::Finalize());
  return Status::Ok();
}

}  // namespace
}  // namespace morph

int main() {
  morph::Status s = morph::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "mpi_bootstrap_test: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
