// The planning half of the switch (switch.h "Order and memory bound"): the global order of the
// tensors cut into batches, each batch's part of the plan, and this participant's byte figures.
#include <algorithm>
#include <numeric>

#include "runtime/switch/switch_internal.h"

namespace morph {
namespace {

// Copies of each element under `c`: DP replicas unless ZeRO-sharded, TP replicas unless split.
int64_t Copies(const TensorSpec& t, const ParallelConfig& c) {
  return (t.layout.zero_sharded() ? 1 : c.dp) * (t.layout.tp_split() ? 1 : c.tp);
}

// The largest shard of `t` any rank of `c` holds: TP slices are equal and DP rank 0 has the
// longest ZeRO range, so it is the shard of (stage, d=0, t=0). Caller validated the pair.
int64_t LargestShardBytes(const TensorSpec& t, const ParallelConfig& c) {
  const int rank = c.RankOf({StageOfUnchecked(t, c), 0, 0});
  return ShardOfUnchecked(t, c, rank).NumElements() * DTypeSize(t.dtype);
}

}  // namespace

// The global order (switch.h, "Order and memory bound"), cut into batches of tensor indices.
std::vector<std::vector<int32_t>> Batches(const std::vector<TensorSpec>& tensors,
                                          const ParallelConfig& from, const ParallelConfig& next,
                                          uint64_t batch_bytes) {
  const size_t n = tensors.size();
  std::vector<__int128> change(n);
  for (size_t i = 0; i < n; ++i) {
    change[i] = static_cast<__int128>(TensorBytes(tensors[i])) *
                (Copies(tensors[i], next) - Copies(tensors[i], from));
  }
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return change[a] < change[b]; });
  std::vector<std::vector<int32_t>> batches;
  uint64_t in_batch = 0;
  for (int32_t t : order) {
    const uint64_t m = static_cast<uint64_t>(LargestShardBytes(tensors[t], next));
    if (batches.empty() || in_batch + m > batch_bytes) {
      batches.emplace_back();
      in_batch = 0;
    }
    batches.back().push_back(t);
    in_batch += m;
  }
  return batches;
}

// Each batch's part of `full`: its tensors (ascending index, renumbered) and their pieces in
// the order `full` lists them, so both ends of every pair list the same pieces alike.
std::vector<LocalPlan> SplitPlan(const LocalPlan& full,
                                 const std::vector<std::vector<int32_t>>& batches) {
  const size_t nt = full.tensors.size();
  std::vector<int32_t> batch_of(nt, -1), index_in(nt, -1);
  std::vector<LocalPlan> out(batches.size());
  for (size_t k = 0; k < batches.size(); ++k) {
    std::vector<int32_t> sorted = batches[k];
    std::sort(sorted.begin(), sorted.end());
    LocalPlan& p = out[k];
    p.participant = full.participant;
    p.num_participants = full.num_participants;
    p.digest = full.digest;
    for (int32_t t : sorted) {
      batch_of[static_cast<size_t>(t)] = static_cast<int32_t>(k);
      index_in[static_cast<size_t>(t)] = static_cast<int32_t>(p.tensors.size());
      p.tensors.push_back(full.tensors[static_cast<size_t>(t)]);
      p.old_shards.push_back(full.old_shards[static_cast<size_t>(t)]);
      p.new_shards.push_back(full.new_shards[static_cast<size_t>(t)]);
    }
  }
  auto distribute = [&](const std::vector<PieceMove>& list,
                        std::vector<PieceMove> LocalPlan::*member) {
    for (PieceMove m : list) {
      const size_t t = static_cast<size_t>(m.tensor);
      LocalPlan& p = out[static_cast<size_t>(batch_of[t])];
      m.tensor = index_in[t];
      (p.*member).push_back(std::move(m));
    }
  };
  distribute(full.sends, &LocalPlan::sends);
  distribute(full.recvs, &LocalPlan::recvs);
  distribute(full.local_copies, &LocalPlan::local_copies);
  distribute(full.lost, &LocalPlan::lost);
  return out;
}


