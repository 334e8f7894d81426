// The NCCL backend of Communicator: CUDA device buffers, one communicator per group.
//
//   MORPH_ASSIGN_OR_RETURN(auto comm, NcclCommunicator::Create(store, "world", rank, n,
//                                                              /*cuda_device=*/local_rank,
//                                                              Deadline::AfterMs(60000)));
//   MORPH_RETURN_IF_ERROR(comm->Allreduce(dev_ptr, n, DataType::kBF16, ReduceOp::kSum, 30s));
//   // Ranks 3 and 5 died: survivors shrink without a new unique id.
//   MORPH_ASSIGN_OR_RETURN(auto smaller, comm->Shrink({3, 5}, next_generation, deadline));
//
// Lifecycle (FACTS.md, NCCL 2.28.9): communicators are non-blocking (config.blocking = 0);
// every call that returns ncclInProgress is polled with ncclCommGetAsyncError up to its
// deadline. A failed or aborted communicator is released with ncclCommAbort and never
// ncclCommDestroy. Abort() from another thread only raises a flag: the owning thread (the
// one in Work::Wait, or the next Start, or the destructor) calls ncclCommAbort, so that it
// never races with another NCCL call on the same communicator. New members (grow) need a
// fresh unique id, which rank 0 publishes under "nccl/<name>/id" in the generation's store.
// Operations run on the communicator's own CUDA stream; Wait polls a CUDA event and the
// communicator's async error every 100 µs.
#ifndef MORPH_COLLECTIVES_NCCL_COMMUNICATOR_H_
#define MORPH_COLLECTIVES_NCCL_COMMUNICATOR_H_

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "collectives/communicator.h"
#include "collectives/groups.h"
#include "collectives/store.h"

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
  static StatusOr<std::unique_ptr<NcclCommunicator>> Create(Store& store, std::string_view name,
                                                            int rank, int size, int cuda_device,
                                                            Deadline deadline);
  ~NcclCommunicator() override;

  // Survivors only (every rank not in `exclude`, numbered in this communicator): a new
  // communicator without the excluded ranks, over the existing connections, no unique id.
  // When this communicator failed, its operations are aborted first (NCCL_SHRINK_ABORT).
  // This communicator is released (ncclCommAbort) afterwards either way.
  StatusOr<std::unique_ptr<NcclCommunicator>> Shrink(std::span<const int> exclude,
                                                     int64_t generation, Deadline deadline);
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

}  // namespace morph

#endif  // MORPH_COLLECTIVES_NCCL_COMMUNICATOR_H_
