// Decider: the coordinator's decisions as a pure state machine (docs/design.md §9, "One
// decider"). Events in (a worker joined, asked to leave, was lost, reported its step, applied a
// generation; a resize request; a plan computed; a clock tick), actions out (messages to send,
// a plan to compute, a resize answer, workers to launch). It does no I/O, reads no clock and
// owns no thread: the coordinator's Asio shell feeds it and carries out its actions, and a
// deterministic simulation (decider_sim_test.cc) drives it through thousands of seeded
// schedules with delays, reorderings and duplicated messages.
//
//   Decider d(DeciderOptions{.initial_world = 4});
//   std::vector<DeciderAction> out = d.Handle(now_ms, DeciderEvent::Join{.worker = 7});
//   for (auto& a : out) shell.Execute(a);   // sends, starts plan computations, answers HTTP
//
// Protocol for a change (generation g -> g+1):
//   1. a trigger (join, leave, loss, resize) while stable: ComputePlan (the shell runs the
//      config planner and the exact assignment off the I/O thread) -> PlanReady;
//   2. Prepare(g+1) to every participant; each old rank answers StepReport(b_i): it may begin
//      steps up to b_i in generation g and waits in BeginStep before b_i + 1;
//   3. when every old rank reported: S = max(b_i) + 1 (at least g's start step), Commit(g+1, S).
//      No worker has begun a step >= S in g (each stopped at b_i < S), and every worker can
//      reach S (nothing waits on anything but the commit), so all switch at S;
//   4. every participant answers Applied(g+1) after its closing barrier (or a failure); then
//      Outcome(g+1, applied) to all: applied if any passed the barrier. Leavers are then done.
// One change at a time: triggers during a change are folded into the next one, proposed from
// the state once the current change is done. A participant lost before the commit abandons the
// proposal (Abandon, then a new proposal with a new generation id); one lost after the commit
// is a failure of the committed generation, handled once the change completes.
// Abort: when a member of the current generation (or a participant of the change in flight)
// is lost, every other member and participant gets Abort(current) at once: their collectives
// and switches cannot complete, so they stop waiting (and begin no step of it).
// Recovery (a member lost, or a member's collective failed: FailureReport; or a change that
// failed): the proposal has change.recovery set. Old ranks then stop at their next step boundary
// (their agents abort the old generation's collectives) and report the step their state holds;
// once all reported, the shell's ChooseRecovery picks the step and source
// (runtime/plan/choose_recovery.h) and the commit carries them (start_step = the resume step,
// change.stale, the digest with stale).
// Resume at start (DeciderOptions::resume): the first generation's plan is followed by
// FindResumeCheckpoint instead of the commit (phase kPreparing, nothing sent yet); with a
// checkpoint the commit is a recovery (change.recovery, RecoveryDecision::kCheckpoint) at the
// checkpoint's step, so every worker fills its new shards and the scalars from it; without one
// the commit is the usual fresh start at step 0; an error fails the job. A worker lost
// meanwhile abandons the proposal as for any prepare.
// Completion: a member whose training loop ended sends Done (a Done from a worker that holds no
// rank is ignored). From the first Done on the job is finishing: no change is proposed,
// resizes are refused, and the change in progress is dropped where nobody switched yet: a
// proposal being planned or prepared is abandoned; a committed one whose old rank finished
// before the switch step cannot apply (nobody passes its closing barrier): that rank counts as
// answered, its joiners are aborted out of the exchange, and it closes as not applied once
// every participant answered (the old generation stands as it was). Members not done finish
// their last step and say so; when the generation failed (a member lost or a failure reported,
// before or after the first Done) nothing is recovered any more, and the members not done are
// released instead: one waiting at a step boundary for the recovery gets done() there (a member
// that dies inside its last step first aborts the others still in theirs). Once no change is in
// progress and every member of the current generation is done, gone or was lost, the job is
// complete: the workers without a rank are released and JobComplete is emitted; later events
// are ignored.
//
// Thread-compatible: one thread (the coordinator's I/O thread) calls Handle.
#ifndef MORPH_RUNTIME_COORDINATOR_DECIDER_H_
#define MORPH_RUNTIME_COORDINATOR_DECIDER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "morph/parallel_config.h"
#include "morph/status.h"
#include "runtime/protocol/messages.h"
#include "runtime/plan/choose_recovery.h"

