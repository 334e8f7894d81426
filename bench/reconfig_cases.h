// The end-to-end reconfiguration benchmark's model and changes (issue 9, `make bench-runtime`),
// shared by every contender so that they move the same state: morph's runtime, the C++
// restart baseline (restart_baseline_bench.cc) and PyTorch DCP (bench/peers/dcp_reconfig.py,
// which reads the layouts from `restart_baseline_bench --print-layout`).
//
// The model: 8 layers of two f32 [rows, 2048] matrices, `w_in` split on dim 0 and `w_out` on
// dim 1 under TP, each with its Adam moments `.adam_m` and `.adam_v` (ZeRO-1: parameters
// replicated over DP, moments flat-sharded over DP). Unique state = parameters + both moments,
// rows chosen (a multiple of 8, so every ZeRO range is whole rows) to come as close to the
// requested bytes as possible from below.
//
//   std::vector<TensorSpec> model = ReconfigModel(1ull << 30);
//   for (const ReconfigChange& c : ReconfigChanges()) { ... c.old_config, c.new_config ... }
//
// Pure values; any thread.
#ifndef MORPH_BENCH_RECONFIG_CASES_H_
#define MORPH_BENCH_RECONFIG_CASES_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "morph/parallel_config.h"
#include "reshard/layout.h"

namespace morph::bench {

inline constexpr int kReconfigLayers = 8;
inline constexpr int64_t kReconfigCols = 2048;

// Rows of every matrix for `bytes` of unique state (at least 8).
inline int64_t ReconfigRows(uint64_t bytes) {
  // 2 matrices per layer, 3 copies (param, m, v), 4 bytes per element.
  const uint64_t per_row = kReconfigLayers * 2 * 3 * kReconfigCols * 4;
  return std::max<int64_t>(8, static_cast<int64_t>(bytes / per_row) / 8 * 8);
}

inline std::vector<TensorSpec> ReconfigModel(uint64_t bytes) {
  const int64_t rows = ReconfigRows(bytes);
  std::vector<TensorSpec> model;
  for (int l = 0; l < kReconfigLayers; ++l) {
    for (int m = 0; m < 2; ++m) {
      std::string name = "layers." + std::to_string(l) + (m == 0 ? ".w_in" : ".w_out");
      Layout layout = Layout::Layer(l).SplitTP(m);
      model.push_back({name, DType::kF32, {rows, kReconfigCols}, layout});
      model.push_back({name + ".adam_m", DType::kF32, {rows, kReconfigCols}, layout.ZeroShard()});
      model.push_back({name + ".adam_v", DType::kF32, {rows, kReconfigCols}, layout.ZeroShard()});
    }
  }
  return model;
}

inline ParallelConfig ReconfigConfig(int dp, int tp, int pp) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp, .zero_stage = 1};
  c.stage_of_layer = *ParallelConfig::EvenStages(kReconfigLayers, pp);
  return c;
}

struct ReconfigChange {
  std::string name;  // the `change` field of every contender's JSON line
  ParallelConfig old_config;
  ParallelConfig new_config;
};

// dp 4->2 and 2->4 (tp = pp = 1); tp 2->1 and pp 2->1 at dp 2 (both shrink 4 workers to 2);
// dp 4->3, the restart after losing one of 4 workers (failures_bench's baseline; its ZeRO ranges
// are not whole rows, so only the C++ baseline runs it: DCP's row shards cannot hold them).
inline std::vector<ReconfigChange> ReconfigChanges() {
  return {{"dp4to2", ReconfigConfig(4, 1, 1), ReconfigConfig(2, 1, 1)},
          {"dp4to3", ReconfigConfig(4, 1, 1), ReconfigConfig(3, 1, 1)},
          {"dp2to4", ReconfigConfig(2, 1, 1), ReconfigConfig(4, 1, 1)},
          {"tp2to1", ReconfigConfig(2, 2, 1), ReconfigConfig(2, 1, 1)},
          {"pp2to1", ReconfigConfig(2, 1, 2), ReconfigConfig(2, 1, 1)}};
}

}  // namespace morph::bench

#endif  // MORPH_BENCH_RECONFIG_CASES_H_
