// The decider's half of a change's life (decider.h, "Protocol for a change"): from the plan
// computed to the outcome — the prepare, the step reports, a recovery's choice, the commit, the
// Applied answers and the change's end (applied or not), or its abandonment.
#include <algorithm>
#include <utility>

#include "runtime/coordinator/decider.h"

namespace morph {

void Decider::OnPlanReady(DeciderEvent::PlanReady& e, Out& out) {
  if (phase_ != Phase::kPlanning || !pending_ || e.generation != pending_->id) return;
  Phase idle = current_.id == 0 ? Phase::kStarting : Phase::kStable;
  if (finishing_) {
    // Training ended meanwhile (a Done): no change any more.
    pending_.reset();
    phase_ = idle;
    MaybeComplete(out);
    return;
  }
  if (replan_) {
    // A worker was lost or asked to leave while the plan was computed: this id is skipped.
    pending_.reset();
    phase_ = idle;
    MaybePropose(out);
    return;
  }
  std::vector<WorkerId> cand = Candidates();
  bool must_change = !pending_change_.lost.empty() || pending_change_.recovery;
  for (WorkerId w : current_.ranks) {
    auto it = workers_.find(w);
    if (it != workers_.end() && it->second.leaving) must_change = true;
  }
  if (!e.plan.ok()) {
    pending_.reset();
    phase_ = idle;
    if (must_change || current_.id == 0) {
      phase_ = Phase::kFailed;
      out.push_back(DeciderAction::JobFailed{e.plan.status().WithContext(
          "no configuration for generation " + std::to_string(e.generation))});
      return;
    }
    // A growth that no configuration fits: stay as we are until something changes.
    noop_ = std::make_pair(cand, TargetWorld(cand.size()));
    resize_active_ = false;
    return;
  }
  PlannedChange& plan = *e.plan;
  std::set<WorkerId> ranked;
  bool valid = plan.config.Validate().ok() && !plan.ranks.empty() &&
               static_cast<int>(plan.ranks.size()) == plan.config.world() &&
               plan.config.world() <= TargetWorld(cand.size());
  for (WorkerId w : plan.ranks) {
    valid = valid && std::binary_search(cand.begin(), cand.end(), w) && ranked.insert(w).second;
  }
  if (!valid) {
    phase_ = Phase::kFailed;
    pending_.reset();
    out.push_back(DeciderAction::JobFailed{InternalError(
        "the config planner's plan for generation " + std::to_string(e.generation) +
        " is not an assignment of at most " + std::to_string(TargetWorld(cand.size())) +
        " candidates to " + plan.config.ToString())});
    return;
  }
  if (!must_change && current_.id != 0 && plan.config == current_.config &&
      plan.ranks == current_.ranks) {
    pending_.reset();
    phase_ = Phase::kStable;
    noop_ = std::make_pair(cand, TargetWorld(cand.size()));
    if (launch_outstanding_ == 0) resize_active_ = false;
    return;
  }
  pending_->config = plan.config;
  pending_->ranks = plan.ranks;
  pending_->plan_digest = plan.plan_digest;
  last_explanation_ = plan.explanation;

  ChangeParticipants& change = pending_change_;
  change.participants = OldRanksAlive();
  std::vector<WorkerId> fresh;
  for (WorkerId w : plan.ranks) {
    if (CurrentRank(w) < 0) fresh.push_back(w);
  }
  std::sort(fresh.begin(), fresh.end());
  change.participants.insert(change.participants.end(), fresh.begin(), fresh.end());
  participant_set_ = std::unordered_set<WorkerId>(change.participants.begin(),
                                                  change.participants.end());
  for (WorkerId w : OldRanksAlive()) {
    if (!ranked.count(w)) change.leavers.push_back(w);
  }
  // Who leaves the job: those that asked, and spares beyond the scheduler's world size (the
  // lowest ids stay, so the choice is deterministic).
  size_t keep = desired_world_ ? static_cast<size_t>(*desired_world_) : cand.size();
  size_t kept = ranked.size();
  {
    std::vector<WorkerId> spares;
    for (WorkerId w : cand) {
      if (!ranked.count(w)) spares.push_back(w);
    }
    size_t room = keep > kept ? keep - kept : 0;
    shrunk_away_.clear();
    for (size_t i = room; i < spares.size(); ++i) {
      Worker& sw = workers_.at(spares[i]);
      if (!sw.leaving) shrunk_away_.insert(spares[i]);  // not asked to go: beyond the size
      sw.leaving = true;
    }
  }
  std::vector<WorkerId> release_now;
  for (auto& [w, info] : workers_) {
    if (!info.leaving || ranked.count(w)) continue;
    if (CurrentRank(w) >= 0 && !lost_.count(w)) {
      change.exiting.push_back(w);  // sends its old state first
    } else {
      release_now.push_back(w);  // holds nothing
    }
  }
  for (WorkerId w : release_now) {
    workers_.erase(w);
    out.push_back(DeciderAction::SendRelease{w, ReleaseMsg{current_.id}});
  }
  out.push_back(DeciderAction::AdvanceStore{pending_->id});
  if (current_.id == 0) {
    if (options_.resume) {
      // The job's first generation: a checkpoint of an earlier run may supply its state.
      phase_ = Phase::kPreparing;
      choosing_ = true;
      out.push_back(DeciderAction::FindResumeCheckpoint{pending_->id});
      return;
    }
    Commit(out);
    return;
  }
  phase_ = Phase::kPreparing;
  if (OldRanksAlive().empty()) {
    if (!change.recovery) {
      Commit(out);
      return;
    }
    // Nobody's state survived: only a snapshot or checkpoint can supply it.
    choosing_ = true;
    out.push_back(DeciderAction::ChooseRecovery{pending_->id, current_, *pending_, change, {}});
    return;
  }
  recovery_prepared_ms_ = change.recovery ? now_ms_ : -1;
  out.push_back(DeciderAction::SendPrepare{change.participants, PrepareMessage()});
}

PrepareMsg Decider::PrepareMessage() const {
  return PrepareMsg{.next = *pending_, .from_generation = current_.id, .from = current_,
                    .change = pending_change_};
}

CommitMsg Decider::CommitMessage() const {
  return CommitMsg{.next = *pending_, .from_generation = current_.id, .from = current_,
                   .change = pending_change_,
                   .recovery = pending_change_.recovery ? recovery_decision_ : RecoveryDecision{}};
}

void Decider::OnReport(const StepReportMsg& m, Out& out) {
  if (phase_ != Phase::kPreparing || !pending_ || m.generation != pending_->id) {
    return OnStaleReport(m, out);
  }
  if (CurrentRank(m.worker) < 0 || lost_.count(m.worker) || choosing_) return;
  reports_.emplace(m.worker, m);  // a duplicate keeps the first answer
  // lost_ holds only current_'s ranks: the live old ranks are the rest.
  if (reports_.size() != current_.ranks.size() - lost_.size()) return;
  if (!pending_change_.recovery) return Commit(out);
  choosing_ = true;
  std::vector<StepReportMsg> reports;
  reports.reserve(reports_.size());
  for (const auto& [w, r] : reports_) reports.push_back(r);
  out.push_back(DeciderAction::ChooseRecovery{pending_->id, current_, *pending_, pending_change_,
                                              std::move(reports)});
}

void Decider::OnRecoveryReady(DeciderEvent::RecoveryReady& e, Out& out) {
  if (phase_ != Phase::kPreparing || !pending_ || e.generation != pending_->id || !choosing_) {
    return;  // abandoned meanwhile (a participant was lost): a new proposal is on its way
  }
  choosing_ = false;
  if (!e.choice.ok()) {
    phase_ = Phase::kFailed;
    out.push_back(DeciderAction::JobFailed{e.choice.status()});
    return;
  }
  RecoveryChoice& c = *e.choice;
  pending_->plan_digest = c.plan_digest;
  pending_change_.stale = c.stale;
  recovery_decision_ = c.decision;
  last_explanation_ = c.explanation;
  Commit(out, c.resume_step);
}

void Decider::OnResumeReady(DeciderEvent::ResumeReady& e, Out& out) {
  if (phase_ != Phase::kPreparing || !pending_ || current_.id != 0 ||
      e.generation != pending_->id || !choosing_) {
    return;  // abandoned meanwhile (a worker was lost): a new proposal asks again
  }
  choosing_ = false;
  if (!e.status.ok()) {
    phase_ = Phase::kFailed;
    pending_.reset();
    out.push_back(DeciderAction::JobFailed{e.status});
    return;
  }
  if (!e.checkpoint) return Commit(out);  // nothing to resume from: a fresh start
  const RecoveryCheckpoint& c = *e.checkpoint;
  pending_change_.recovery = true;
  recovery_decision_ = RecoveryDecision{.source = RecoveryDecision::Source::kCheckpoint,
                                        .newest_step = std::max(c.step, c.skipped_step),
                                        .checkpoint = c.path};
  last_explanation_ += "; resumed from checkpoint " + c.path + " at step " + std::to_string(c.step);
  Commit(out, c.step);
}

void Decider::Commit(Out& out, std::optional<int64_t> start_step) {
  int64_t s = current_.id == 0 ? 0 : current_.start_step;
  for (const auto& [w, r] : reports_) s = std::max(s, r.last_free_step + 1);
  if (start_step) s = *start_step;
  pending_->start_step = s;
  phase_ = Phase::kCommitted;
  out.push_back(DeciderAction::SendCommit{pending_change_.participants, CommitMessage()});
}

void Decider::OnApplied(const AppliedMsg& m, Out& out) {
  if (phase_ != Phase::kCommitted || !pending_ || m.generation != pending_->id) return;
  if (!IsParticipant(m.worker) || lost_during_commit_.count(m.worker)) return;
  if (!applied_.insert(m.worker).second) return;  // duplicate
  answered_.insert(m.worker);
  if (m.ok) applied_ok_.insert(m.worker);
  CountInheritedLeaversGone();
  MaybeFinishChange(out);
}

void Decider::CountInheritedLeaversGone() {
  // Once some participant passed the closing barrier, every participant finished its exchange:
  // a worker that leaves in this change and that a dead leader committed to it has done its part
  // and exits without coming back (its Applied, if any, went to the dead leader). Waiting for it
  // to rejoin would hold the change for the whole rejoin window.
  if (applied_ok_.empty()) return;
  for (WorkerId w : pending_change_.exiting) {
    if (!rejoin_waiting_.count(w) || answered_.count(w)) continue;
    rejoin_waiting_.erase(w);
    lost_during_commit_.insert(w);
    answered_.insert(w);
  }
}

void Decider::MaybeFinishChange(Out& out) {
  const auto& parts = pending_change_.participants;
  // answered_ = applied_ ∪ lost_during_commit_, both subsets of the participants.
  if (answered_.size() < parts.size()) return;
  // Applied iff some participant passed the closing barrier: then every participant had entered
  // it, i.e. finished its exchange, and one that reports a failure failed only at the barrier
  // and holds the complete new state. With no ok answer nobody passed it, and every participant
  // kept its old state (the executor never writes old buffers).
  bool applied = !applied_ok_.empty();
  std::vector<WorkerId> survivors;
  for (WorkerId w : parts) {
    if (!lost_during_commit_.count(w)) survivors.push_back(w);
  }
  Generation next = *pending_;
  ChangeParticipants change = pending_change_;
  pending_.reset();
  applied_ok_.clear();
  aborted_fresh_ = false;
  if (!survivors.empty()) {
    out.push_back(DeciderAction::SendOutcome{survivors, OutcomeMsg{next.id, applied}});
  }
  if (applied) {
    current_ = next;
    IndexCurrent();
    // The old generation's lost ranks are replaced now; workers lost during the change that
    // hold a new rank are the new generation's losses.
    lost_.clear();
    for (WorkerId w : lost_during_commit_) {
      if (CurrentRank(w) >= 0) lost_.insert(w);
    }
    for (WorkerId w : change.exiting) workers_.erase(w);  // done: they exit on the outcome
    // The new generation's state is whole (every participant passed the barrier or holds its
    // new state); only losses of its own members, or failures of its first step reported
    // before this outcome, call for a recovery now.
    bool failed = false;
    for (WorkerId w : failed_before_outcome_) failed = failed || CurrentRank(w) >= 0;
    recovery_needed_ = !lost_.empty() || failed;
  } else {
    // Nobody passed the closing barrier: participants that tried may hold torn or
    // half-released state. Old ranks that finished training before the switch step never
    // tried: when they are all there is, the old generation stands as it was.
    bool tried = !lost_during_commit_.empty();
    for (WorkerId w : applied_) tried = tried || CurrentRank(w) >= 0;
    recovery_needed_ = recovery_needed_ || tried;
    // Workers sent away only because the world was to shrink are candidates again: the next
    // proposal (with fewer survivors, perhaps) decides anew.
    for (WorkerId w : shrunk_away_) {
      auto it = workers_.find(w);
      if (it != workers_.end()) it->second.leaving = false;
    }
  }
  shrunk_away_.clear();
  // Not applied: the old generation stands; its ranks lost meanwhile are already in lost_, and
  // the leaving workers are still leaving, so the next proposal takes them out again.
  lost_during_commit_.clear();
  failed_before_outcome_.clear();
  phase_ = Phase::kStable;
  noop_.reset();
  MaybePropose(out);
}

void Decider::AbandonPending(Out& out) {
  out.push_back(DeciderAction::SendAbandon{pending_change_.participants, AbandonMsg{pending_->id}});
  pending_.reset();
  choosing_ = false;
  phase_ = current_.id == 0 ? Phase::kStarting : Phase::kStable;
}

}  // namespace morph