namespace morph {

struct DeciderOptions {
  // Workers that must have joined before the first generation is proposed.
  int initial_world = 1;
  // Largest world a resize may ask for.
  int max_world = 1 << 16;
  // A worker silent for longer is lost (MORPH_HEARTBEAT_TIMEOUT_MS); 0: never. So is a
  // survivor that has not reported its state this long after a recovery's prepare.
  int64_t heartbeat_timeout_ms = 0;
  // Resume at start (MORPH_RESUME): before committing the job's first generation, ask the
  // shell for a checkpoint to resume from (FindResumeCheckpoint); with one, the first generation
  // is a recovery from it (kCheckpoint) at its step.
  bool resume = false;
  // The id of the job's first generation (ids only grow from there); values below 1 mean 1.
  int64_t first_generation = 1;
  // After a succession (Resume): a worker the persisted state knows that has not reconnected
  // (Rejoin) this long after the successor took over is lost (MORPH_ETCD_REJOIN_MS).
  int64_t rejoin_timeout_ms = 10000;
};

// What the shell must compute for a proposal: a configuration and an assignment of candidates
// to ranks (runtime/coordinator/config_planner.h and reshard's exact assignment).
struct PlanRequest {
  int64_t generation = 0;  // the proposed generation's id
  // The generation the change starts from; id 0 (empty) for the first one.
  Generation from;
  // Workers that may take a rank: surviving old ranks, standby spares, joiners (id order).
  std::vector<WorkerId> candidates;
  std::vector<WorkerId> lost;  // old ranks whose state is gone
  // The most ranks the new generation may have (a resize's world size, the candidates).
  int target_world = 0;
};
struct PlannedChange {
  ParallelConfig config;
  std::vector<WorkerId> ranks;  // worker of each new rank, all from the request's candidates
  uint64_t plan_digest = 0;
  std::string explanation;  // why this config (one log line, /v1/status)
};

// A resize request, from the scheduler API (POST /v1/resize) or Coordinator::Resize alike:
// either world_size, or add and/or remove. The coordinator numbers every request from one
// counter (request_id: the id of the 202 reply, the log lines and the decider's answer).
struct ResizeRequest {
  int64_t request_id = 0;
  std::optional<int64_t> world_size;
  int64_t add = 0;               // workers to launch and take in
  std::vector<WorkerId> remove;  // workers to let go gracefully
  std::string reason;
};

// The most bytes a resize's reason may have.
inline constexpr size_t kMaxResizeReasonBytes = 1024;

// What a resize must be whatever the job's state, checked once for every door: world_size in
// [1, max_world] and not combined with add or remove; add in [0, max_world]; remove distinct
// non-negative worker ids; at least one of them; a reason of at most kMaxResizeReasonBytes.
// kInvalidArgument "<field>: ..." naming the field (the scheduler API's 400 names it too).
// The decider checks the rest against the job (a removed worker must exist, one change at a
// time, ...).
Status ValidateResize(const ResizeRequest& r, int64_t max_world);

struct DeciderEvent {
  struct Join {
    WorkerId worker = 0;
    std::string host;
  };
  struct LeaveRequest {  // the worker asks to go (SIGTERM: preemption notice; Leave())
    WorkerId worker = 0;
  };
  struct Lost {  // connection dropped, or a collective failure reported against it
    WorkerId worker = 0;
    std::string reason;
  };
  struct Heartbeat {
    WorkerId worker = 0;
  };
  struct Resize {
    ResizeRequest request;
  };
  struct PlanReady {
    int64_t generation = 0;
    StatusOr<PlannedChange> plan = InternalError("unset");
  };
  struct Tick {};
  struct Done {  // the worker's training loop ended normally (wire DoneMsg)
    WorkerId worker = 0;
  };
  // A member's collective failed (Runtime::AbortStep): its step did not complete.
  struct FailureReport {
    WorkerId worker = 0;
    FailureReportMsg report;
  };
  // The shell's ChooseRecovery came back.
  struct RecoveryReady {
    int64_t generation = 0;
    StatusOr<RecoveryChoice> choice = InternalError("unset");
  };
  // The shell's FindResumeCheckpoint came back: the checkpoint to resume from (none: a fresh
  // start), or, when `status` is not OK, why the job cannot start (the checkpoint does not
  // match the job's manifest).
  struct ResumeReady {
    int64_t generation = 0;
    Status status;
    std::optional<RecoveryCheckpoint> checkpoint;
  };
  // Coordinator failover (decider_persist.cc): a worker reconnected to a successor (a Register
  // with resume set) and says where it stands, so that what the dead leader sent it or heard from
  // it but had not persisted is made good: `generation` is the generation it trains in (0: none
  // yet); `awaiting_outcome` the committed change whose switch failed here and whose Outcome it
  // waits for (0: none); `done` whether its training loop ended (its Done may be lost);
  // `leaving` whether it asked to leave; `prepared` a proposal it reported for and waits on
  // (a commit or an abandon). It resends its own outstanding report or Applied after this
  // (AgentCore::Outstanding).
  struct Rejoin {
    WorkerId worker = 0;
    std::string host;
    int64_t generation = 0;
    int64_t awaiting_outcome = 0;
    bool done = false;
    bool leaving = false;
    int64_t prepared = 0;
  };
  using Any = std::variant<Join, LeaveRequest, Lost, Heartbeat, Resize, StepReportMsg, AppliedMsg,
                           PlanReady, Tick, Done, FailureReport, RecoveryReady, ResumeReady, Rejoin>;
};

struct DeciderAction {
  struct ComputePlan {
    PlanRequest request;
  };
  // A recovery's reports are in: the shell runs ChooseRecovery (runtime/plan/choose_recovery.h)
  // off the I/O thread and feeds RecoveryReady.
  struct ChooseRecovery {
    int64_t generation = 0;
    Generation from;
    Generation next;
    ChangeParticipants change;
    std::vector<StepReportMsg> reports;
  };
  // DeciderOptions::resume: the job's first generation `generation` is planned; the shell looks
  // for the newest complete checkpoint, checks it against the job's manifest (off the I/O
  // thread) and feeds ResumeReady.
  struct FindResumeCheckpoint {
    int64_t generation = 0;
  };
  struct SendPrepare {
    std::vector<WorkerId> to;
    PrepareMsg msg;
  };
  struct SendCommit {
    std::vector<WorkerId> to;
    CommitMsg msg;
  };
  struct SendAbandon {
    std::vector<WorkerId> to;
    AbandonMsg msg;
  };
  struct SendAbort {
    std::vector<WorkerId> to;
    AbortMsg msg;
  };
  struct SendOutcome {
    std::vector<WorkerId> to;
    OutcomeMsg msg;
  };
  struct SendRelease {
    WorkerId to = 0;
    ReleaseMsg msg;
  };
  // A worker's Done is recorded (persisted first, like every action's cause): its Finish may
  // return (with failover it waits for this, saying Done again to a successor if need be).
  // Every Done is acknowledged, a duplicate or one the decider ignores included.
  struct AckDone {
    WorkerId to = 0;
  };
  // The store's generation moves to `generation` (only the coordinator advances it).
  struct AdvanceStore {
    int64_t generation = 0;
  };
  struct AnswerResize {
    int64_t request_id = 0;
    Status status;  // OK: accepted (the change runs asynchronously)
  };
  // Ask the launcher (morphrun, Slurm, the scheduler) for `count` more workers.
  struct LaunchWorkers {
    int count = 0;
  };
  // Close a worker's control connection (declared lost by heartbeat timeout).
  struct Disconnect {
    WorkerId worker = 0;
    std::string reason;
  };
  // The job cannot continue (e.g. no configuration fits the surviving workers).
  struct JobFailed {
    Status status;
  };
  // Every member of the current generation finished training (Done): the job succeeded.
  struct JobComplete {
    int64_t generation = 0;
  };
  // Every worker asked to leave (SIGTERM to the whole job, Leave(), a resize removing them all)
  // and none was lost: the job ends as its scheduler asked, not as a failure. kCancelled.
  struct JobStopped {
    Status status;
  };
  using Any = std::variant<ComputePlan, SendPrepare, SendCommit, SendAbandon, SendOutcome,
                           SendRelease, AdvanceStore, AnswerResize, LaunchWorkers, Disconnect,
                           JobFailed, JobComplete, ChooseRecovery, SendAbort, FindResumeCheckpoint,
                           JobStopped, AckDone>;
};

class Decider {
 public:
  // kStopped: every worker left on request (JobStopped).
  enum class Phase {
    kStarting,
    kStable,
    kPlanning,
    kPreparing,
    kCommitted,
    kFailed,
    kComplete,
    kStopped
  };

