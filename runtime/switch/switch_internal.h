// What the switch engine's files (switch.cc, switch_snapshot.cc) share; not part of its API.
#ifndef MORPH_RUNTIME_SWITCH_SWITCH_INTERNAL_H_
#define MORPH_RUNTIME_SWITCH_SWITCH_INTERNAL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/deadline.h"
#include "base/status.h"
#include "runtime/switch/switch.h"
#include "runtime/protocol/messages.h"

namespace morph {

// "participant 2 (worker 12), participant 3 (worker 5)" for the peers a failure names
// (Status::failed_peers are participant indices of `participants`).
std::string NamePeers(const Status& s, const std::vector<WorkerId>& participants);

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
void FillPreallocation(PreparedSwitch& sw, const Allocator& alloc);
Buffer TakePreallocated(PreparedSwitch& sw, size_t t);

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

// ExecuteSwitch for a recovery from buddy snapshots (switch.h "Recovery"; switch_snapshot.cc).
StatusOr<SwitchStats> RestoreFromSnapshots(PreparedSwitch& sw, const CommitMsg& commit,
                                           State& state, Deadline deadline);

}  // namespace morph

#endif  // MORPH_RUNTIME_SWITCH_SWITCH_INTERNAL_H_
