// ConfigPlanner: picks the parallel configuration for a number of workers (docs/design.md §5).
//
// Default policy, in order:
//   1. keep the current tp and pp if they still fit (the most DP ranks the workers allow, memory
//      fits, dp <= global batch): a change then moves the least state;
//   2. otherwise the (tp, pp) with the highest estimated throughput that fits memory;
//   3. workers beyond dp*tp*pp are standby spares.
// A user policy callback may choose instead; its choice is validated like any other.
// Every choice comes with a one-line explanation (logged, and shown by /v1/status).
//
//   ConfigPlanner planner(ModelConstraints{.num_layers = 24, .num_heads = 16,
//                                          .tp_candidates = {1, 2, 4}, .global_batch = 512});
//   MORPH_ASSIGN_OR_RETURN(ConfigChoice c, planner.Choose(/*workers=*/7, &current));
//   // c.config: dp=3 tp=2 pp=1 ..., c.explanation: "keep tp=2 pp=1: dp 4 -> 3, 1 spare"
//
// Thread-compatible; Choose is const and may run on any thread (the coordinator runs it off its
// I/O thread).
#ifndef MORPH_RUNTIME_COORDINATOR_CONFIG_PLANNER_H_
#define MORPH_RUNTIME_COORDINATOR_CONFIG_PLANNER_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "morph/parallel_config.h"
#include "morph/options.h"
#include "morph/status.h"

namespace morph {


struct ConfigChoice {
  ParallelConfig config;
  int spares = 0;
  std::string explanation;
};


class ConfigPlanner {
 public:
  // kInvalidArgument naming the field for constraints that no config can meet (no tp or pp
  // candidate, a candidate < 1, num_layers < 1, global_batch < 1).
  static StatusOr<ConfigPlanner> Create(ModelConstraints model, ConfigPolicy policy = nullptr);

  // The config for `workers` workers (current: the running config, or null at start).
  // kFailedPrecondition saying why when nothing fits (too few workers for any tp*pp, memory);
  // kInvalidArgument naming what is wrong with a user policy's config.
  StatusOr<ConfigChoice> Choose(int workers, const ParallelConfig* current) const;

  // The default policy's throughput estimate (samples per unit time, relative): ranks used,
  // discounted for TP communication and the pipeline bubble. Exposed for tests and tools.
  double EstimatedThroughput(const ParallelConfig& c) const;

  const ModelConstraints& model() const { return model_; }

 private:
  ConfigPlanner(ModelConstraints model, ConfigPolicy policy);
  // Why (tp, pp) cannot be used with `dp` ranks, "" if it can.
  std::string Unfit(int dp, int tp, int pp) const;
  StatusOr<ParallelConfig> Make(int dp, int tp, int pp) const;

  ModelConstraints model_;
  ConfigPolicy policy_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_CONFIG_PLANNER_H_
