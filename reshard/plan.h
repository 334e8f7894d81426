// Planner: the minimal-movement reshard plan between two generations (docs/design.md §6,
// docs/reshard-planner.md).
//
// Given the old generation (config, which participant held each old rank) and the new one
// (config, the participants available: survivors plus joiners), the planner
//   (a) assigns participants to new logical ranks so that the bytes already resident are
//       maximal (exact on small worlds, a structured greedy on large ones; extra participants
//       become standby),
//   (b) gives every participant its LocalPlan (sends, recvs, local copies) such that bytes
//       moved equal the lower bound for that assignment and replicated pieces are served by
//       balanced senders,
//   (c) summarises the plan for tools (bytes moved, lower bound, per sender/receiver, busiest
//       link).
// Every participant runs it on the same input and gets the same plan without communicating.
//
//   PlanInput in{.tensors = registry.tensors(), .old_config = old_cfg,
//                .old_participant_of_rank = {0, 1, 2, 3}, .new_config = new_cfg,
//                .available = {0, 1, 3}, .num_participants = 4};
//   MORPH_ASSIGN_OR_RETURN(Planner planner, Planner::Create(std::move(in)));
//   int32_t my_new_rank = planner.assignment().new_rank_of_participant[me];   // -1: standby
//   MORPH_ASSIGN_OR_RETURN(LocalPlan mine, planner.PlanFor(me));
//
// Thread-safety: a Planner is immutable after Create; any thread may call its const methods
// concurrently.
#ifndef MORPH_RESHARD_PLAN_H_
#define MORPH_RESHARD_PLAN_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "base/parallel_config.h"
#include "base/status.h"
#include "reshard/layout.h"
#include "reshard/local_plan.h"

namespace morph {

struct PlanInput {
  // The registered tensors; the same specs (and layouts) in both generations.
  std::vector<TensorSpec> tensors;
  ParallelConfig old_config;
  // Old rank -> participant that held it, -1 when its data is lost (a dead worker). Size
  // old_config.world(). Participants holding an old rank but not `available` are leavers:
  // they send and get no new rank.
  std::vector<int32_t> old_participant_of_rank;
  ParallelConfig new_config;
  // Participants that may take a new rank (survivors and joiners), any order, at least
  // new_config.world() of them.
  std::vector<int32_t> available;
  int32_t num_participants = 0;
};

struct PlanOptions {
  // The assignment is exact (Hungarian) when |available| * new world <= this, else structured.
  int64_t exact_assignment_limit = 16384;  // 128 x 128: ~20 ms
};

struct Assignment {
  std::vector<int32_t> participant_of_new_rank;  // size new world
  std::vector<int32_t> new_rank_of_participant;  // size num_participants, -1: standby/leaving
  std::vector<int32_t> old_rank_of_participant;  // size num_participants, -1: joiner/none
  bool exact = false;                            // computed by the exact method
};

// Global byte counts of a plan (what morph-plan prints).
struct PlanSummary {
  int64_t bytes_needed = 0;       // Σ over new ranks of their new shards' bytes
  int64_t bytes_resident = 0;     // of those, already on the assigned participant
  int64_t bytes_lower_bound = 0;  // bytes_needed - bytes_resident
  int64_t bytes_moved = 0;        // Σ of every participant's recvs
  int64_t bytes_lost = 0;  // no surviving holder: bytes_moved + bytes_lost = bytes_lower_bound
  std::vector<int64_t> bytes_sent;      // per participant
  std::vector<int64_t> bytes_received;  // per participant
  int32_t busiest_sender = -1;
  int32_t busiest_receiver = -1;
  struct Link {
    int32_t from = -1;
    int32_t to = -1;
    int64_t bytes = 0;
  } busiest_link;
  int64_t num_sends = 0;
};

// Bytes of one piece: elements of its box times the tensor's dtype size.
int64_t PieceBytes(const LocalPlan& plan, const PieceMove& piece);

class Planner {
 public:
  // Validates the input and computes the assignment.
  // kInvalidArgument naming the field: a config or tensor that does not validate (message
  // prefixed "old config"/"new config"), a duplicate tensor name, old_participant_of_rank of the
  // wrong size or with a participant out of range or listed twice, `available` with a duplicate
  // or out-of-range participant, fewer available participants than new ranks.
  // Any thread; no communication.
  static StatusOr<Planner> Create(PlanInput input, const PlanOptions& options = {});

  const PlanInput& input() const { return *in_; }
  const Assignment& assignment() const { return assignment_; }
  // Digest of the input, options and assignment (plan_digest.h); copied into every LocalPlan.
  // A field added to PlanInput, TensorSpec or PlanOptions must be added to DigestPlanInput.
  const PlanDigest& digest() const { return digest_; }

  // The participant's part of the plan. kInvalidArgument if `participant` is out of range.
  // When an element the participant needs has no surviving holder: with `lost` == nullptr,
  // kDataLoss naming the tensor and box; otherwise the piece is appended to `*lost` (peer -1,
  // sorted like the other lists) and the plan covers the rest: recvs + local_copies + lost
  // cover every new shard exactly once, and the caller fills `lost` (e.g. from a checkpoint).
  // Cost: proportional to the pieces the participant holds or needs (and to the DP/TP
  // replicas of those pieces), not to world size times tensors.
  StatusOr<LocalPlan> PlanFor(int32_t participant, std::vector<PieceMove>* lost = nullptr) const;
  // Every participant's plan (for tools and tests): the first PlanFor error, with the
  // participant as context. `lost`, if given, gets one list per participant.
  StatusOr<std::vector<LocalPlan>> PlanAll(
      std::vector<std::vector<PieceMove>>* lost = nullptr) const;

  // Needed and resident bytes of the assignment, computed from per-class aggregates (cost
  // grows with world size times distinct tensor shapes, not with tensors).
  struct Totals {
    int64_t needed = 0;
    int64_t resident = 0;
    bool overflow = false;  // needed does not fit int64 (then needed/resident are meaningless)
  };
  Totals ComputeTotals() const;
  // Exact resident bytes if `participant` took new rank `new_rank` (0 for joiners). Both must
  // be in range (a precondition, not checked).
  int64_t ResidentBytes(int32_t participant, int32_t new_rank) const;

  // Byte counts of a whole plan (every participant's LocalPlan, in participant order, and the
  // lost pieces PlanAll reported, if any). kInvalidArgument if `plans` or `lost` has the wrong
  // size or a byte total overflows int64 (message starts "bytes needed" when the new shards'
  // total does); kInternal if the plans disagree (bytes sent != bytes received).
  StatusOr<PlanSummary> Summarize(const std::vector<LocalPlan>& plans,
                                  const std::vector<std::vector<PieceMove>>* lost = nullptr) const;

  struct Classes;  // per-class aggregates (plan.cc)

 private:
  Planner() = default;
  Status ComputeAssignment(const PlanOptions& options);
  // The structured (large-world) assignment; plan_assign.cc.
  void StructuredAssign(std::vector<int32_t>& participant_of_new_rank) const;

  std::shared_ptr<const PlanInput> in_;
  std::shared_ptr<const Classes> classes_;
  Assignment assignment_;
  PlanDigest digest_;
};

}  // namespace morph

#endif  // MORPH_RESHARD_PLAN_H_
