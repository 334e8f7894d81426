// The control protocol's messages as values: what the coordinator and a worker's agent say to
// each other about membership and generations (docs/design.md, "Planned change"). The wire
// encoding (versioned, length-framed, bounded) is separate; these structs are what the pure
// state machines on both sides (runtime/coordinator/decider.h, runtime/agent/agent_core.h)
// consume and produce, so a deterministic simulation can drive them without sockets.
//
// Plain values; thread-compatible.
#ifndef MORPH_RUNTIME_PROTOCOL_MESSAGES_H_
#define MORPH_RUNTIME_PROTOCOL_MESSAGES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "morph/parallel_config.h"
#include "morph/generation.h"
#include "morph/options.h"
#include "morph/state.h"
#include "reshard/layout.h"

namespace morph {

// ---- The job manifest (registration agreement): what every worker registers with the
// coordinator, and what must be equal on all of them (checked by runtime/plan/manifest.h). ----



struct JobManifest {
  ModelShape model;
  std::vector<TensorSpec> tensors;  // registration order
  std::vector<ScalarSpec> scalars;  // registration order
  int64_t dataset_samples = 1;      // DatasetSpec::num_samples
  uint64_t dataset_seed = 0;
  bool dataset_shuffle = true;
  // ExecutorOptions that cut messages; equal everywhere (they are part of the plan digest).
  uint64_t chunk_bytes = uint64_t{4} << 20;
  uint64_t staging_bytes = uint64_t{256} << 20;
  // The step communicators' backend ("gloo", "nccl": Options::backend): a group cannot mix them,
  // so a worker with another one is refused at registration instead of timing out in a
  // rendezvous.
  std::string backend = "gloo";
  friend bool operator==(const JobManifest&, const JobManifest&) = default;
};


// The workers taking part in a change from generation `from` to the proposed one, numbered as
// the reshard planner and transport number participants: old ranks' workers in old-rank order
// (lost ones excluded), then new ranks' workers that held no old rank, in worker-id order.
struct ChangeParticipants {
  std::vector<WorkerId> participants;
  // Old ranks that hold no new rank: they send their state away (then exit if in `exiting`,
  // else stay as standby spares).
  std::vector<WorkerId> leavers;
  // Workers that leave the job once the change applied: asked to leave (SIGTERM, Leave(), a
  // resize's remove) or beyond a smaller world size.
  std::vector<WorkerId> exiting;
  std::vector<WorkerId> lost;  // old ranks whose state is gone
  // A recovery (docs/design.md §4 "Failure"): the change answers a failure (a member of `from`
  // lost, or a collective failure reported by a member) rather than a plan. Old ranks then
  // stop at their next step boundary (their in-flight collectives are aborted) and report the
  // step their state holds; the commit says which step training resumes from.
  bool recovery = false;
  // Commit of a recovery only: participants whose old state is not used (torn by a failed
  // update, or at another step than the one training resumes from). They receive their new
  // state like joiners; the plan treats their old ranks like lost ones.
  std::vector<WorkerId> stale;
  friend bool operator==(const ChangeParticipants&, const ChangeParticipants&) = default;
};

// Coordinator -> every participant (and joiners): build generation `next` beside the running
// one; old ranks answer with a StepReport and do not begin a step past the one they report.
struct PrepareMsg {
  Generation next;  // start_step not decided yet (0)
  int64_t from_generation = 0;
  // The generation the change starts from, whole (from.id == from_generation): joiners derive
  // the reshard plan from it.
  Generation from;
  ChangeParticipants change;
  friend bool operator==(const PrepareMsg&, const PrepareMsg&) = default;
};

// A worker's buddy snapshots of the generation it reports from (runtime/recovery/snapshot.h):
// its own complete local copies and the complete copies it holds for its ward, each the newest
// and the one before it (both are kept while the next is made). -1: none.
struct SnapshotHoldings {
  int64_t local_step = -1;
  int64_t local_prev_step = -1;
  int64_t held_step = -1;
  int64_t held_prev_step = -1;
  int64_t held_rank = -1;  // the old rank whose copies it holds (-1: none)
  // Tensor indices (ascending) whose shard of held_rank the held copies hold: the ward sends
  // only its pieces with no other copy in another failure domain (runtime/recovery/snapshot.h,
  // BuddyCopiedTensors); the others come from the survivors' own copies.
  std::vector<int64_t> held_tensors;
  bool HasLocal(int64_t s) const { return s >= 0 && (s == local_step || s == local_prev_step); }
  bool HasHeld(int64_t s) const { return s >= 0 && (s == held_step || s == held_prev_step); }
  friend bool operator==(const SnapshotHoldings&, const SnapshotHoldings&) = default;
};

// Old rank -> coordinator: the highest step it may begin in the old generation without a
// decision (it waits in BeginStep before any later step until the commit or an abandon).
struct StepReportMsg {
  WorkerId worker = 0;
  int64_t generation = 0;  // the proposed generation this answers
  int64_t last_free_step = 0;
  // Recovery prepares only (ChangeParticipants::recovery), sent at the worker's step boundary:
  // the step whose values its state holds (its next step: every update before it applied,
  // none of its own), and whether that state is whole (false: an update was cut short, or a
  // failed switch released old shards). -1 / true otherwise.
  int64_t state_step = -1;
  bool state_ok = true;
  // Buddy snapshots (MORPH_SNAPSHOT_EVERY), recovery prepares only.
  SnapshotHoldings snapshots;
  // MORPH_UNDO_COPY: the step of the copy of its state this worker took at its last
  // BeginUpdate, which it can put back locally (-1: none). A worker whose update went through
  // while a peer's did not (the commit vote reached some ranks only) can thus go back a step.
  int64_t undo_step = -1;
  // Runtime::CommitUpdate, the step's commit vote (recovery prepares only). `vote_step`: this
  // worker voted to commit that step and holds everything its update needs, but its vote did
  // not complete here, so it does not know whether every rank voted (its state is whole at
  // vote_step; it reaches vote_step + 1 by applying its update). `committed_step`: the newest
  // step whose vote completed here (every rank of the generation voted). -1: none. A vote that
  // completed on any survivor means every rank voted: the undecided ones then apply their
  // update, so the recovery resumes at vote_step + 1 with nothing lost (ChooseRecovery).
  int64_t vote_step = -1;
  int64_t committed_step = -1;
  friend bool operator==(const StepReportMsg&, const StepReportMsg&) = default;
};

// Where a recovery's state comes from, and what it cost (a commit of a recovery).
struct RecoveryDecision {
  using Source = RecoverySource;
  Source source = Source::kReplicas;
  // The newest step any survivor's state held: steps [next.start_step, newest_step) were
  // trained but are lost and are trained again.
  int64_t newest_step = 0;
  std::string checkpoint;  // kCheckpoint: its directory
  // kSnapshot: for each old rank r of `from`, the worker that serves its state at
  // next.start_step: from.ranks[r] itself (its own local copy), r's buddy (the held copy: its
  // pieces with no other copy), or -1 when r is lost and no copy of its own is needed (every
  // piece it held comes from another rank's local copy).
  std::vector<WorkerId> snapshot_holders;
  friend bool operator==(const RecoveryDecision&, const RecoveryDecision&) = default;
};

// Coordinator -> every participant: generation `next` starts at step next.start_step. For a
// recovery, next.start_step is the step training resumes from (it may be earlier than the
// step a worker stopped at: that worker rolls back) and every participant switches at its
// current boundary.
struct CommitMsg {
  Generation next;
  int64_t from_generation = 0;
  Generation from;  // as in PrepareMsg
  ChangeParticipants change;
  RecoveryDecision recovery;  // when change.recovery
  friend bool operator==(const CommitMsg&, const CommitMsg&) = default;
};

// Coordinator -> the members of `generation` (and the participants of a change in flight): a
// member was lost, so the generation's collectives (and any switch in flight) can no longer
// complete. Each agent aborts them at once (the training thread's collectives return kAborted
// instead of waiting for a timeout) and no step of `generation` begins any more: only a change
// (the recovery that follows) lets the worker train again.
struct AbortMsg {
  int64_t generation = 0;
  std::string reason;
  friend bool operator==(const AbortMsg&, const AbortMsg&) = default;
};

// Worker -> coordinator: a collective of generation `generation` failed on this worker during
// step `step` (Runtime::AbortStep). `peers`: the workers the communicator named as failed
// (CollectiveFailure), possibly empty. The coordinator treats named members as lost and starts
// a recovery (with nobody lost when none is named: new communicators, state reconciled).
struct FailureReportMsg {
  int64_t generation = 0;
  int64_t step = 0;
  std::vector<WorkerId> peers;
  std::string error;
  friend bool operator==(const FailureReportMsg&, const FailureReportMsg&) = default;
};

// Coordinator -> participants of a proposal that will not be committed (a participant was lost
// before the commit): drop what was built for it; old ranks may step on freely again.
struct AbandonMsg {
  int64_t generation = 0;
  friend bool operator==(const AbandonMsg&, const AbandonMsg&) = default;
};

// Participant -> coordinator: it finished switching to `generation` (state exchanged, closing
// barrier passed), or failed to (its old state is intact).
struct AppliedMsg {
  WorkerId worker = 0;
  int64_t generation = 0;
  bool ok = true;
  std::string error;  // when !ok
  // This participant's phases of the switch, in microseconds (what /v1/status and /metrics
  // show per change: the maximum over participants).
  struct Phases {
    int64_t communicators_us = 0, plan_us = 0, transfer_us = 0, resume_us = 0, stall_us = 0;
    friend bool operator==(const Phases&, const Phases&) = default;
  } phases;
  friend bool operator==(const AppliedMsg&, const AppliedMsg&) = default;
};

// Coordinator -> every surviving participant, once every one of them answered Applied (or was
// lost): whether `generation` took effect. Applied if any participant passed its closing barrier
// (then every participant's exchange had completed); otherwise every participant keeps its old
// state and stays in the old generation. A leaver that gets applied = true is done.
struct OutcomeMsg {
  int64_t generation = 0;
  bool applied = false;
  friend bool operator==(const OutcomeMsg&, const OutcomeMsg&) = default;
};

// Coordinator -> a worker that holds no rank and asked to leave (or is no longer needed): it
// may exit now. Finished() becomes true.
struct ReleaseMsg {
  int64_t generation = 0;  // the current generation when it was released
  friend bool operator==(const ReleaseMsg&, const ReleaseMsg&) = default;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_PROTOCOL_MESSAGES_H_
