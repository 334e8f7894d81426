// morph/plan.h: the planner's dry run over plan_json's front end (what morph-plan prints).
#include <algorithm>
#include <chrono>
#include <sstream>

#include "morph/plan.h"
#include "reshard/tools/plan_json.h"

namespace morph {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

StatusOr<PlanDryRun> DryRunPlan(std::string_view request_json, const PlanDryRunOptions& options) {
  MORPH_ASSIGN_OR_RETURN(PlanRequest req, ParsePlanRequest(request_json));
  PlanTimes times;
  auto t0 = std::chrono::steady_clock::now();
  StatusOr<Planner> planner = Planner::Create(req.input);
  times.create_seconds = Since(t0);
  if (!planner.ok()) return planner.status();
  std::vector<LocalPlan> plans;
  std::vector<std::vector<PieceMove>> lost;
  if (options.allow_lost) lost.resize(static_cast<size_t>(req.input.num_participants));
  for (int32_t q = 0; q < req.input.num_participants; ++q) {
    auto t1 = std::chrono::steady_clock::now();
    StatusOr<LocalPlan> lp =
        planner->PlanFor(q, options.allow_lost ? &lost[static_cast<size_t>(q)] : nullptr);
    const double dt = Since(t1);
    if (!lp.ok()) return lp.status().WithContext("worker " + req.worker_names[q]);
    times.plans_seconds += dt;
    times.max_local_seconds = std::max(times.max_local_seconds, dt);
    plans.push_back(*std::move(lp));
  }
  MORPH_ASSIGN_OR_RETURN(PlanSummary s,
                         planner->Summarize(plans, options.allow_lost ? &lost : nullptr));
  PlanDryRun out{.bytes_needed = s.bytes_needed,
                 .bytes_resident = s.bytes_resident,
                 .bytes_lower_bound = s.bytes_lower_bound,
                 .bytes_moved = s.bytes_moved,
                 .bytes_lost = s.bytes_lost,
                 .busiest_link_bytes = s.busiest_link.bytes,
                 .num_sends = s.num_sends};
  out.summary = FormatPlanSummary(req, *planner, s, times);
  out.json = PlanToJson(req, *planner, plans, lost, s, times).dump(1);
  return out;
}

}  // namespace morph
