// The NCCL backend of Communicator: CUDA device buffers, one communicator per group.
//
//   MORPH_ASSIGN_OR_RETURN(auto comm, NcclCommunicator::Create(store, "world", rank, n,
//                                                              /*cuda_device=*/local_rank,
//                                                              Deadline::AfterMs(60000)));
//   CollectiveOp op = CollectiveOp::Allreduce(grads, n, DType::kBF16, ReduceOp::kSum, 30s);
//   op.stream = backward_stream;           // after the backward pass, overlapping the rest
//   MORPH_ASSIGN_OR_RETURN(auto work, comm->Start(op));
//   ...
//   MORPH_RETURN_IF_ERROR(work->Wait(Deadline::AfterMs(30000)));
//   // Ranks 3 and 5 died: survivors shrink without a new unique id.
//   MORPH_ASSIGN_OR_RETURN(auto smaller, comm->Shrink(std::vector<int>{3, 5},
//                                                     ShrinkMode::kFailure, g + 1, deadline));
//
// Lifecycle (docs/facts.md, NCCL 2.28.9). Communicators are non-blocking (config.blocking = 0):
// every NCCL call returns at once or with ncclInProgress, which is polled with
// ncclCommGetAsyncError up to the call's deadline.
//
// Threads and the abort race (docs/facts.md: never ncclCommAbort while another thread is inside
// an NCCL call on the same communicator). Every NCCL call on a communicator is made holding its
// owner mutex, and since every call is non-blocking the mutex is held for microseconds; polls
// release it between polls. Abort() (any thread) raises a flag and takes the mutex, so it
// waits at most for one such call, then stops the communicator itself — no NCCL call can be
// in flight on it at that moment. Stopping is ncclCommRevoke (its kernels exit; the
// communicator stays valid so that survivors can still Shrink(kFailure) it), falling back to
// ncclCommAbort if the revoke fails. A waiting thread sees the state change at its next poll
// (every 100 µs) and returns kAborted. Failures (async error, deadline) stop it the same way.
//
// Wait never returns while NCCL's kernels may still touch the buffers: after a failure it
// waits up to 0.5 s for the revoked communicator to quiesce, then releases it with
// ncclCommAbort. Work::Done() is true only when the op's CUDA event completed or no kernel of
// the communicator can run any more (released, or revoked and quiescent). A Work that outlives
// its communicator holds the shared state: Wait returns kFailedPrecondition ("communicator
// destroyed"), never touching the released NCCL communicator.
//
// Teardown never waits for a finalize timeout: a healthy communicator gets ncclCommFinalize
// (non-blocking) and at most 200 ms to flush, then ncclCommDestroy; if the flush takes longer
// (operations still waiting for peers) ncclCommAbort instead. A failed, revoked or aborted
// communicator is released with ncclCommAbort, never ncclCommDestroy.
//
// Streams: an op with CollectiveOp::stream set is enqueued on that stream and Wait waits on an
// event recorded there after it; otherwise on the communicator's own stream.
// New members (grow) need a fresh unique id, which rank 0 publishes under "nccl/<name>/id" in
// the generation's store.
#ifndef MORPH_COLLECTIVES_NCCL_COMMUNICATOR_H_
#define MORPH_COLLECTIVES_NCCL_COMMUNICATOR_H_

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "collectives/build_cancel.h"
#include "collectives/communicator.h"
#include "collectives/groups.h"
#include "collectives/store/store.h"

namespace morph {

// True if CUDA reports at least one device; otherwise `why` says what CUDA answered
// (e.g. "cudaGetDeviceCount: CUDA driver version is insufficient..."). Any thread.
bool CudaDeviceAvailable(std::string* why);

class NcclCommunicator : public Communicator {
 public:
  // Collective over `size` ranks of `store`'s generation, each on its `cuda_device`.
  // kInvalidArgument for rank/size/name; kUnavailable when CUDA or NCCL fail to initialize
  // (no GPU, "Duplicate GPU detected"...); the store's errors; kDeadlineExceeded if init does
  // not finish in time (the half-built communicator is aborted). Any thread.
  // With `cancel` (build_cancel.h): kAborted at the next poll of the unique-id wait or of the
  // non-blocking init once it is cancelled, the half-built communicator aborted.
  static StatusOr<std::unique_ptr<NcclCommunicator>> Create(Store& store, std::string_view name,
                                                            int rank, int size, int cuda_device,
                                                            Deadline deadline,
                                                            const BuildCancel* cancel = nullptr);
  // Releases the communicator (see Teardown above); at most ~200 ms on a healthy one.
  ~NcclCommunicator() override;

  // Communicator::Shrink with ncclCommShrink: NCCL_SHRINK_DEFAULT for kPlanned (needs a
  // healthy communicator, else kFailedPrecondition), NCCL_SHRINK_ABORT for kFailure (also
  // after Abort() or a failure, which only revoked this communicator). kFailedPrecondition if
  // this communicator was already released (ncclCommAbort). No unique id: dead ranks do not
  // block it. This communicator is released with ncclCommAbort afterwards, success or not.
  // Abort() does not interrupt a shrink in progress: its deadline bounds it. Owning thread.
  StatusOr<std::unique_ptr<Communicator>> Shrink(std::span<const int> exclude, ShrinkMode mode,
                                                 int64_t generation, Deadline deadline) override;
  // Collective over this communicator: ranks with the same `color` form a new communicator,
  // ordered by `key`; color < 0 opts out (returns nullptr). Subgroups of a generation.
  StatusOr<std::unique_ptr<Communicator>> Split(int color, int key, std::string name,
                                                Deadline deadline) override;

  int rank() const override;
  int size() const override;
  int64_t generation() const override;
  Capabilities capabilities() const override;
  StatusOr<std::unique_ptr<Work>> Start(CollectiveOp op) override;
  void Abort() override;
  bool broken() const override;

  class Impl;

 private:
  explicit NcclCommunicator(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// NCCL communicators on `cuda_device` for GroupBuilder.
CommunicatorFactory NcclFactory(int cuda_device);
// Its builds end with kAborted once `cancel` is cancelled (NcclCommunicator::Create).
CommunicatorFactory NcclFactory(int cuda_device, std::shared_ptr<const BuildCancel> cancel);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_NCCL_COMMUNICATOR_H_
