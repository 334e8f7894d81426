// The planner's dry run: what a change between two configurations would move, before anyone
// asks for it (what `morph-plan` prints; docs/reshard-planner.md "morph-plan" gives the input's
// JSON: the model's tensors and layouts, the old and new configs, which workers survive).
//
//   MORPH_ASSIGN_OR_RETURN(morph::PlanDryRun plan, morph::DryRunPlan(json_text));
//   std::cout << plan.summary;              // assignment, bytes moved vs the lower bound, ...
//   if (plan.bytes_lost > 0) ...            // no surviving holder: a checkpoint is needed
//
// Pure computation; any thread.
#ifndef MORPH_PLAN_H_
#define MORPH_PLAN_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "morph/api.h"
#include "morph/status.h"

namespace morph {

struct MORPH_API PlanDryRunOptions {
  // Report pieces no surviving participant holds (bytes_lost) instead of failing with kDataLoss.
  bool allow_lost = false;
};

struct MORPH_API PlanDryRun {
  int64_t bytes_needed = 0;       // the new shards' bytes, over every new rank
  int64_t bytes_resident = 0;     // of those, already where they are needed
  int64_t bytes_lower_bound = 0;  // bytes_needed - bytes_resident
  int64_t bytes_moved = 0;        // what the plan moves (the lower bound, minus bytes_lost)
  int64_t bytes_lost = 0;         // no surviving holder (allow_lost only)
  int64_t busiest_link_bytes = 0;
  int64_t num_sends = 0;
  std::string summary;  // morph-plan's text
  std::string json;     // morph-plan --json's document (the whole plan)
};

// kInvalidArgument with the JSON path of the offending field first ("$.tensors[3].shape[1]: -4
// is negative"); kDataLoss naming the tensor and box when a piece has no surviving holder
// (without allow_lost).
MORPH_API StatusOr<PlanDryRun> DryRunPlan(std::string_view request_json,
                                          const PlanDryRunOptions& options = {});

}  // namespace morph

#endif  // MORPH_PLAN_H_
