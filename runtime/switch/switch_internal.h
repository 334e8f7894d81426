// What the switch engine's files (switch.cc, switch_execute.cc, switch_snapshot.cc, ...)
// share; not part of its API.
#ifndef MORPH_RUNTIME_SWITCH_SWITCH_INTERNAL_H_
#define MORPH_RUNTIME_SWITCH_SWITCH_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "reshard/buffer.h"
#include "runtime/switch/switch.h"
#include "runtime/protocol/messages.h"

namespace morph {

// "participant 2 (worker 12), participant 3 (worker 5)" for the peers a failure names
// (Status::failed_peers are participant indices of `participants`).
std::string NamePeers(const Status& s, const std::vector<WorkerId>& participants);

// Copies `src` into `dst` (same size), host or device on either side (cudaMemcpy).
Status CopyBytes(BufferView dst, ConstBufferView src);

// Bytes of a shard of `dtype` (0 when there is none).
inline int64_t ShardBytes(const std::optional<Shard>& s, DType dtype) {
  return s ? s->NumElements() * DTypeSize(dtype) : 0;
}

// switch_memory.cc: pre-faults a new shard's buffer except [offset, offset + resident) (offset
// < 0: all of it); the byte offset at which tensor t's old shard can stay in place inside its
// new one, or -1; the predicted peak with pre-allocation; planning and filling it.
Status PrefaultFresh(BufferView v, int64_t offset, size_t resident);
int64_t GrowOffset(const LocalPlan& p, size_t t);
int64_t PredictPeak(const PreparedSwitch& sw, bool keep_old);
void PlanPreallocation(PreparedSwitch& sw);
void FillPreallocation(PreparedSwitch& sw, const ShardAllocator& alloc);
Buffer TakePreallocated(PreparedSwitch& sw, size_t t);
// The closing barrier passed: Abort() leaves the new groups be (switch.h, applied_).
void MarkApplied(PreparedSwitch& sw);

// switch_plan.cc: the global order cut into batches of tensor indices (switch.h "Order and
// memory bound"); each batch's part of `full` (its tensors, ascending and renumbered, and their
// pieces in the order `full` lists them, so both ends of every pair list the same pieces alike);
// this participant's part of `change`, its batches and byte figures (PrepareSwitch; ExecuteSwitch
// for a recovery).
std::vector<std::vector<int32_t>> Batches(const std::vector<TensorSpec>& tensors,
                                          const ParallelConfig& from, const ParallelConfig& next,
                                          uint64_t batch_bytes);
std::vector<LocalPlan> SplitPlan(const LocalPlan& full,
                                 const std::vector<std::vector<int32_t>>& batches);
Status PlanSwitch(PreparedSwitch& sw, const ChangePlan& change, const SwitchOptions& options);

// switch_device.cc (switch.h "Device path", "Device memory").
// Device bytes held during one switch (old device shards not yet released, new ones allocated,
// staged copies returned for a batch) and their peak.
struct DeviceTally {
  int64_t held = 0, peak = 0;
  void Add(int64_t n) {
    held += n;
    peak = std::max(peak, held);
  }
  void Sub(int64_t n) { held -= n; }
};
bool DevicePathOn(const SwitchOptions& o);
// Tensor t (manifest index) is device-resident (SwitchDeviceOptions::tensors).
bool OnDevice(const PreparedSwitch& sw, size_t t);
// kInvalidArgument naming the field for device options that cannot work.
Status CheckDeviceOptions(const SwitchOptions& o, size_t num_tensors, const std::string& gen);
// PrepareSwitch: plans and builds the union communicator and the device transport over it.
Status PrepareDevicePath(PreparedSwitch& sw, Store& store, Deadline deadline);
// PlanSwitch: SwitchStats::device's planned figures (old, new, largest batch, bound).
void PlanDeviceBytes(PreparedSwitch& sw);
// True when device.free_bytes says the device cannot hold the change's bound (records it).
bool ShouldStageOld(PreparedSwitch& sw, SwitchStats& stats);
// Copies every old device shard to pinned host memory (`staged`), releases it on the device and
// points old_view there; returns the bytes staged.
StatusOr<int64_t> StageOldDeviceShards(PreparedSwitch& sw, StateStore& state,
                                       std::vector<ConstBufferView>& old_view,
                                       std::vector<Buffer>& staged, DeviceTally& tally);
// A staged old shard back in device memory (`on_device`, the tensor's allocator) for its batch.
Status ReturnStagedForBatch(PreparedSwitch& sw, StateStore& state, size_t t,
                            std::vector<ConstBufferView>& old_view, Buffer& on_device,
                            DeviceTally& tally);
// One batch's exchange: device-resident tensors over the device transport, the others over the
// change transport (one exchange each when the batch holds both). `global`: the manifest index
// of each of `run`'s tensors. *device_staging: the device exchange's staging peak.
StatusOr<ExecutorStats> RunBatch(PreparedSwitch& sw, const LocalPlan& run,
                                 const std::vector<int32_t>& global,
                                 std::span<const OldShardData> olds,
                                 std::span<const NewShardData> news, SwitchStats& stats,
                                 int64_t* device_staging, Deadline deadline);

// switch_execute.cc: ExecuteSwitch's phases once the commit and the state are checked: the old
// shards viewed (and staged off the device when it cannot hold the change), each batch moved
// (new shards allocated, the exchange, old shards released), the scalars handed over, the
// closing barrier. One object per execution; Run() once.
class SwitchExecution {
 public:
  SwitchExecution(PreparedSwitch& sw, const CommitMsg& commit, StateStore& state,
                  Deadline deadline);
  StatusOr<SwitchStats> Run();

