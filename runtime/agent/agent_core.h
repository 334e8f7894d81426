// AgentCore: the worker's side of the change protocol as a pure state machine (the decider's
// counterpart, runtime/coordinator/decider.h). The agent's control thread feeds it the
// coordinator's messages; the training thread asks it, at BeginStep, whether to proceed, wait or
// switch generations. No I/O, no clock, no thread of its own: the real agent wraps it in a mutex
// and an atomic "something pending" flag (so BeginStep costs one atomic load when nothing is),
// and the simulation test drives it directly.
//
// Rules it enforces:
//   - on Prepare(g+1) while in g it promises the highest step it may begin without a decision
//     (the next step the training thread will begin, read by the caller): StepReport;
//   - it never lets a step past that begin until Commit(g+1, S) or Abandon(g+1);
//   - at step S it tells the training thread to switch; a worker without a rank (a joiner, a
//     spare) waits until a commit gives it one and starts at S;
//   - a recovery's prepare stops the training thread at its next boundary (kReport), whatever
//     step it is at; the report carries the state's step; the commit switches at once;
//   - messages are idempotent: duplicates, stale generations and reordered arrivals (a commit
//     before its prepare, an abandon before its prepare) are harmless.
//
// Thread-compatible: the caller serializes calls (one mutex).
#ifndef MORPH_RUNTIME_AGENT_AGENT_CORE_H_
#define MORPH_RUNTIME_AGENT_AGENT_CORE_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <variant>

#include "runtime/protocol/messages.h"

namespace morph {

class AgentCore {
 public:
  static constexpr int64_t kNoGate = std::numeric_limits<int64_t>::max();

  explicit AgentCore(WorkerId me) : me_(me) {}

  // Coordinator messages. `next_step` is the step the training thread will begin next (read
  // with the ordering the caller documents). Returns the report to send, if any.
  std::optional<StepReportMsg> OnPrepare(const PrepareMsg& m, int64_t next_step);
  // A recovery's prepare (m.change.recovery) as it arrives: from now on the training thread
  // begins no further step; at its boundary AtStep says kReport. The step report goes out once
  // both the new world is built (OnRecoveryBuilt) and the state is reported (OnRecoveryState):
  // each returns the report when it completes the pair.
  void OnRecoveryPrepare(const PrepareMsg& m);
  std::optional<StepReportMsg> OnRecoveryBuilt(int64_t generation);
  // `state`: the state fields of the report (state_step, state_ok, snapshots, undo_step,
  // vote_step, committed_step); the core fills in worker, generation and last_free_step.
  std::optional<StepReportMsg> OnRecoveryState(StepReportMsg state);
  // The same with only the newest local and held snapshot steps (tests).
  std::optional<StepReportMsg> OnRecoveryState(int64_t state_step, bool state_ok,
                                               int64_t snapshot_step, int64_t held_snapshot_step,
                                               int64_t undo_step = -1) {
    return OnRecoveryState(
        StepReportMsg{.state_step = state_step,
                      .state_ok = state_ok,
                      .snapshots = {.local_step = snapshot_step, .held_step = held_snapshot_step},
                      .undo_step = undo_step});
  }
  void OnCommit(const CommitMsg& m);
  void OnAbandon(const AbandonMsg& m);
  void OnOutcome(const OutcomeMsg& m);
  void OnRelease(const ReleaseMsg& m);
  // The coordinator ended the job because every worker asked to leave: this one is finished.
  void OnJobStopped() { finished_ = true; }
  // The current generation's collectives are gone (the coordinator's Abort, or the training
  // thread's own failed step, OnStepFailed): no step of it begins any more; a planned commit
  // whose start step lies ahead cannot be reached (kCannotSwitch); only a recovery follows.
  void OnAbort(const AbortMsg& m);
  void OnStepFailed();
  bool generation_failed() const { return failed_gen_ != 0 && failed_gen_ == gen_.id; }

  enum class Action {
    kProceed,  // begin the step in the current generation
    kWait,     // block until the next coordinator message, then ask again
    kSwitch,   // apply pending_commit() now; the step it starts is its start_step
    kFinished,  // this worker is done: Finished() is true
    kReport,    // a recovery is prepared: report the state's step (OnRecoveryState), then wait
    kCannotSwitch  // a planned commit's start step is out of reach (the generation failed):
                   // answer SwitchDone(false), then wait
  };
  // The training thread at BeginStep(step). A worker without a generation passes any step.
  Action AtStep(int64_t step) const;

  // The training thread finished applying pending_commit(): `ok` if its closing barrier passed.
  // Returns the Applied message to send. On ok the worker is in the new generation (or done,
  // if it holds no rank there and exits); otherwise it waits for the Outcome.
  AppliedMsg SwitchDone(bool ok, std::string error = "");

  bool has_generation() const { return gen_.id != 0; }
  const Generation& generation() const { return gen_; }
  int rank() const { return gen_.RankOf(me_); }
  const std::optional<CommitMsg>& pending_commit() const { return commit_; }
  int64_t gate() const { return gate_; }
  bool finished() const { return finished_; }
  // Finished by the coordinator's Release (not by leaving in a change): the job ended, or never
  // needed this worker. A member released so still tells the coordinator it is done.
  bool released() const { return released_; }
  // After a failed switch, the Outcome said applied = false: the caller restores the old state
  // and the training thread resumes the old generation at the step it stopped at.
  bool reverted() const { return reverted_; }
  WorkerId me() const { return me_; }

  bool Participates(const ChangeParticipants& c) const;

  // Coordinator failover: on reconnecting to a successor the worker says where it stands (the
  // decider's Rejoin) and sends again what the dead leader may never have had: the report of
  // the proposal it prepared (or of the recovery it reported its state for), or the failed
  // switch's Applied whose Outcome it waits for.
  int64_t awaiting_outcome() const { return commit_ && switch_failed_ ? commit_->next.id : 0; }
  // The proposal it reported for (or stopped for, a recovery's) without a commit yet (0: none).
  int64_t prepared() const { return commit_ ? 0 : prepared_; }
  std::optional<std::variant<StepReportMsg, AppliedMsg>> Outstanding() const;

 private:
  bool Exits(const ChangeParticipants& c) const;

  WorkerId me_;
  Generation gen_;
  int64_t gate_ = kNoGate;
  int64_t prepared_ = 0;  // the proposal this worker reported for (0: none)
  int64_t reported_ = 0;  // what it reported for it
  // Highest proposal id that is settled here (abandoned, or its outcome known): messages about
  // it or an older one are stale copies.
  int64_t closed_ = 0;
  std::optional<CommitMsg> commit_;
  bool switch_failed_ = false;  // SwitchDone(!ok) for commit_, waiting for the Outcome
  bool finished_ = false;
  bool released_ = false;
  bool reverted_ = false;
  // The recovery proposal in progress (0: none), and its two halves of the report.
  int64_t failed_gen_ = 0;  // the generation whose collectives failed here
  int64_t recovery_ = 0;
  bool recovery_built_ = false;
  std::optional<StepReportMsg> recovery_state_;
  std::optional<StepReportMsg> RecoveryReportIfComplete();
  void ClearRecovery();
};

}  // namespace morph

#endif  // MORPH_RUNTIME_AGENT_AGENT_CORE_H_