  explicit Decider(DeciderOptions options);

  // Feeds one event; returns what to do, in order. `now_ms` is the shell's monotonic clock.
  std::vector<DeciderAction::Any> Handle(int64_t now_ms, DeciderEvent::Any event);

  Phase phase() const { return phase_; }
  // The last committed generation whose change completed (id 0 before the first).
  const Generation& current() const { return current_; }
  // The proposal or committed change in progress, if any.
  const std::optional<Generation>& pending() const { return pending_; }
  // Workers connected and not leaving that hold no rank.
  std::vector<WorkerId> standby() const;
  // Workers connected and not leaving (they may take a rank), id order.
  std::vector<WorkerId> candidates() const { return Candidates(); }
  bool resize_in_progress() const { return resize_active_; }
  // A worker sent Done: no further change is proposed.
  bool finishing() const { return finishing_; }
  // The config planner's explanation of the last committed configuration.
  const std::string& last_explanation() const { return last_explanation_; }
  int64_t last_generation_id() const { return last_id_; }

  // ---- Coordinator failover (decider_persist.cc) ----
  // Everything a successor needs to decide as this decider would, as bytes (JSON): the leader
  // writes it (fenced) after every Handle that changed it, before it carries out the actions.
  // Clocks are not in it (the successor's restarts them).
  std::string Save() const;
  // Replaces this decider's state with a saved one (same options). kDataLoss for bytes that are
  // not a saved state. Call Resume next.
  Status Load(std::string_view saved);
  // The successor takes over at `now_ms`: every known worker has options.rejoin_timeout_ms to
  // Rejoin; a plan being computed is dropped and proposed again (its id is skipped), a prepare
  // in progress is abandoned and proposed again under a new id (its participants' builds
  // rendezvoused on the dead leader's store), a recovery choice or a resume checkpoint being
  // looked up is asked again; the store moves to the newest
  // generation id. Returns the actions.
  std::vector<DeciderAction::Any> Resume(int64_t now_ms);