// This participant's part of `change`, its batches and the byte figures of "Order and memory
// bound" (PrepareSwitch; ExecuteSwitch for a recovery).
Status PlanSwitch(PreparedSwitch& sw, const ChangePlan& change, const SwitchOptions& options) {
  SwitchStats& planned = sw.planned_;
  const std::string gen = "generation " + std::to_string(sw.next_.id);
  if (change.planner) {
    if (sw.participant_ < 0) {
      return InvalidArgumentError(gen + ": worker " + std::to_string(sw.me_) +
                                  " holds a rank but is no participant of the change");
    }
    MORPH_ASSIGN_OR_RETURN(sw.plan_, change.planner->PlanFor(sw.participant_),
                           gen << ": planning participant " << sw.participant_);
    sw.batches_ = Batches(sw.manifest_.tensors, sw.from_.config, sw.next_.config,
                           options.batch_bytes);
    sw.batch_plans_ = SplitPlan(sw.plan_, sw.batches_);
    // The byte figures of "Order and memory bound" for this worker.
    const LocalPlan& p = sw.plan_;
    for (size_t t = 0; t < p.tensors.size(); ++t) {
      const int64_t n = ShardBytes(p.new_shards[t], p.tensors[t].dtype);
      planned.old_bytes += ShardBytes(p.old_shards[t], p.tensors[t].dtype);
      planned.new_bytes += n;
      planned.largest_shard_bytes = std::max(planned.largest_shard_bytes, n);
    }
    // Tensors whose new shard here is exactly the old one keep their buffer (ExecuteSwitch):
    // nothing is allocated or copied for them.
    sw.kept_.assign(p.tensors.size(), false);
    sw.grow_offset_.assign(p.tensors.size(), -1);
    if (!options.stage_old_in_host && !options.keep_old_until_barrier) {
      for (size_t t = 0; t < p.tensors.size(); ++t) {
        const bool fixed = t < options.fixed_storage.size() && options.fixed_storage[t];
        sw.grow_offset_[t] = fixed ? -1 : GrowOffset(p, t);
      }
      std::vector<bool> receives(p.tensors.size(), false);
      for (const PieceMove& m : p.recvs) receives[static_cast<size_t>(m.tensor)] = true;
      for (size_t t = 0; t < p.tensors.size(); ++t) {
        sw.kept_[t] = !receives[t] && p.old_shards[t] && p.new_shards[t] &&
                       !p.old_shards[t]->empty() && *p.old_shards[t] == *p.new_shards[t];
      }
    }
    bool grew = false;
    for (const auto& batch : sw.batches_) {
      int64_t batch_new = 0;
      for (int32_t t : batch) {
        const DType dt = p.tensors[static_cast<size_t>(t)].dtype;
        const int64_t o = ShardBytes(p.old_shards[static_cast<size_t>(t)], dt);
        const int64_t n = ShardBytes(p.new_shards[static_cast<size_t>(t)], dt);
        if (sw.kept_[static_cast<size_t>(t)]) continue;  // neither allocated nor released
        batch_new += n;
        if (n > o) grew = true;
        if (n < o && grew) planned.sign_consistent = false;
      }
      planned.largest_batch_bytes = std::max(planned.largest_batch_bytes, batch_new);
    }
    sw.pre_pos_.clear();
    sw.prealloc_order_.clear();
    sw.prealloc_bytes_ = 0;
    sw.predicted_peak_ = PredictPeak(sw, options.keep_old_until_barrier);
    if (options.keep_old_until_barrier) planned.sign_consistent = planned.old_bytes == 0;
    planned.batches = static_cast<int>(sw.batches_.size());
    if (DevicePathOn(options)) PlanDeviceBytes(sw);
    planned.bound_bytes = std::max(planned.old_bytes, planned.new_bytes) +
                          planned.largest_batch_bytes +
                          static_cast<int64_t>(sw.executor_.staging_bytes);
  }
  return Status::Ok();
}

}  // namespace morph
