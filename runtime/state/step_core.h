// StepCore: a worker's step lifecycle as a pure state machine, the training thread's counterpart
// of AgentCore (runtime/agent/agent_core.h): which public call may come when, what a failed step
// leaves behind (whole or torn state), and when BeginStep must take its slow path. No I/O, no
// clock, no thread: Runtime drives it from its public calls (runtime.cc, commit_vote.cc), the
// decider simulation drives it next to AgentCore, and step_core_test scripts its cases.
//
//   StepCore core;
//   MORPH_RETURN_IF_ERROR(core.CheckBegin(step));  // BeginStep; then, after its slow path:
//   core.Begin(step);                              // kBetween -> kInStep
//   core.BeginUpdate();                            // kInStep -> kUpdating (the update began)
//   MORPH_RETURN_IF_ERROR(core.End());             // EndStep: -> kBetween
//   ...
//   MORPH_RETURN_IF_ERROR(core.Abort().status());  // AbortStep: failed(); torn() when the
//                                                  // state is not one step's values
//   core.Recovered();                              // a recovery's switch applied
//
// States (one step at a time):
//   kBetween   no step open: BeginStep may begin one.
//   kInStep    a step is open; its updates of the state have not begun (a failure now leaves
//              the state at the step's values: whole).
//   kUpdating  the step's update began (BeginUpdate, or CommitUpdate's vote passed): a failure
//              now leaves the state torn.
//   kDone      the worker left the job, or was released: BeginStep returns done() (final).
// Beside them, failed(): the last step ended in AbortStep (or a switch failed) and no recovery
// applied since: BeginStep takes its slow path and recovers before training on; torn() says
// whether the state is one step's values. A CommitUpdate whose vote passed elsewhere goes on in
// its update while failed() (the recovery's switch comes at the next BeginStep).
// Until a program first calls BeginUpdate or CommitUpdate, every step counts as updating from
// its start (a failure leaves the state torn); once it did, every step is taken to declare its
// update.
//
// Thread-compatible: the training thread.
#ifndef MORPH_RUNTIME_STATE_STEP_CORE_H_
#define MORPH_RUNTIME_STATE_STEP_CORE_H_

#include <cstdint>
#include <string_view>

#include "morph/status.h"

namespace morph {

class StepCore {
 public:
  enum class State { kBetween, kInStep, kUpdating, kDone };

  // BeginStep is called: kFailedPrecondition "BeginStep: step S is still open (call EndStep
  // first)" in a step (S: `step`, the open one); otherwise a CommitUpdate that ended the last
  // step is forgotten (a later AbortStep needs an open step again).
  Status CheckBegin(int64_t step);
  // BeginStep returns step `step` to train (after its slow path, if any): -> kInStep.
  void Begin(int64_t step);
  // The step's updates begin (BeginUpdate): kInStep -> kUpdating. Outside a step it only
  // records that the program declares its updates.
  void BeginUpdate();
  // CommitUpdate may vote: kFailedPrecondition "CommitUpdate: no step is open" or "...: the
  // update of step S already began (BeginUpdate or CommitUpdate was called)". Records that the
  // program declares its updates.
  Status CanVote(int64_t step);
  // EndStep: kFailedPrecondition "EndStep: no step is open" outside a step; -> kBetween.
  Status End();
  // AbortStep: -> kBetween and failed(); torn() from now on when the update had begun, the
  // program never declared its updates, or it was torn already. Returns true when the step was
  // aborted; false (nothing changes) after a CommitUpdate that ended the step itself
  // (ended_by_vote). kFailedPrecondition "AbortStep: no step is open" outside a step otherwise.
  StatusOr<bool> Abort();
  // CommitUpdate's vote did not complete here and AbortStep ended the step: whether the vote
  // passed elsewhere decides. `apply`: it did, the step goes on in its update (kUpdating);
  // otherwise the step stays ended (AbortStep later returns OK and does nothing).
  void VoteSettled(bool apply);
  // A recovery put back the undo copy: the state holds one step's values again.
  void UndoPutBack() { torn_ = false; }
  // A switch applied (a planned change, a recovery, a joiner's first generation): not failed,
  // whole state.
  void Recovered();
  // A switch failed and the old generation stands: failed(); `torn` when the switch left the
  // state torn (it released old shards).
  void SwitchFailed(bool torn);
  // The worker left or was released: -> kDone (final).
  void Finished() { state_ = State::kDone; }

  State state() const { return state_; }
  bool in_step() const { return state_ == State::kInStep || state_ == State::kUpdating; }
  bool updating() const { return state_ == State::kUpdating; }
  bool failed() const { return failed_; }
  bool torn() const { return torn_; }
  bool finished() const { return state_ == State::kDone; }
  bool declares_update() const { return declares_update_; }
  bool ended_by_vote() const { return ended_by_vote_; }

 private:
  State state_ = State::kBetween;
  bool failed_ = false;
  bool torn_ = false;
  bool declares_update_ = false;
  bool ended_by_vote_ = false;
  int64_t step_ = -1;  // the open (or last) step
};

std::string_view StepCoreStateName(StepCore::State s);

}  // namespace morph

#endif  // MORPH_RUNTIME_STATE_STEP_CORE_H_
