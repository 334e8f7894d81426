// The decider (decider.h): events in, actions out — joins, leaves, losses, resizes, failure
// reports, ticks and the job's end, and the proposals they lead to. A change's life once
// planned (prepare, reports, commit, Applied, outcome) is in decider_change.cc; the state saved
// for a successor and the rejoin in decider_persist.cc.
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
    // A Done after the end (a worker released at the job's completion) is acknowledged: there
    // is nothing left to count it for.
    if (const auto* d = std::get_if<DeciderEvent::Done>(&event)) {
      out.push_back(DeciderAction::AckDone{d->worker});
    }
    // A successor of a leader that completed the job (and died before releasing everyone):
    // a worker without a rank that reconnects is released as it would have been.
    const auto* r = std::get_if<DeciderEvent::Rejoin>(&event);
    if (r && r->done) out.push_back(DeciderAction::AckDone{r->worker});
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

void Decider::OnTick(int64_t now_ms, Out& out) {
  OnRejoinDeadline(now_ms, out);
  if (options_.heartbeat_timeout_ms <= 0) return;
  // Workers inherited from a dead leader that have not rejoined yet are OnRejoinDeadline's:
  // they have the whole rejoin window, not a heartbeat timeout counted from the succession.
  std::vector<WorkerId> silent;
  for (const auto& [id, w] : workers_) {
    if (!w.done && !rejoin_waiting_.count(id) &&
        now_ms - w.last_seen_ms > options_.heartbeat_timeout_ms) {
      silent.push_back(id);
    }
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
      if (!reports_.count(w) && !rejoin_waiting_.count(w)) hung.push_back(w);
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
  out.push_back(DeciderAction::AckDone{w});
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
