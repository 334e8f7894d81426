// CommTransport: the reshard executor's Transport (reshard/transport.h) on a Communicator's
// grouped sends and receives, plus a shared-memory path (shm_channel.h) for peers on the same
// host. Its own target (morph::comm_transport) so that collectives/ itself does not depend on
// reshard/.
//
//   MORPH_ASSIGN_OR_RETURN(auto groups, builder.Build(store, config, rank, n, deadline));
//   MORPH_ASSIGN_OR_RETURN(auto transport,       // collective: every rank calls it
//       CommTransport::Create(&groups->world(), std::chrono::seconds(300),
//                             CommTransportOptions::FromEnv(), deadline));
//   MORPH_RETURN_IF_ERROR(executor.Run(plan, *transport));   // the executor calls Start/Wait
//
// Paths. A peer on the same host (see ShmChannel) gets every message by shared memory: the
// receiver copies straight from the sender's buffer (its old layout) into its own (the new
// layout), one copy whether either side is strided — by memcpy from a mapping of the sender's
// memfd where the buffer came from the sender's ShmArena (options.arena), else by cross-memory
// attach (process_vm_readv). Other peers get the communicator's p2p
// (TCP for Gloo): a contiguous op is posted in place; a strided op (host memory only) is gathered
// into / scattered from a buffer of the transport's pool, one copy per side, the same as the
// executor's staging would cost, so the executor posts it in place and skips its own staging.
// The transport's pool holds at most the strided bytes of the groups in flight; it keeps its
// buffers for reuse until the transport is destroyed.
#ifndef MORPH_COLLECTIVES_COMM_TRANSPORT_H_
#define MORPH_COLLECTIVES_COMM_TRANSPORT_H_

#include <chrono>
#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/shm/shm_channel.h"
#include "reshard/transport.h"

namespace morph {

struct CommTransportOptions {
  // Same-host peers by cross-memory attach (if the system permits it), else TCP for all.
  // Must be equal on all ranks.
  bool shared_memory = true;
  // This process's shared host memory (may be null; must outlive the transport; may differ
  // between ranks): messages sent out of its buffers are mapped by same-host receivers and
  // copied with memcpy instead of process_vm_readv (shm_arena.h).
  const ShmArena* arena = nullptr;

  // MORPH_RESHARD_SHM (default on). kInvalidArgument naming the variable for a bad value.
  static StatusOr<CommTransportOptions> FromEnv();
};

class CommTransport : public Transport {
 public:
  // The communicator's p2p for every peer; no collective call. Does not own `comm`, which must
  // outlive it. `timeout` bounds each group inside the backend; TransportWork::Wait's deadline
  // bounds the wait as well.
  CommTransport(Communicator* comm, std::chrono::milliseconds timeout);
  // Collective over `comm` (every rank calls it with the same options): finds the same-host
  // peers that can use shared memory (ShmChannel::Create). Errors: the communicator's.
  static StatusOr<std::unique_ptr<CommTransport>> Create(Communicator* comm,
                                                         std::chrono::milliseconds timeout,
                                                         const CommTransportOptions& options,
                                                         Deadline deadline);
  ~CommTransport() override;

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  bool SupportsDeviceMemory() const override { return comm_->capabilities().device_memory; }
  // Strided ops on host memory: where the communicator moves host memory.
  bool SupportsStridedOps() const override { return comm_->capabilities().host_memory; }
  // True if messages with `peer` go by shared memory.
  bool IsSharedMemoryPeer(int peer) const { return shm_ != nullptr && shm_->IsLocal(peer); }
  // What this rank received over shared memory so far, by path (zeros without shared memory).
  ShmChannel::Stats shm_stats() const {
    return shm_ != nullptr ? shm_->stats() : ShmChannel::Stats{};
  }

  // kInvalidArgument naming the op for a peer out of range or equal to this rank, or a
  // malformed StridedLayout (bytes != (end - begin) * elem_size, range outside the geometry).
  // A group whose message counts or sizes differ from its peers' fails with kInternal. Tags
  // (transport.h): over TCP each group carries, per direction and peer, one 16-byte record of
  // its messages' tags ahead of the payload, and Wait returns kFailedPrecondition naming the
  // peer and both tag hashes when they differ from the receives posted here; over shared
  // memory every message's descriptor carries its tag (same code on a mismatch).
  // Wait: kUnavailable naming a same-host peer that exited, kAborted for one that aborted.
  StatusOr<std::unique_ptr<TransportWork>> Start(std::span<const SendOp> sends,
                                                 std::span<const RecvOp> recvs) override;
  void Abort() override;

  // Buffers for gathered / scattered strided ops over the communicator, reused across groups.
  class Pool {
   public:
    std::unique_ptr<char[]> Get(size_t bytes);
    void Put(std::unique_ptr<char[]> buf, size_t bytes);

   private:
    std::vector<std::pair<size_t, std::unique_ptr<char[]>>> free_;
  };

 private:
  Communicator* comm_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<ShmChannel> shm_;
  Pool pool_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_COMM_TRANSPORT_H_
