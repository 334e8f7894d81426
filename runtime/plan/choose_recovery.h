// ChooseRecovery: which state a recovery resumes from (docs/design.md §4 "Failure", §9
// "Failures, as built"). After a failure every surviving old rank reports, at its step boundary,
// the step its state holds and whether that state is whole (StepReportMsg::state_step /
// state_ok). The coordinator then picks, off its I/O thread:
//
//   1. the newest step v such that the survivors whose state is whole and at v hold a copy of
//      every piece the new generation needs (replicas: DP copies of parameters, hybrid ZeRO
//      groups, TP/PP duplicates); survivors at another step or torn are `stale` (they receive
//      everything, like joiners, and roll forward or back to v). A survivor whose undo copy
//      (StepReportMsg::undo_step, MORPH_UNDO_COPY) is at v counts as holding v: it puts the
//      copy back first;
//   2. else the newest step k at which every old rank's buddy snapshot survives (StepReportMsg::
//      snapshots): the rank's worker alive with its local copy of k, else a survivor holding
//      the rank's copy of k (its buddy); and the two exchange rounds of runtime/plan/
//      snapshot_plan.h cover every new piece. Everyone rolls back to k: source kSnapshot,
//      decision.snapshot_holders = the worker serving each old rank, `stale` = the live old
//      ranks served by their buddy (their own copy is missing) — unless the checkpoint below
//      is of a later step (it loses fewer steps);
//   3. else the latest complete checkpoint: everyone rolls back to it;
//   4. else kDataLoss naming the tensor and box that has no copy left.
//
// Why this is consistent: a worker's state is either whole at one step (every update before it
// applied, none after: it stopped between EndStep and BeginUpdate of the next step) or torn
// (stopped after BeginUpdate and before EndStep); only whole state at the chosen step is ever
// read, so every piece of every rank after the recovery holds the values of that one step.
//
//   MORPH_ASSIGN_OR_RETURN(RecoveryChoice c,
//       ChooseRecovery(manifest, from, next, change, reports, latest_checkpoint));
//   commit.next.start_step = c.resume_step; commit.change.stale = c.stale;
//   commit.next.plan_digest = c.plan_digest; commit.recovery = c.decision;
//
// Pure function; any thread. Cost: one PlanAll per candidate step (a few per recovery), and
// for option 2 both rounds' plans of every participant per candidate snapshot step.
#ifndef MORPH_RUNTIME_PLAN_CHOOSE_RECOVERY_H_
#define MORPH_RUNTIME_PLAN_CHOOSE_RECOVERY_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "morph/status.h"
#include "runtime/plan/manifest.h"
#include "runtime/protocol/messages.h"

namespace morph {

// A complete checkpoint on storage the coordinator can see.
struct RecoveryCheckpoint {
  int64_t step = 0;
  std::string path;
  // Resume at start: the step of a newer complete checkpoint passed over because it is damaged
  // (-1: none). The steps between are lost and trained again (Reconfiguration::lost_steps).
  int64_t skipped_step = -1;
};

struct RecoveryChoice {
  int64_t resume_step = 0;
  std::vector<WorkerId> stale;  // participants (old ranks) whose state is not used
  RecoveryDecision decision;
  uint64_t plan_digest = 0;  // of the change with `stale` (the commit's next.plan_digest)
  std::string explanation;   // one log line: why this step and source
};

// `reports`: one per surviving old rank of `from` (its worker id in `worker`), any order.
// `next` and `change` as prepared (change.stale empty). kDataLoss "no copy of tensor 'T' box
// B (old rank r) survives: ..." when nothing covers a piece; kInvalidArgument when a report
// names a worker that is no surviving old rank, or one is missing.
StatusOr<RecoveryChoice> ChooseRecovery(const JobManifest& manifest, const Generation& from,
                                        const Generation& next, const ChangeParticipants& change,
                                        std::span<const StepReportMsg> reports,
                                        const std::optional<RecoveryCheckpoint>& checkpoint);

}  // namespace morph

#endif  // MORPH_RUNTIME_PLAN_CHOOSE_RECOVERY_H_
