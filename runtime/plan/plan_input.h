// What the coordinator and every participant derive identically from a change's decision: the
// participant numbering, the reshard planner's input and assignment, and the digest the commit
// carries (docs/design.md §6 property 3: the assignment is computed once, exactly, by the
// coordinator and shipped; every participant checks the digest before the first byte moves).
//
//   // coordinator, off its I/O thread, for a proposal:
//   MORPH_ASSIGN_OR_RETURN(std::vector<WorkerId> ranks,
//       AssignRanks(manifest, from, lost, candidates, next_config));
//   next.ranks = ranks;
//   ChangeParticipants change = {.participants = ParticipantOrder(from, lost, ranks), ...};
//   MORPH_ASSIGN_OR_RETURN(ChangePlan plan, PlanForChange(manifest, from, next, change));
//   next.plan_digest = plan.digest;
//   // each participant, at the commit:
//   MORPH_ASSIGN_OR_RETURN(ChangePlan plan, PlanForChange(manifest, from, commit.next, commit.change));
//   if (plan.digest != commit.next.plan_digest) -> kFailedPrecondition
//
// The first generation (from.id == 0) moves no state: PlanForChange gives no planner and a
// digest of the manifest and the config only.
//
// Pure functions; any thread.
#ifndef MORPH_RUNTIME_PLAN_PLAN_INPUT_H_
#define MORPH_RUNTIME_PLAN_PLAN_INPUT_H_

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "morph/status.h"
#include "reshard/executor.h"
#include "reshard/plan.h"
#include "runtime/plan/manifest.h"
#include "runtime/protocol/messages.h"

namespace morph {

// ChangeParticipants::participants: the workers of `from`'s ranks that are not `lost`, in old-rank
// order, then the workers of `next_ranks` that held no rank in `from`, in worker-id order.
std::vector<WorkerId> ParticipantOrder(const Generation& from, std::span<const WorkerId> lost,
                                       std::span<const WorkerId> next_ranks);

// The exact assignment (reshard's ComputeAssignment: resident bytes maximal) of `candidates`
// (surviving old ranks, spares and joiners; any order, no duplicates) to the ranks of
// `next_config`: the worker of each new rank. For the first generation (from.id == 0), the
// first next_config.world() candidates in id order. kInvalidArgument / kFailedPrecondition
// naming what is wrong: fewer candidates than ranks, a tensor that does not fit a config, the
// planner's limits.
StatusOr<std::vector<WorkerId>> AssignRanks(const JobManifest& manifest, const Generation& from,
                                            std::span<const WorkerId> lost,
                                            std::span<const WorkerId> candidates,
                                            const ParallelConfig& next_config);

// Everything a participant needs to reshard from `from` to `next`.
struct ChangePlan {
  // Null for the first generation (nothing to move).
  std::optional<Planner> planner;
  // participant index of each worker (change.participants order).
  std::vector<WorkerId> participants;
  ExecutorOptions executor;  // from the manifest's chunk and staging bytes
  // The commit's plan digest: WithMessageLayout(planner digest, executor, n).combined(); for
  // the first generation a digest of the manifest and next's config and ranks.
  uint64_t digest = 0;
  // The participant index of `w`, -1 if it does not take part.
  int32_t IndexOf(WorkerId w) const;
};

// Builds the planner's input from the decision: old_participant_of_rank from `from.ranks`
// (-1 for lost workers), available = the participants that hold a rank in `next`, the
// assignment from `next.ranks`, and Planner::Create(input, assignment). kInvalidArgument when
// the decision is inconsistent (a rank's worker is not a participant, participants differ from
// ParticipantOrder) or the planner refuses the input (its message).
StatusOr<ChangePlan> PlanForChange(const JobManifest& manifest, const Generation& from,
                                   const Generation& next, const ChangeParticipants& change);

// Digest of the manifest (everything FirstDifference compares); never 0.
uint64_t ManifestDigest(const JobManifest& manifest);

}  // namespace morph

#endif  // MORPH_RUNTIME_PLAN_PLAN_INPUT_H_
