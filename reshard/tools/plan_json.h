// The JSON front end of morph-plan: parses a model description and two configurations into a
// PlanInput, and renders a plan as a text summary or JSON (docs/reshard-planner.md, "morph-plan").
//
//   MORPH_ASSIGN_OR_RETURN(PlanRequest req, ParsePlanRequest(text));
//   MORPH_ASSIGN_OR_RETURN(Planner planner, Planner::Create(req.input));
//
// Errors are kInvalidArgument with the JSON path of the offending field first:
// "$.tensors[3].shape[1]: -4 is negative". Any thread.
#ifndef MORPH_RESHARD_TOOLS_PLAN_JSON_H_
#define MORPH_RESHARD_TOOLS_PLAN_JSON_H_

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "morph/status.h"
#include "reshard/plan.h"

namespace morph {

struct PlanRequest {
  PlanInput input;
  // Participant id -> worker name (old workers in old rank order, then joiners).
  std::vector<std::string> worker_names;
};

StatusOr<PlanRequest> ParsePlanRequest(std::string_view text);

struct PlanTimes {
  double create_seconds = 0;     // validation + assignment
  double plans_seconds = 0;      // every participant's PlanFor, summed
  double max_local_seconds = 0;  // the slowest participant's PlanFor
};

// Human-readable summary (what a scheduler or a person reads before a resize).
std::string FormatPlanSummary(const PlanRequest& req, const Planner& planner,
                              const PlanSummary& summary, const PlanTimes& times);
// The whole plan: assignment, summary and every participant's moves.
// `lost`: per participant, pieces with no surviving holder (PlanAll's), or empty.
nlohmann::json PlanToJson(const PlanRequest& req, const Planner& planner,
                          const std::vector<LocalPlan>& plans,
                          const std::vector<std::vector<PieceMove>>& lost,
                          const PlanSummary& summary, const PlanTimes& times);

}  // namespace morph

#endif  // MORPH_RESHARD_TOOLS_PLAN_JSON_H_