 private:
  struct Worker {
    std::string host;
    int64_t last_seen_ms = 0;
    bool leaving = false;   // asked to leave (or removed by a resize)
    bool released = false;  // a member sent Release because the job is finishing
    bool done = false;      // sent Done: its training loop ended
  };
  using Out = std::vector<DeciderAction::Any>;

  void OnJoin(const DeciderEvent::Join& e, Out& out);
  void OnLeave(WorkerId w, Out& out);
  void OnLost(WorkerId w, const std::string& reason, Out& out);
  void OnResize(const ResizeRequest& r, Out& out);
  void OnReport(const StepReportMsg& m, Out& out);
  void OnApplied(const AppliedMsg& m, Out& out);
  void OnPlanReady(DeciderEvent::PlanReady& e, Out& out);
  void OnTick(int64_t now_ms, Out& out);
  void OnDone(WorkerId w, Out& out);
  void OnFailureReport(const DeciderEvent::FailureReport& e, Out& out);
  void OnRecoveryReady(DeciderEvent::RecoveryReady& e, Out& out);
  void OnResumeReady(DeciderEvent::ResumeReady& e, Out& out);
  void OnRejoin(const DeciderEvent::Rejoin& e, Out& out);
  // A successor got a report for a proposal it does not run: one the dead leader abandoned
  // (the worker built its prepare after the leader died, and waits at its gate).
  void OnStaleReport(const StepReportMsg& m, Out& out);
  // Workers that did not Rejoin within the timeout after Resume are lost.
  void OnRejoinDeadline(int64_t now_ms, Out& out);
  // A committed change some participant passed: its leavers inherited from a dead leader that
  // have not rejoined are counted gone (they exit after their exchange, which is done).
  void CountInheritedLeaversGone();
  PrepareMsg PrepareMessage() const;  // the pending change's prepare
  CommitMsg CommitMessage() const;    // the pending change's commit
  void MaybeComplete(Out& out);
  // The job starts finishing (the first Done): a proposal in progress is dropped.
  void DropChangeForFinish(Out& out);
  void OnLostWhileFinishing(WorkerId w, bool was_done, const std::string& reason, Out& out);
  // Members of current_ still connected that have not sent Done, rank order.
  std::vector<WorkerId> UnfinishedMembers() const;

