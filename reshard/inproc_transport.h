// InProcTransport: N transport ranks as threads of one process, meeting in a shared hub. Used by
// executor tests and benchmarks, and as a reference for what a Transport must do: real
// concurrency (a matched transfer is copied by whichever of its two ranks' threads gets to it
// first in Wait, so copies run beside the callers as a real transport's progress does), in-order
// matching per (src, dst) pair across groups, size-mismatch detection, strided ops (scatter /
// gather straight between the two ranks' layouts, host memory), Abort from any thread,
// and fault injection.
//
//   auto hub = std::make_shared<InProcHub>(4);
//   std::vector<std::thread> ts;
//   for (int r = 0; r < 4; ++r) ts.emplace_back([&, r] {
//     InProcTransport t(hub, r);
//     auto work = t.Start(sends, recvs);  ... (*work)->Wait(Deadline::AfterMs(10000));
//   });
//   hub->InjectFailAfterBytes(1 << 20);   // every op fails once 1 MiB has been delivered
//
// Tags (transport.h): a matched pair whose tags differ fails on both sides with
// kFailedPrecondition naming both tags; nothing is copied.
//
// Failure semantics (the contract other transports follow):
//   - a Wait that fails (deadline, abort, size mismatch, injected fault) closes its rank: its
//     pending ops are withdrawn (no thread touches their buffers once Wait returns), later Starts
//     fail with kFailedPrecondition, and peers' ops with it fail with kUnavailable;
//   - Abort() on one rank: its pending and later Waits return kAborted within milliseconds and
//     peers see kUnavailable; InProcHub::AbortAll() aborts every rank;
//   - KillRank(r): rank r behaves as a dead process (its ops never complete; peers get
//     kUnavailable "peer r is gone").
#ifndef MORPH_RESHARD_INPROC_TRANSPORT_H_
#define MORPH_RESHARD_INPROC_TRANSPORT_H_

#include <cstdint>
#include <memory>

#include "reshard/transport.h"

namespace morph {

class InProcHub {
 public:
  // `device_memory`: ops may carry CUDA pointers (copied with cudaMemcpy); needs a CUDA build.
  explicit InProcHub(int size, bool device_memory = false);
  ~InProcHub();
  InProcHub(const InProcHub&) = delete;
  InProcHub& operator=(const InProcHub&) = delete;

  int size() const;
  bool device_memory() const;

  // Every rank's pending and later Waits return kAborted. Any thread.
  void AbortAll();
  // Once `bytes` bytes in total have been delivered, every transfer not yet delivered fails with
  // kUnavailable ("injected fault"). Any thread; a negative value disables it.
  void InjectFailAfterBytes(int64_t bytes);
  // Rank `rank` dies: ops with it as peer fail with kUnavailable, its own Waits with kAborted.
  void KillRank(int rank);
  // Bytes delivered so far (all ranks).
  int64_t bytes_delivered() const;

  struct State;  // implementation detail, shared with InProcTransport

 private:
  std::shared_ptr<State> state_;
  friend class InProcTransport;
};

class InProcTransport final : public Transport {
 public:
  // kInvalidArgument-free: `rank` must be in [0, hub->size()) (CHECKed: a test bug otherwise).
  InProcTransport(std::shared_ptr<InProcHub> hub, int rank);
  // Closes the rank: peers' pending ops with it fail with kUnavailable.
  ~InProcTransport() override;

  int rank() const override { return rank_; }
  int size() const override;
  bool SupportsDeviceMemory() const override;
  // True for a host-memory hub: a matched pair is copied in one pass from the sender's layout
  // to the receiver's (either or both strided).
  bool SupportsStridedOps() const override;
  // kInvalidArgument: peer out of range or equal to this rank, a null buffer with bytes > 0, or
  // a strided op that is malformed or given to a device-memory hub.
  // kFailedPrecondition: this rank is closed (an earlier Wait failed) or aborted.
  StatusOr<std::unique_ptr<TransportWork>> Start(std::span<const SendOp> sends,
                                                 std::span<const RecvOp> recvs) override;
  void Abort() override;

 private:
  std::shared_ptr<InProcHub> hub_;
  int rank_;
};

}  // namespace morph

#endif  // MORPH_RESHARD_INPROC_TRANSPORT_H_
