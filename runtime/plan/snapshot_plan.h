// The state exchange of a recovery from buddy snapshots (RecoveryDecision::kSnapshot,
// docs/design.md "Failures, as built"). Every old rank r's state at the snapshot step comes from
// one worker, holders[r]: from.ranks[r] itself (its own local copy) or r's buddy (the copy it
// holds for r). The reshard planner maps each old rank to one participant, and a buddy serves
// two old ranks (its own and its ward's), so the exchange runs in two rounds over the same
// participants and new shards:
//
//   round A ("own"):  PlanForChange with change.stale = the live old ranks served by their
//                     buddy; lost and stale ranks' pieces are lost (unwritten) in this round;
//   round B ("held"): old rank r held by holders[r] where that is not from.ranks[r], every other
//                     old rank lost, each piece cut to what round A left lost on its receiver;
//                     what round A delivered is this round's `lost`.
//
// So each round's recvs + local copies + lost cover every new shard exactly once (the executor's
// check, reshard/coverage.h, runs unchanged on both), and round B writes exactly the elements
// round A left. Both sides of a pair cut round B alike (the sender computes its receivers'
// round-A lost pieces), so their piece lists match.
//
//   MORPH_ASSIGN_OR_RETURN(SnapshotChangePlan plan,
//       PlanForSnapshot(manifest, from, commit.next, commit.change, holders));
//   if (plan.digest != commit.next.plan_digest) -> kFailedPrecondition
//   MORPH_ASSIGN_OR_RETURN(SnapshotRounds mine, PlanSnapshotRounds(plan, participant));
//   ExecutePlan(mine.own, <own local copy>, news, ...); ExecutePlan(mine.held, <held copy>, news,
//   ...);
//
// Pure functions; any thread. Cost: round B's cut plans for this participant's round-B peers
// (their round-A plans), proportional to their pieces.
#ifndef MORPH_RUNTIME_PLAN_SNAPSHOT_PLAN_H_
#define MORPH_RUNTIME_PLAN_SNAPSHOT_PLAN_H_

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "morph/status.h"
#include "reshard/local_plan.h"
#include "reshard/plan.h"
#include "runtime/plan/manifest.h"
#include "runtime/protocol/messages.h"
#include "runtime/plan/plan_input.h"

namespace morph {

struct SnapshotChangePlan {
  ChangePlan own;               // round A (participants, executor options, planner)
  std::optional<Planner> held;  // round B; null when no old rank is served by another worker
  // The commit's next.plan_digest: both rounds' planner digests and message layout.
  uint64_t digest = 0;
  // Round B: the old rank whose held copy each holder participant serves.
  std::map<int32_t, int> ward_of;
  // As given to PlanForSnapshot (empty: not known).
  std::vector<std::vector<int64_t>> held_tensors;
};

// `holders`: one worker per old rank of `from` (RecoveryDecision::snapshot_holders), -1 for a
// rank no copy serves (each of its pieces must then be in another rank's own copy);
// `change.stale` must be exactly the live old ranks whose holder is not themselves.
// `held_tensors` (the coordinator's, from the step reports: SnapshotHoldings::held_tensors),
// empty or one ascending list per old rank: the tensors whose shard of that rank its holder's
// copy holds (read for the ranks served by another worker); PlanSnapshotRounds then proves
// that every piece round B needs is in them. Participants pass none: the commit was proven.
// kInvalidArgument naming what is inconsistent: holders or held_tensors of the wrong size, a
// holder that is no participant holding an old rank, a holder serving two other ranks, a lost
// rank served by itself, `stale` not as described; PlanForChange's errors. The first
// generation has no snapshot: kInvalidArgument.
StatusOr<SnapshotChangePlan> PlanForSnapshot(const JobManifest& manifest, const Generation& from,
                                             const Generation& next,
                                             const ChangeParticipants& change,
                                             std::span<const WorkerId> holders,
                                             std::span<const std::vector<int64_t>> held_tensors = {});

struct SnapshotRounds {
  LocalPlan own;   // round A
  // Round B (empty lists when plan.held is null: everything is in `lost`). Its old shards are
  // only those of the tensors it sends or copies pieces of.
  LocalPlan held;
};

// Participant `participant`'s plans of both rounds. kDataLoss "no snapshot copy of tensor 'T'
// box B (needed by participant P, worker W)" when an element is in neither round (no copy
// holds it; with plan.held_tensors, also when the held copy round B would read it from does
// not hold that tensor); kInvalidArgument for a participant out of range.
StatusOr<SnapshotRounds> PlanSnapshotRounds(const SnapshotChangePlan& plan, int32_t participant);

}  // namespace morph

#endif  // MORPH_RUNTIME_PLAN_SNAPSHOT_PLAN_H_
