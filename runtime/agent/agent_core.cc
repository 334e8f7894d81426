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

void AgentCore::OnCommit(const CommitMsg& m) {
  const int64_t id = m.next.id;
  if (finished_ || id <= gen_.id || id <= closed_) return;
  if (commit_ && commit_->next.id >= id) return;  // duplicate
  if (!Participates(m.change)) return;
  commit_ = m;
  switch_failed_ = false;
  reverted_ = false;
  // Steps before S run in the old generation; S itself is the switch (AtStep).
  gate_ = m.next.start_step;
}

void AgentCore::OnAbandon(const AbandonMsg& m) {
  if (m.generation <= closed_) return;
  if (commit_ && commit_->next.id == m.generation) return;  // a committed one is never abandoned
  closed_ = m.generation;
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

void AgentCore::OnRelease(const ReleaseMsg&) {
  if (commit_) return;  // a participant of a change leaves through its outcome
  finished_ = true;
}

AgentCore::Action AgentCore::AtStep(int64_t step) const {
  if (finished_) return Action::kFinished;
  if (commit_) {
    if (switch_failed_) return Action::kWait;
    // A worker without a rank joins the exchange at once (its peers arrive when they reach S).
    if (rank() < 0 || step >= commit_->next.start_step) return Action::kSwitch;
    return Action::kProceed;
  }
  if (rank() < 0) return Action::kWait;  // a joiner or spare waits for a commit with a rank
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
