#include "runtime/agent/agent_core.h"

#include <algorithm>
#include <utility>

namespace morph {

bool AgentCore::Participates(const ChangeParticipants& c) const {
  return std::find(c.participants.begin(), c.participants.end(), me_) != c.participants.end();
}

bool AgentCore::Exits(const ChangeParticipants& c) const {
  return std::find(c.exiting.begin(), c.exiting.end(), me_) != c.exiting.end();
}

std::optional<StepReportMsg> AgentCore::OnPrepare(const PrepareMsg& m, int64_t next_step) {
  const int64_t id = m.next.id;
  if (finished_ || id <= gen_.id || id <= closed_) return std::nullopt;  // stale
  if (commit_ && commit_->next.id >= id) return std::nullopt;            // its commit came first
  if (!Participates(m.change)) return std::nullopt;
  // Only the old generation's ranks train, so only they promise a step.
  if (m.from_generation != gen_.id || rank() < 0) return std::nullopt;
  if (prepared_ != id) {
    prepared_ = id;
    reported_ = next_step;
    gate_ = next_step;
  }
  return StepReportMsg{.worker = me_, .generation = id, .last_free_step = reported_};
}

void AgentCore::OnRecoveryPrepare(const PrepareMsg& m) {
  const int64_t id = m.next.id;
  if (finished_ || id <= gen_.id || id <= closed_ || !m.change.recovery) return;
  if (commit_ && commit_->next.id >= id) return;
  if (!Participates(m.change) || m.from_generation != gen_.id || rank() < 0) return;
  if (recovery_ == id) return;  // duplicate
  recovery_ = id;
  failed_gen_ = gen_.id;  // the runtime aborts this generation's collectives
  recovery_built_ = false;
  recovery_state_.reset();
  prepared_ = id;
  gate_ = -1;  // no step begins until the commit
}

std::optional<StepReportMsg> AgentCore::RecoveryReportIfComplete() {
  if (recovery_ == 0 || !recovery_built_ || !recovery_state_) return std::nullopt;
  return recovery_state_;
}

std::optional<StepReportMsg> AgentCore::OnRecoveryBuilt(int64_t generation) {
  if (recovery_ != generation || recovery_built_) return std::nullopt;
  recovery_built_ = true;
  return RecoveryReportIfComplete();
}

std::optional<StepReportMsg> AgentCore::OnRecoveryState(StepReportMsg state) {
  if (recovery_ == 0 || recovery_state_) return std::nullopt;
  state.worker = me_;
  state.generation = recovery_;
  state.last_free_step = state.state_step;
  recovery_state_ = std::move(state);
  return RecoveryReportIfComplete();
}

void AgentCore::OnAbort(const AbortMsg& m) {
  if (gen_.id != 0 && m.generation == gen_.id) failed_gen_ = gen_.id;
}

void AgentCore::OnStepFailed() {
  if (gen_.id != 0) failed_gen_ = gen_.id;
}

void AgentCore::ClearRecovery() {
  recovery_ = 0;
  recovery_built_ = false;
  recovery_state_.reset();
}

void AgentCore::OnCommit(const CommitMsg& m) {
  const int64_t id = m.next.id;
  if (finished_ || id <= gen_.id || id <= closed_) return;
  if (commit_ && commit_->next.id >= id) return;  // duplicate
  if (!Participates(m.change)) return;
  commit_ = m;
  switch_failed_ = false;
  reverted_ = false;
  ClearRecovery();
  // Steps before S run in the old generation; S itself is the switch (AtStep). A recovery
  // switches at the boundary where the worker waits.
  gate_ = m.change.recovery ? -1 : m.next.start_step;
}

void AgentCore::OnAbandon(const AbandonMsg& m) {
  if (m.generation <= closed_) return;
  if (commit_ && commit_->next.id == m.generation) return;  // a committed one is never abandoned
  closed_ = m.generation;
  if (recovery_ == m.generation) ClearRecovery();
  if (prepared_ == m.generation) {
    prepared_ = 0;
    gate_ = kNoGate;
  }
}

void AgentCore::OnOutcome(const OutcomeMsg& m) {
  if (!commit_ || commit_->next.id != m.generation || !switch_failed_) return;
  switch_failed_ = false;
  closed_ = std::max(closed_, m.generation);
  if (m.applied) {
    // Some participant passed the closing barrier: every exchange, ours included, completed.
    gen_ = commit_->next;
    if (Exits(commit_->change)) finished_ = true;
  } else {
    reverted_ = true;  // the old generation stands; the caller restores the old state
  }
  commit_.reset();
  prepared_ = 0;
  gate_ = kNoGate;
}

std::optional<std::variant<StepReportMsg, AppliedMsg>> AgentCore::Outstanding() const {
  if (finished_) return std::nullopt;
  if (commit_) {
    if (!switch_failed_) return std::nullopt;  // its switch has not run yet
    return AppliedMsg{.worker = me_, .generation = commit_->next.id, .ok = false,
                      .error = "switch failed (sent again to a new coordinator)"};
  }
  if (recovery_ != 0) {
    if (recovery_built_ && recovery_state_) return *recovery_state_;
    return std::nullopt;
  }
  if (prepared_ != 0) {
    return StepReportMsg{.worker = me_, .generation = prepared_, .last_free_step = reported_};
  }
  return std::nullopt;
}

void AgentCore::OnRelease(const ReleaseMsg&) {
  if (commit_) return;  // a participant of a change leaves through its outcome
  finished_ = true;
  released_ = true;
}

AgentCore::Action AgentCore::AtStep(int64_t step) const {
  if (finished_) return Action::kFinished;
  if (commit_) {
    if (switch_failed_) return Action::kWait;
    // A worker without a rank joins the exchange at once (its peers arrive when they reach S).
    if (rank() < 0 || commit_->change.recovery || step >= commit_->next.start_step) {
      return Action::kSwitch;
    }
    return generation_failed() ? Action::kCannotSwitch : Action::kProceed;
  }
  if (rank() < 0) return Action::kWait;  // a joiner or spare waits for a commit with a rank
  if (recovery_ != 0) return recovery_state_ ? Action::kWait : Action::kReport;
  if (generation_failed()) return Action::kWait;
  return step > gate_ ? Action::kWait : Action::kProceed;
}

AppliedMsg AgentCore::SwitchDone(bool ok, std::string error) {
  AppliedMsg out{.worker = me_,
                 .generation = commit_ ? commit_->next.id : 0,
                 .ok = ok,
                 .error = std::move(error)};
  if (!commit_) return out;
  if (!ok) {
    switch_failed_ = true;
    return out;
  }
  gen_ = commit_->next;
  if (Exits(commit_->change)) finished_ = true;
  commit_.reset();
  prepared_ = 0;
  gate_ = kNoGate;
  reverted_ = false;
  return out;
}

}  // namespace morph
