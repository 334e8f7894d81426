#include "runtime/coordinator/decider.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <utility>

namespace morph {

std::string_view DeciderPhaseName(Decider::Phase phase) {
  switch (phase) {
    case Decider::Phase::kStarting:
      return "starting";
    case Decider::Phase::kStable:
      return "stable";
    case Decider::Phase::kPlanning:
      return "planning";
    case Decider::Phase::kPreparing:
      return "preparing";
    case Decider::Phase::kCommitted:
      return "committed";
    case Decider::Phase::kFailed:
      return "failed";
    case Decider::Phase::kComplete:
      return "complete";
    case Decider::Phase::kStopped:
      return "stopped";
  }
  return "?";
}

Decider::Decider(DeciderOptions options)
    : options_(options), last_id_(std::max<int64_t>(1, options.first_generation) - 1) {}

std::vector<DeciderAction::Any> Decider::Handle(int64_t now_ms, DeciderEvent::Any event) {
  Out out;
  if (phase_ == Phase::kFailed || phase_ == Phase::kComplete || phase_ == Phase::kStopped) {
    // A successor of a leader that completed the job (and died before releasing everyone):
    // a worker without a rank that reconnects is released as it would have been.
    const auto* r = std::get_if<DeciderEvent::Rejoin>(&event);
    if (r && phase_ == Phase::kComplete && CurrentRank(r->worker) < 0) {
      if (r->awaiting_outcome != 0) {  // a joiner whose exchange was aborted
        out.push_back(DeciderAction::SendOutcome{
            {r->worker},
            OutcomeMsg{r->awaiting_outcome, current_.id == r->awaiting_outcome}});
      }
      out.push_back(DeciderAction::SendRelease{r->worker, ReleaseMsg{current_.id}});
    }
    return out;
  }
  now_ms_ = now_ms;
  // Any message from a worker proves it alive.
  auto touch = [&](WorkerId w) {
    auto it = workers_.find(w);
    if (it != workers_.end()) it->second.last_seen_ms = now_ms;
  };
  std::visit(
      [&](auto& e) {
        using E = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<E, DeciderEvent::Join>) {
          if (!workers_.count(e.worker) && !lost_.count(e.worker)) {
            workers_[e.worker] = Worker{.host = e.host, .last_seen_ms = now_ms};
            OnJoin(e, out);
          }
        } else if constexpr (std::is_same_v<E, DeciderEvent::LeaveRequest>) {
          touch(e.worker);
          OnLeave(e.worker, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::Lost>) {
          OnLost(e.worker, e.reason, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::Heartbeat>) {
          touch(e.worker);
        } else if constexpr (std::is_same_v<E, DeciderEvent::Resize>) {
          OnResize(e.request, out);
        } else if constexpr (std::is_same_v<E, StepReportMsg>) {
          touch(e.worker);
          OnReport(e, out);
        } else if constexpr (std::is_same_v<E, AppliedMsg>) {
          touch(e.worker);
          OnApplied(e, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::PlanReady>) {
          OnPlanReady(e, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::Tick>) {
          OnTick(now_ms, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::Done>) {
          touch(e.worker);
          OnDone(e.worker, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::FailureReport>) {
          touch(e.worker);
          OnFailureReport(e, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::RecoveryReady>) {
          OnRecoveryReady(e, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::ResumeReady>) {
          OnResumeReady(e, out);
        } else if constexpr (std::is_same_v<E, DeciderEvent::Rejoin>) {
          OnRejoin(e, out);
        }
      },
      event);
  return out;
}

std::vector<WorkerId> Decider::standby() const {
  std::vector<WorkerId> out;
  for (const auto& [id, w] : workers_) {
    if (!w.leaving && CurrentRank(id) < 0) out.push_back(id);
  }
  return out;
}

std::vector<WorkerId> Decider::Candidates() const {
  std::vector<WorkerId> out;
  for (const auto& [id, w] : workers_) {
    if (!w.leaving) out.push_back(id);
  }
  return out;
}

int Decider::TargetWorld(size_t candidates) const {
  int64_t t = std::min<int64_t>(static_cast<int64_t>(candidates), options_.max_world);
  if (desired_world_) t = std::min<int64_t>(t, *desired_world_);
  return static_cast<int>(t);
}

std::vector<WorkerId> Decider::OldRanksAlive() const {
  std::vector<WorkerId> out;
  for (WorkerId w : current_.ranks) {
    if (!lost_.count(w)) out.push_back(w);
  }
  return out;
}

bool Decider::IsParticipant(WorkerId w) const { return participant_set_.count(w) > 0; }

int Decider::CurrentRank(WorkerId w) const {
  auto it = rank_of_.find(w);
  return it == rank_of_.end() ? -1 : it->second;
}

void Decider::IndexCurrent() {
  rank_of_.clear();
  rank_of_.reserve(current_.ranks.size());
  for (size_t r = 0; r < current_.ranks.size(); ++r) {
    rank_of_[current_.ranks[r]] = static_cast<int>(r);
  }
}

bool Decider::ChangeNeeded() const {
  std::vector<WorkerId> cand = Candidates();
  if (phase_ == Phase::kStarting) {
    return static_cast<int>(cand.size()) >= options_.initial_world;
  }
  if (phase_ != Phase::kStable) return false;
  if (recovery_needed_) return true;
  for (WorkerId w : current_.ranks) {
    if (lost_.count(w)) return true;
    auto it = workers_.find(w);
    if (it != workers_.end() && it->second.leaving) return true;
  }
  // Growing toward a scheduler's world size: wait for the launched workers to arrive.
  if (desired_world_ && static_cast<int>(cand.size()) < *desired_world_ &&
      launch_outstanding_ > 0) {
    return false;
  }
  int target = TargetWorld(cand.size());
  if (target == current_.config.world()) return false;
  if (noop_ && noop_->first == cand && noop_->second == target) return false;
  return true;
}

void Decider::MaybePropose(Out& out) {
  // One change at a time: whatever happens during a change is looked at once it is done.
  if (phase_ != Phase::kStable && phase_ != Phase::kStarting) return;
  if (finishing_) {
    MaybeComplete(out);
    return;
  }
  if (!ChangeNeeded()) {
    if (phase_ == Phase::kStable && launch_outstanding_ == 0) resize_active_ = false;
    return;
  }
  if (Candidates().empty()) {
    if (!workers_.empty() && lost_.empty()) {
      // Nobody was lost: every worker was asked to go (the whole job preempted or removed).
      phase_ = Phase::kStopped;
      out.push_back(DeciderAction::JobStopped{CancelledError(
          "the job stopped: every worker was asked to leave; no worker remains to take the "
          "state of generation " +
          std::to_string(current_.id))});
      return;
    }
    phase_ = Phase::kFailed;
    out.push_back(DeciderAction::JobFailed{FailedPreconditionError(
        "every worker is leaving or lost: no worker remains to take the state of generation " +
        std::to_string(current_.id))});
    return;
  }
  PlanRequest req;
  req.generation = ++last_id_;
  req.from = current_;
  req.candidates = Candidates();
  for (WorkerId w : current_.ranks) {
    if (lost_.count(w)) req.lost.push_back(w);
  }
  req.target_world = TargetWorld(req.candidates.size());
  pending_ = Generation{.id = req.generation};
  pending_change_ = ChangeParticipants{
      .lost = req.lost, .recovery = current_.id != 0 && (recovery_needed_ || !req.lost.empty())};
  choosing_ = false;
  participant_set_.clear();
  answered_.clear();
  reports_.clear();
  applied_.clear();
  applied_ok_.clear();
  aborted_fresh_ = false;
  lost_during_commit_.clear();
  failed_before_outcome_.clear();
  replan_ = false;
  phase_ = Phase::kPlanning;
  out.push_back(DeciderAction::ComputePlan{std::move(req)});
}

void Decider::OnJoin(const DeciderEvent::Join&, Out& out) {
  if (launch_outstanding_ > 0) --launch_outstanding_;
  MaybePropose(out);  // during a change, the joiner waits for the next one
}

void Decider::OnLeave(WorkerId w, Out& out) {
  auto it = workers_.find(w);
  if (it == workers_.end() || it->second.leaving || it->second.done) return;
  it->second.leaving = true;
  bool ranked = CurrentRank(w) >= 0;
  bool involved = pending_ && (IsParticipant(w) || phase_ == Phase::kPlanning);
  if (!ranked && !involved) {
    // A spare or a joiner holds no state: it may go at once.
    workers_.erase(it);
    out.push_back(DeciderAction::SendRelease{w, ReleaseMsg{current_.id}});
    if (phase_ == Phase::kPlanning) replan_ = true;
    return;
  }
  if (phase_ == Phase::kPlanning) replan_ = true;
  MaybePropose(out);  // folded into the change in progress' successor if there is one
}

void Decider::OnLost(WorkerId w, const std::string& reason, Out& out) {
  auto it = workers_.find(w);
  if (it == workers_.end()) return;  // duplicate, or released
  bool was_done = it->second.done;
  workers_.erase(it);
  // A worker that leaves in the committed change and answered Applied(ok) did its part: it
  // exits as soon as its exchange is done, perhaps before the others' closing barrier returns.
  // Its connection closing is its departure, not a loss (no abort, no recovery).
  if (phase_ == Phase::kCommitted && pending_ && applied_ok_.count(w) &&
      std::find(pending_change_.exiting.begin(), pending_change_.exiting.end(), w) !=
          pending_change_.exiting.end()) {
    lost_during_commit_.insert(w);  // answered already; no outcome is sent to it
    return;
  }
  bool ranked = CurrentRank(w) >= 0;
  if (finishing_) return OnLostWhileFinishing(w, was_done, reason, out);
  if (ranked) {
    lost_.insert(w);
    recovery_needed_ = true;
  }
  if (ranked || (pending_ && IsParticipant(w) && phase_ == Phase::kCommitted)) {
    std::set<WorkerId> to;
    for (WorkerId r : current_.ranks) {
      if (!lost_.count(r) && workers_.count(r)) to.insert(r);
    }
    if (pending_) {
      for (WorkerId p : pending_change_.participants) {
        if (p != w && workers_.count(p)) to.insert(p);
      }
    }
    out.push_back(DeciderAction::SendAbort{
        std::vector<WorkerId>(to.begin(), to.end()),
        AbortMsg{.generation = current_.id,
                 .reason = "worker " + std::to_string(w) + " lost: " + reason}});
  }
  switch (phase_) {
    case Phase::kPlanning:
      replan_ = true;
      break;
    case Phase::kPreparing:
      if (IsParticipant(w)) {
        AbandonPending(out);
        MaybePropose(out);
      }
      break;
    case Phase::kCommitted:
      if (IsParticipant(w)) {
        lost_during_commit_.insert(w);
        answered_.insert(w);
        MaybeFinishChange(out);
      }
      break;
    default:
      MaybePropose(out);
  }
}

void Decider::OnLostWhileFinishing(WorkerId w, bool was_done, const std::string& reason,
                                   Out& out) {
  // Training ended: nothing is recovered any more. A member gone now counts as finished.
  if (CurrentRank(w) >= 0) gone_after_done_.insert(w);
  if (!was_done) {
    // It died inside its last step: the members still in theirs would wait on it, and then
    // for a recovery that does not come (they are released).
    recovery_needed_ = recovery_needed_ || CurrentRank(w) >= 0;
    std::vector<WorkerId> to = UnfinishedMembers();
    if (!to.empty()) {
      out.push_back(DeciderAction::SendAbort{
          std::move(to), AbortMsg{.generation = current_.id,
                                  .reason = "worker " + std::to_string(w) + " lost: " + reason}});
    }
  }
  if (phase_ == Phase::kCommitted && IsParticipant(w) && !answered_.count(w)) {
    lost_during_commit_.insert(w);
    answered_.insert(w);
    return MaybeFinishChange(out);
  }
  MaybeComplete(out);
}

Status ValidateResize(const ResizeRequest& r, int64_t max_world) {
  auto range = [&](const char* field, int64_t lo, int64_t v) {
    return InvalidArgumentError(std::string(field) + ": must be in [" + std::to_string(lo) + ", " +
                                std::to_string(max_world) + "], got " + std::to_string(v));
  };
  if (r.world_size && (r.add != 0 || !r.remove.empty())) {
    return InvalidArgumentError("world_size: cannot be combined with add or remove");
  }
  if (!r.world_size && r.add == 0 && r.remove.empty()) {
    return InvalidArgumentError("world_size: missing (or give a non-zero add, or remove)");
  }
  if (r.world_size && (*r.world_size < 1 || *r.world_size > max_world)) {
    return range("world_size", 1, *r.world_size);
  }
  if (r.add < 0 || r.add > max_world) return range("add", 0, r.add);
  std::set<WorkerId> seen;
  for (WorkerId w : r.remove) {
    if (w < 0) {
      return InvalidArgumentError("remove: worker ids are non-negative, got " + std::to_string(w));
    }
    if (!seen.insert(w).second) {
      return InvalidArgumentError("remove: worker " + std::to_string(w) + " listed twice");
    }
  }
  if (r.reason.size() > kMaxResizeReasonBytes) {
    return InvalidArgumentError("reason: longer than " + std::to_string(kMaxResizeReasonBytes) +
                                " bytes");
  }
  return Status::Ok();
}

void Decider::OnResize(const ResizeRequest& r, Out& out) {
  auto answer = [&](Status s) {
    out.push_back(DeciderAction::AnswerResize{r.request_id, std::move(s)});
  };
  if (Status v = ValidateResize(r, options_.max_world); !v.ok()) return answer(std::move(v));
  for (WorkerId w : r.remove) {
    if (!workers_.count(w)) {
      return answer(InvalidArgumentError("remove: no worker " + std::to_string(w) + " in the job"));
    }
  }
  if (phase_ == Phase::kStarting) {
    return answer(FailedPreconditionError("the job has not started (no generation yet)"));
  }
  if (finishing_) {
    return answer(FailedPreconditionError("the job is finishing (a worker's training loop ended)"));
  }
  if (resize_active_ && phase_ != Phase::kStable) {
    return answer(FailedPreconditionError("a resize is in progress (generation " +
                                          std::to_string(pending_ ? pending_->id : 0) + " is " +
                                          std::string(DeciderPhaseName(phase_)) + ")"));
  }
  // After a resize the job should have `want` workers (ranks plus spares).
  int64_t have = static_cast<int64_t>(Candidates().size());
  for (WorkerId w : r.remove) have -= workers_.at(w).leaving ? 0 : 1;
  int64_t want = r.world_size ? *r.world_size : have + r.add;
  if (want > options_.max_world) {
    return answer(
        InvalidArgumentError("add: the world would exceed " + std::to_string(options_.max_world)));
  }
  if (want < 1) return answer(InvalidArgumentError("remove: would leave no worker"));
  for (WorkerId w : r.remove) workers_.at(w).leaving = true;
  desired_world_ = static_cast<int>(want);
  int64_t missing = want - have - launch_outstanding_;
  if (missing > 0) {
    launch_outstanding_ += static_cast<int>(missing);
    out.push_back(DeciderAction::LaunchWorkers{static_cast<int>(missing)});
  } else if (want <= have) {
    launch_outstanding_ = 0;  // workers still on their way become spares or are released
  }
  resize_active_ = true;
  noop_.reset();
  answer(Status::Ok());
  // Removed standby workers hold no state: release them now.
  for (WorkerId w : r.remove) {
    if (CurrentRank(w) < 0 && !(pending_ && IsParticipant(w))) {
      workers_.erase(w);
      out.push_back(DeciderAction::SendRelease{w, ReleaseMsg{current_.id}});
    }
  }
  if (phase_ == Phase::kPlanning) replan_ = true;
  MaybePropose(out);
}

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

void Decider::OnFailureReport(const DeciderEvent::FailureReport& e, Out& out) {
  // A failure in the committed change's generation before its outcome: a participant passed
  // the closing barrier and its first step failed. It counts once the change is applied.
  if (phase_ == Phase::kCommitted && pending_ && e.report.generation == pending_->id &&
      pending_->RankOf(e.worker) >= 0) {
    failed_before_outcome_.insert(e.worker);
    return;
  }
  // Only a failure in the current generation's step matters; one reported against an older
  // generation is the echo of a change that already happened.
  if (e.report.generation != current_.id || CurrentRank(e.worker) < 0) return;
  recovery_needed_ = true;
  if (finishing_) return MaybeComplete(out);  // no recovery now: the reporter is released
  switch (phase_) {
    case Phase::kPlanning:
      if (!pending_change_.recovery) replan_ = true;
      break;
    case Phase::kPreparing:
      // A planned change's participants would switch at S with this worker's torn state: start
      // over as a recovery.
      if (!pending_change_.recovery) {
        AbandonPending(out);
        MaybePropose(out);
      }
      break;
    case Phase::kStable:
      MaybePropose(out);
      break;
    default:
      break;  // committed: its outcome comes first, then the recovery
  }
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
  MaybeFinishChange(out);
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

void Decider::OnTick(int64_t now_ms, Out& out) {
  OnRejoinDeadline(now_ms, out);
  if (options_.heartbeat_timeout_ms <= 0) return;
  std::vector<WorkerId> silent;
  for (const auto& [id, w] : workers_) {
    if (!w.done && now_ms - w.last_seen_ms > options_.heartbeat_timeout_ms) silent.push_back(id);
  }
  for (WorkerId w : silent) {
    std::string reason =
        "no heartbeat for more than " + std::to_string(options_.heartbeat_timeout_ms) + " ms";
    out.push_back(DeciderAction::Disconnect{w, reason});
    OnLost(w, reason, out);
  }
  // A recovery waits for every survivor's state: one that cannot report holds up the job.
  if (phase_ == Phase::kPreparing && pending_ && pending_change_.recovery && !choosing_ &&
      recovery_prepared_ms_ >= 0 &&
      now_ms - recovery_prepared_ms_ > options_.heartbeat_timeout_ms) {
    std::vector<WorkerId> hung;
    for (WorkerId w : OldRanksAlive()) {
      if (!reports_.count(w)) hung.push_back(w);
    }
    for (WorkerId w : hung) {
      if (phase_ != Phase::kPreparing || !workers_.count(w)) break;  // already replanned
      std::string reason = "no state report for generation " + std::to_string(pending_->id) +
                           "'s recovery within " +
                           std::to_string(options_.heartbeat_timeout_ms) +
                           " ms (its training thread did not reach a step boundary)";
      out.push_back(DeciderAction::Disconnect{w, reason});
      OnLost(w, reason, out);
    }
  }
}

void Decider::OnDone(WorkerId w, Out& out) {
  auto it = workers_.find(w);
  if (it == workers_.end() || it->second.done) return;
  // Only a member's training loop can end: one of the current generation's ranks, or one that
  // already switched into the committed generation (its Applied came first).
  const bool member =
      CurrentRank(w) >= 0 || (phase_ == Phase::kCommitted && applied_ok_.count(w) > 0);
  if (!member) return;
  it->second.done = true;
  if (!finishing_) {
    finishing_ = true;
    DropChangeForFinish(out);
  }
  if (phase_ == Phase::kCommitted && IsParticipant(w) && !answered_.count(w)) {
    // An old rank that finished before the switch step never enters the change, so nobody
    // passes its closing barrier: the change cannot apply. Its joiners wait in the exchange
    // for it; abort them out of it so that they answer.
    answered_.insert(w);
    std::vector<WorkerId> waiting;
    for (WorkerId p : pending_change_.participants) {
      if (CurrentRank(p) < 0 && !answered_.count(p) && workers_.count(p)) waiting.push_back(p);
    }
    if (!waiting.empty() && !aborted_fresh_) {
      aborted_fresh_ = true;
      out.push_back(DeciderAction::SendAbort{
          std::move(waiting),
          AbortMsg{.generation = current_.id,
                   .reason = "worker " + std::to_string(w) + " finished training before step " +
                             std::to_string(pending_->start_step) + " (the switch step)"}});
    }
    return MaybeFinishChange(out);
  }
  MaybeComplete(out);
}

void Decider::DropChangeForFinish(Out& out) {
  switch (phase_) {
    case Phase::kPlanning:  // its PlanReady is ignored
      pending_.reset();
      phase_ = current_.id == 0 ? Phase::kStarting : Phase::kStable;
      break;
    case Phase::kPreparing:  // nobody switched: the participants forget it
      AbandonPending(out);
      break;
    default:  // committed: it closes once every participant answered (OnDone, OnApplied)
      break;
  }
}

std::vector<WorkerId> Decider::UnfinishedMembers() const {
  std::vector<WorkerId> out;
  for (WorkerId r : current_.ranks) {
    auto it = workers_.find(r);
    if (it != workers_.end() && !it->second.done) out.push_back(r);
  }
  return out;
}

void Decider::MaybeComplete(Out& out) {
  // A change in progress finishes first (MaybeFinishChange comes back here through
  // MaybePropose); a job without a generation has nothing to complete.
  if (phase_ != Phase::kStable || current_.id == 0) return;
  bool complete = true;
  for (WorkerId w : current_.ranks) {
    auto it = workers_.find(w);
    if (it == workers_.end()) {
      // Gone once training ended, or lost before it (never recovered now).
      complete = complete && (gone_after_done_.count(w) > 0 || lost_.count(w) > 0);
    } else if (!it->second.done) {
      complete = false;
      // A member still in its last step finishes it and sends Done. One whose generation
      // failed waits at a step boundary for a recovery that will not come: the Release makes
      // its BeginStep return done().
      if (recovery_needed_ && !it->second.released) {
        it->second.released = true;
        out.push_back(DeciderAction::SendRelease{w, ReleaseMsg{current_.id}});
      }
    }
  }
  if (!complete) return;
  phase_ = Phase::kComplete;
  resize_active_ = false;
  for (auto& [id, info] : workers_) {
    if (CurrentRank(id) < 0) out.push_back(DeciderAction::SendRelease{id, ReleaseMsg{current_.id}});
  }
  out.push_back(DeciderAction::JobComplete{current_.id});
}

}  // namespace morph
