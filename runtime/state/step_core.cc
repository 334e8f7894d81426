#include "runtime/state/step_core.h"

#include <string>

namespace morph {

std::string_view StepCoreStateName(StepCore::State s) {
  switch (s) {
    case StepCore::State::kBetween:
      return "between steps";
    case StepCore::State::kInStep:
      return "in a step";
    case StepCore::State::kUpdating:
      return "updating";
    case StepCore::State::kDone:
      return "done";
  }
  return "?";
}

Status StepCore::CheckBegin(int64_t step) {
  if (in_step()) {
    return FailedPreconditionError("BeginStep: step " + std::to_string(step) +
                                   " is still open (call EndStep first)");
  }
  ended_by_vote_ = false;
  return Status::Ok();
}

void StepCore::Begin(int64_t step) {
  if (state_ == State::kDone) return;
  state_ = State::kInStep;
  step_ = step;
}

void StepCore::BeginUpdate() {
  declares_update_ = true;
  if (state_ == State::kInStep) state_ = State::kUpdating;
}

Status StepCore::CanVote(int64_t step) {
  if (!in_step()) return FailedPreconditionError("CommitUpdate: no step is open");
  if (state_ == State::kUpdating) {
    return FailedPreconditionError("CommitUpdate: the update of step " + std::to_string(step) +
                                   " already began (BeginUpdate or CommitUpdate was called)");
  }
  // The update boundary is known from now on: a failure before it leaves the state whole.
  declares_update_ = true;
  return Status::Ok();
}

Status StepCore::End() {
  if (!in_step()) return FailedPreconditionError("EndStep: no step is open");
  state_ = State::kBetween;
  return Status::Ok();
}

StatusOr<bool> StepCore::Abort() {
  if (!in_step()) {
    if (ended_by_vote_) return false;  // CommitUpdate failed and ended the step already
    return FailedPreconditionError("AbortStep: no step is open");
  }
  // A step that never said where its updates begin may have changed the state anywhere.
  torn_ = torn_ || state_ == State::kUpdating || !declares_update_;
  state_ = State::kBetween;
  failed_ = true;
  return true;
}

void StepCore::VoteSettled(bool apply) {
  ended_by_vote_ = !apply;
  if (apply && state_ != State::kDone) state_ = State::kUpdating;
}

void StepCore::Recovered() {
  failed_ = false;
  torn_ = false;
}

void StepCore::SwitchFailed(bool torn) {
  failed_ = true;
  torn_ = torn_ || torn;
}

}  // namespace morph