  // The phases before the state moves (switch.cc): the commit validated against the prepare,
  // a recovery re-planned for its commit (its stale participants), the state checked against
  // the plan, the first generation materialized.
  static Status ValidateCommit(const PreparedSwitch& sw, const CommitMsg& commit,
                               const std::string& gen);
  static Status ReplanRecovery(PreparedSwitch& sw, const CommitMsg& commit,
                               const std::string& gen);
  static Status CheckStateAgainstPlan(const PreparedSwitch& sw, const CommitMsg& commit,
                                      StateStore& state, const std::string& gen);
  static StatusOr<SwitchStats> MaterializeFirst(const PreparedSwitch& sw, StateStore& state,
                                                const std::string& gen);

 private:
  struct Batch;
  Status Fail(Status s, const std::string& where) const;
  void ViewOldShards();
  Status StageOldShards();
  Batch StartBatch(int k) const;
  Status MoveBatch(int k);
  Status AllocateNewShards(Batch& b);
  StatusOr<Buffer> AllocateFresh(size_t t, int64_t bytes);
  // What tensor t's allocator is asked for, for a new shard of `bytes` (StateStore::AllocationBytes).
  int64_t NewCapacity(size_t t, int64_t bytes) const {
    return state_.AllocationBytes(t, sw_.next_.config, sw_.new_rank_, bytes);
  }
  size_t FillFromAdoptedPool(Buffer& b);
  void GrowInPlace(Batch& b, size_t j);
  Status ReturnStaged(Batch& b);
  const LocalPlan& PlanToRun(const Batch& b, LocalPlan& trimmed) const;
  Status ReleaseBatch(Batch& b);
  void ReleaseOld(Batch& b, size_t j);
  Status IntoTensorStorage(size_t t, Buffer& fresh);
  Status HandOverScalars();
  Status Close();
  void LogStats() const;

  PreparedSwitch& sw_;
  const CommitMsg& commit_;
  StateStore& state_;
  const Deadline deadline_;
  const SwitchOptions& opt_;
  const LocalPlan& plan_;
  const size_t nt_;
  const std::string gen_;
  SwitchStats stats_;
  // Per tensor (manifest index): where its old shard is read from (the state's buffer, a host
  // copy, a staged copy, the resident part of a grown new shard), the host copies
  // (stage_old_in_host), the staged device shards, the new shards to install, old shards
  // taken out of the State to be grown in place.
  std::vector<ConstBufferView> old_view_;
  std::vector<Buffer> old_host_, staged_, new_buffers_, taken_;
  int64_t held_ = 0;  // state bytes held now (old, new, pre-allocated)
  const bool device_path_;
  DeviceTally tally_;
  const bool recycle_;
  PagePool pool_;
  // Recycling for adopted tensors whose allocator moves pages (StateStore::pages_movable): old
  // shards released in a batch, held until the next batch's new shards took their pages
  // (FillFromAdoptedPool) and released after its allocation, as pool_.
  struct Pooled {
    size_t tensor;  // whose allocator gave `buffer`
    Buffer buffer;
    size_t used = 0;  // bytes of its pages moved out, from the front
  };
  std::vector<Pooled> adopted_pool_;
};

// ExecuteSwitch for a recovery from buddy snapshots (switch.h "Recovery"; switch_snapshot.cc).
StatusOr<SwitchStats> RestoreFromSnapshots(PreparedSwitch& sw, const CommitMsg& commit,
                                           StateStore& state, Deadline deadline);

}  // namespace morph

#endif  // MORPH_RUNTIME_SWITCH_SWITCH_INTERNAL_H_
