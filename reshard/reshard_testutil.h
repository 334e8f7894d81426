// Test and benchmark support for the reshard executor: random and hand-made layouts, the
// LocalPlans of every participant for a change between two layouts, and reference data
// (deterministic global tensors) to fill old shards and check new ones bitwise.
// Not installed; linked by tests and benchmarks only.
//
//   std::vector<RegionLayout> old_l = {TpLayout(info, /*dim=*/1, {0, 1, 2, 3})};
//   std::vector<RegionLayout> new_l = {TpLayout(info, 1, {0, 1})};
//   std::vector<LocalPlan> plans = BuildPlans({info}, old_l, new_l, /*n=*/4);
#ifndef MORPH_RESHARD_RESHARD_TESTUTIL_H_
#define MORPH_RESHARD_RESHARD_TESTUTIL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "reshard/buffer.h"
#include "reshard/executor.h"
#include "reshard/layout.h"
#include "reshard/local_plan.h"

namespace morph::testutil {

// One tensor's layout: disjoint regions that together cover the tensor, each held by one or
// more participants (replicas).
struct Region {
  Shard shard;
  std::vector<int> holders;
};
using RegionLayout = std::vector<Region>;

// The benchmarks' model: about `mb` MiB of f32 2048 x 2048 matrices, 4 per layer, column- and
// row-parallel alternating (SplitTP(0), SplitTP(1)), ZeRO-sharded when `zero`.
std::vector<TensorSpec> MatrixModel(int64_t mb, bool zero);

// Split along `dim` into holders.size() equal parts (the last takes the remainder).
RegionLayout TpLayout(const TensorInfo& t, int dim, const std::vector<int>& holders);
// The whole tensor flattened and cut into holders.size() contiguous ranges (ZeRO).
RegionLayout FlatLayout(const TensorInfo& t, const std::vector<int>& holders);
// The whole tensor on every holder.
RegionLayout ReplicatedLayout(const TensorInfo& t, const std::vector<int>& holders);
// A random layout over participants [0, n): a split dim with random cuts, flat ranges with
// random cuts inside each part, and replicas, placed on random distinct participants.
RegionLayout RandomLayout(const TensorInfo& t, int n, std::mt19937_64& rng);

// Every participant's LocalPlan for the change old -> new (indexed by tensor). Sources are the
// destination itself when it holds the region, else replicas in rotation.
std::vector<LocalPlan> BuildPlans(const std::vector<TensorInfo>& tensors,
                                  const std::vector<RegionLayout>& old_layout,
                                  const std::vector<RegionLayout>& new_layout, int n);

// Deterministic content of tensor `t`: a byte pattern seeded by its index.
std::vector<char> ReferenceTensor(const TensorInfo& t, int index);
// Copies the shard's elements out of a dense global tensor.
std::vector<char> ExtractShard(const TensorInfo& t, const Shard& s,
                               const std::vector<char>& global);

// Old buffers of one participant filled from the reference, and empty new ones.
struct ParticipantData {
  std::vector<std::vector<char>> old_data;  // indexed by tensor; empty if no old shard
  std::vector<OldShardData> olds;
  std::vector<std::vector<char>> new_data;
  std::vector<NewShardData> news;
};
ParticipantData MakeParticipantData(const LocalPlan& plan,
                                    const std::vector<std::vector<char>>& reference);

}  // namespace morph::testutil

#endif  // MORPH_RESHARD_RESHARD_TESTUTIL_H_
