// ParallelConfig: a job's data/tensor/pipeline parallel configuration, and the rank algebra
// every component shares (docs/design.md §1): rank = (p*dp + d)*tp + t, TP innermost.
//
//   ParallelConfig c{.dp = 4, .tp = 2, .pp = 2};
//   c.stage_of_layer = *ParallelConfig::EvenStages(/*num_layers=*/24, c.pp);
//   MORPH_RETURN_IF_ERROR(c.Validate());
//   auto [p, d, t] = c.CoordsOf(13);      // p=1, d=2, t=1
//   std::vector<int> dp_peers = c.DpGroup(13);   // {9, 11, 13, 15}
//
// A plain value; thread-compatible.
#ifndef MORPH_PARALLEL_CONFIG_H_
#define MORPH_PARALLEL_CONFIG_H_

#include "morph/api.h"

#include <string>
#include <vector>

#include "morph/status.h"

namespace morph {

struct MORPH_API ParallelConfig {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  // Pipeline stage of each layer; non-decreasing, every stage in [0, pp) used. May be empty
  // when the model has no layers to place (then every tensor is on stage 0 and pp must be 1).
  std::vector<int> stage_of_layer;
  // 0: no ZeRO; 1/2: optimizer state (and gradients) sharded over DP; 3: parameters too.
  // Informational for the config planner: each tensor's Layout says whether it is sharded.
  int zero_stage = 0;
  int micro_batches = 1;

  struct Coords {
    int p = 0;
    int d = 0;
    int t = 0;
    friend bool operator==(const Coords&, const Coords&) = default;
  };

  int world() const { return dp * tp * pp; }
  Coords CoordsOf(int rank) const { return {rank / (dp * tp), (rank / tp) % dp, rank % tp}; }
  int RankOf(Coords c) const { return (c.p * dp + c.d) * tp + c.t; }
  // Ranks of the groups `rank` belongs to, in group-rank order.
  std::vector<int> DpGroup(int rank) const;
  std::vector<int> TpGroup(int rank) const;
  std::vector<int> PpGroup(int rank) const;

  // kInvalidArgument naming the field: dp/tp/pp < 1, world overflow, zero_stage not in 0..3,
  // micro_batches < 1, a stage_of_layer entry out of range or decreasing, a stage with no layer.
  Status Validate() const;

  // `num_layers` layers split into `pp` contiguous stages as evenly as possible (earlier stages
  // get the extra layer). kInvalidArgument if pp < 1 or num_layers < pp.
  static StatusOr<std::vector<int>> EvenStages(int num_layers, int pp);

  // "dp=4 tp=2 pp=2 zero=1 layers=24"
  std::string ToString() const;
  friend bool operator==(const ParallelConfig&, const ParallelConfig&) = default;
};

}  // namespace morph

#endif  // MORPH_PARALLEL_CONFIG_H_