  // Proposes the next change if the state calls for one (only when stable or starting).
  void MaybePropose(Out& out);
  std::vector<WorkerId> Candidates() const;  // connected, not leaving; id order
  int TargetWorld(size_t candidates) const;
  bool ChangeNeeded() const;
  // Commits the pending change at `start_step` (a recovery's chosen step), or at the reported
  // steps' maximum + 1.
  void Commit(Out& out, std::optional<int64_t> start_step = std::nullopt);
  void MaybeFinishChange(Out& out);
  void AbandonPending(Out& out);
  bool IsParticipant(WorkerId w) const;  // of the change in progress
  int CurrentRank(WorkerId w) const;     // current_.RankOf(w), through rank_of_
  void IndexCurrent();                   // rebuilds rank_of_ from current_
  std::vector<WorkerId> OldRanksAlive() const;  // current_'s ranks not lost, rank order

  DeciderOptions options_;
  Phase phase_ = Phase::kStarting;
  std::map<WorkerId, Worker> workers_;  // connected (or leaving) workers
  std::set<WorkerId> lost_;             // lost old ranks of `current_` not yet replaced
  Generation current_;
  std::unordered_map<WorkerId, int> rank_of_;  // current_'s ranks (O(1) lookups at scale)
  int64_t last_id_ = 0;
  std::optional<int> desired_world_;  // the scheduler's last world size
  int launch_outstanding_ = 0;        // workers asked of the launcher, not yet joined
  bool resize_active_ = false;        // a resize was accepted and its change is not done
  // A proposal whose plan came back unchanged (same ranks and config): not proposed again
  // until the candidates or the target change.
  std::optional<std::pair<std::vector<WorkerId>, int>> noop_;
  bool replan_ = false;  // the state changed while a plan was computed: discard it
  std::string last_explanation_;
  bool finishing_ = false;          // some worker sent Done
  // Members that closed (or died) once the job was finishing: they count as finished.
  std::set<WorkerId> gone_after_done_;
  // The next change must be a recovery: a member of current_ was lost, reported a failed
  // collective, or a change failed (its participants' state may be torn).
  bool recovery_needed_ = false;
  // Workers the change in progress sends away only because the world shrinks (not asked to
  // leave): if the change fails they are candidates again.
  std::set<WorkerId> shrunk_away_;

  // The change in progress.
  std::optional<Generation> pending_;
  ChangeParticipants pending_change_;
  std::map<WorkerId, StepReportMsg> reports_;  // old rank -> its report
  bool choosing_ = false;  // a recovery's ChooseRecovery is out
  // When the pending recovery's prepare went out (-1: none). A survivor that has not reported
  // its state a heartbeat timeout later is hung (its training thread cannot reach its step
  // boundary, e.g. a collective the abort did not wake) and is dropped like a silent one.
  int64_t recovery_prepared_ms_ = -1;
  int64_t now_ms_ = 0;  // the clock of the event being handled
  RecoveryDecision recovery_decision_;  // the chosen one, for the commit
  std::set<WorkerId> applied_;
  std::set<WorkerId> applied_ok_;  // Applied answers with ok: the change applies
  // The change's joiners were aborted out of its exchange (an old rank finished before the
  // switch step).
  bool aborted_fresh_ = false;
  std::set<WorkerId> lost_during_commit_;
  // Members of the committed change's new generation that reported a failed step of it before
  // its outcome (they passed the barrier and trained on): a recovery once it is applied.
  std::set<WorkerId> failed_before_outcome_;
  std::unordered_set<WorkerId> participant_set_;  // pending_change_.participants
  std::set<WorkerId> answered_;                   // applied_ ∪ lost_during_commit_
  // After Resume: the workers of the saved state that have not rejoined yet, and until when
  // they may (-1: no succession pending).
  std::set<WorkerId> rejoin_waiting_;
  int64_t rejoin_deadline_ms_ = -1;
  bool resumed_ = false;  // this decider took over from a dead leader (Resume)
};

std::string_view DeciderPhaseName(Decider::Phase phase);

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_DECIDER_H_
