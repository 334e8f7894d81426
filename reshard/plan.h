// Planner: the minimal-movement reshard plan between two generations (docs/design.md §6,
// docs/reshard-planner.md).
//
// Given the old generation (config, which participant held each old rank) and the new one
// (config, the participants available: survivors plus joiners), the planner
//   (a) assigns participants to new logical ranks so that the bytes already resident are
//       maximal: ComputeAssignment is exact at every supported size (an optimal assignment,
//       proof in docs/reshard-planner.md §2.5); extra participants become standby. The
//       coordinator computes it once and ships it; every participant passes it to Create,
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
//   // coordinator, once:
//   MORPH_ASSIGN_OR_RETURN(Assignment a, ComputeAssignment(in));
//   // every participant, with the shipped assignment:
//   MORPH_ASSIGN_OR_RETURN(Planner planner, Planner::Create(std::move(in), std::move(a)));
//   int32_t my_new_rank = planner.assignment().new_rank_of_participant[me];   // -1: standby
//   MORPH_ASSIGN_OR_RETURN(LocalPlan mine, planner.PlanFor(me));
//
// Thread-safety: a Planner is immutable after Create; any thread may call its const methods
// concurrently. ComputeAssignment is a pure function; any thread.
#ifndef MORPH_RESHARD_PLAN_H_
#define MORPH_RESHARD_PLAN_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "morph/parallel_config.h"
#include "morph/status.h"
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

// Size limits, checked up front by ComputeAssignment and both Create overloads
// (kInvalidArgument naming the limit). Within them planning time is bounded: the assignment
// takes well under a second at 16,384 ranks (docs/reshard-planner.md §5). A caller may lower
// them; raising them is at the caller's risk (cost grows with world size, see §2.6).
inline constexpr int32_t kMaxPlanWorld = 65536;      // ranks of either config
inline constexpr int32_t kMaxPlanTensors = 1 << 20;  // registered tensors
struct PlanOptions {
  int32_t max_world = kMaxPlanWorld;  // also bounds num_participants (old world + new world)
  int32_t max_tensors = kMaxPlanTensors;
};

struct Assignment {
  // The only field ComputeAssignment's consumer must ship: new rank -> participant.
  std::vector<int32_t> participant_of_new_rank;  // size new world
  // Derived from participant_of_new_rank and the input (Create fills them; if given, they
  // must agree).
  std::vector<int32_t> new_rank_of_participant;  // size num_participants, -1: standby/leaving
  std::vector<int32_t> old_rank_of_participant;  // size num_participants, -1: joiner/none
  // True when computed by ComputeAssignment (it maximizes resident bytes); Create(input,
  // assignment) keeps the flag it is given (the caller vouches for it).
  bool exact = true;
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
  // Validates the input and computes the assignment (ComputeAssignment below).
  // kInvalidArgument naming the field: a config or tensor that does not validate (message
  // prefixed "old config"/"new config"), a duplicate tensor name, old_participant_of_rank of the
  // wrong size or with a participant out of range or listed twice, `available` with a duplicate
  // or out-of-range participant, fewer available participants than new ranks, a world, a
  // participant count or a tensor count beyond `options` (the message names the limit), a model
  // whose total bytes exceed 2^60. Any thread; no communication.
  static StatusOr<Planner> Create(PlanInput input, const PlanOptions& options = {});
  // Validates the input as above and adopts `assignment` (e.g. the coordinator's, as shipped):
  // kInvalidArgument, naming what is wrong, if participant_of_new_rank does not have one entry
  // per new rank, names a participant that is not available, or names one twice, or if the
  // derived vectors are given and disagree. Resident bytes are whatever that assignment keeps.
  static StatusOr<Planner> Create(PlanInput input, Assignment assignment,
                                  const PlanOptions& options = {});

  // The input as given (block-interleaved tensors in their real shapes).
  const PlanInput& input() const { return *orig_; }
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

  // The first piece of a new shard that no surviving old rank holds (a recovery's coverage
  // check), or nullopt when every new shard is covered. Such a piece was held only by old ranks
  // that are gone (old_participant_of_rank -1: lost or stale), so only their shards are looked
  // at: the cost is proportional to what the gone ranks held, not to the world (PlanAll(&lost)
  // finds the same pieces from every participant's side). `box` is in the planner's
  // coordinates, as PlanFor's lost pieces; `new_rank` needs it (its `participant`, or -1).
  struct LostPiece {
    int32_t tensor = -1;
    Box box;
    int32_t new_rank = -1;
    int32_t participant = -1;
  };
  std::optional<LostPiece> FirstLostPiece() const;

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
  // Validation, per-class aggregates and old_rank_of_participant (plan.cc).
  static StatusOr<Planner> Prepare(PlanInput input, const PlanOptions& options);
  // The exact assignment into `participant_of_new_rank` (size new world, all -1); plan_assign.cc.
  Status SolveAssignment(std::vector<int32_t>& participant_of_new_rank) const;
  void DeriveNewRanks();

  std::shared_ptr<const PlanInput> orig_;  // as given: the digest and input()
  std::shared_ptr<const PlanInput> in_;    // tensors as PlanningSpec: what the planner uses
  std::shared_ptr<const Classes> classes_;
  Assignment assignment_;
  PlanDigest digest_;
};

// The assignment maximizing resident bytes: Σ over new ranks s of the bytes of s's new shards
// that its participant already holds, over every injective map new rank -> available
// participant (exact: no other assignment keeps more; ties broken deterministically, so every
// caller computes the same one). Errors: as Planner::Create; kInvalidArgument if the weights
// are too large for exact 64-bit arithmetic (cannot happen within the limits for models below
// 2^40 bytes per rank pair). Any thread; no communication.
StatusOr<Assignment> ComputeAssignment(const PlanInput& input, const PlanOptions& options = {});

}  // namespace morph

#endif  // MORPH_RESHARD_PLAN_H_
