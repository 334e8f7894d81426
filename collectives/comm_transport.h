// CommTransport: the reshard executor's Transport (reshard/transport.h) on a Communicator's
// grouped sends and receives. Its own target (morph::comm_transport) so that collectives/
// itself does not depend on reshard/.
//
//   MORPH_ASSIGN_OR_RETURN(auto groups, builder.Build(store, config, rank, n, deadline));
//   CommTransport transport(&groups->world(), std::chrono::seconds(300));
//   MORPH_RETURN_IF_ERROR(executor.Run(plan, transport));   // the executor calls Start/Wait
#ifndef MORPH_COLLECTIVES_COMM_TRANSPORT_H_
#define MORPH_COLLECTIVES_COMM_TRANSPORT_H_

#include <chrono>

#include "collectives/communicator.h"
#include "reshard/transport.h"

namespace morph {

class CommTransport : public Transport {
 public:
  // Does not own `comm`, which must outlive it. `timeout` bounds each group inside the
  // backend; TransportWork::Wait's deadline bounds the wait as well.
  CommTransport(Communicator* comm, std::chrono::milliseconds timeout)
      : comm_(comm), timeout_(timeout) {}

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  bool SupportsDeviceMemory() const override { return comm_->capabilities().device_memory; }

  // kInvalidArgument naming the op for a peer out of range or equal to this rank, or for a
  // strided op (SupportsStridedOps() is false). A group
  // whose message counts or sizes differ from its peers' fails with kInternal. Tags
  // (transport.h): each group carries, per direction and peer, one 16-byte record of its
  // messages' tags ahead of the payload; Wait returns kFailedPrecondition naming the peer and
  // both tag hashes when the tags it received differ from those of the receives posted here.
  StatusOr<std::unique_ptr<TransportWork>> Start(std::span<const SendOp> sends,
                                                 std::span<const RecvOp> recvs) override;
  void Abort() override { comm_->Abort(); }

 private:
  Communicator* comm_;
  std::chrono::milliseconds timeout_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_COMM_TRANSPORT_H_
