// The decider simulation's job side (decider_sim.h): the schedule and its chaos (joins, leave
// requests, resizes, deaths), the coordinator shell feeding the Decider, persisting and dying
// (successions), the simulated network, and the invariants checked after every event.
#include "runtime/coordinator/decider_sim.h"

namespace morph::decider_sim {

std::string Sim::Run() {
  std::uniform_int_distribution<int> n0(1, 4);
  int initial = n0(rng_);
  // A third of the schedules are a restarted job: resume at start, generations numbered after
  // an earlier run's, a checkpoint found (or none, or one that does not match).
  resume_ = Chance(0.33);
  first_generation_ = resume_ ? Rand(1, 5) : 1;
  if (Chance(0.5)) {
    total_steps_ = Rand(3, 250);
    break_before_last_ = Chance(0.5);
  }
  options_ = DeciderOptions{.initial_world = initial,
                            .max_world = 12,
                            .resume = resume_,
                            .first_generation = first_generation_,
                            .rejoin_timeout_ms = 400};
  decider_ = Decider(options_);
  // Its own generator: schedules without a succession are the ones they always were.
  if (std::bernoulli_distribution(0.4)(succession_rng_)) {
    max_successions_ = std::uniform_int_distribution<int>(1, 3)(succession_rng_);
  }
  for (int i = 0; i < initial; ++i) SpawnWorker(Rand(0, 20));
  if (resume_ && Chance(0.3)) {
    // An initial worker dies while the checkpoint is looked up (or before): the proposal is
    // abandoned; a replacement arrives and the job starts with it.
    Schedule(Rand(10, 80), [this] {
      if (decider_.current().id != 0) return;
      for (auto& [id, w] : workers_) {
        if (w.alive && w.connected) {
          ++kills_;  // it may hold a rank already (a commit on its way)
          Kill(id);
          SpawnWorker(Rand(1, 50));
          return;
        }
      }
    });
  }
  const int64_t chaos_until = 3000;
  for (int64_t t = Rand(20, 80); t < chaos_until; t += Rand(20, 150)) {
    Schedule(t, [this] { Chaos(); });
  }
  while (!queue_.empty() && error_.empty() && !ended_) {
    auto ev = queue_.top();
    queue_.pop();
    now_ = ev.time;
    ev.fn();
    CheckInvariants();
    if (now_ > chaos_until && !complete_ && Quiescent()) break;
    if (now_ > chaos_until + 200000)
      error_ = "not live: no quiescence by t=" + std::to_string(now_);
  }
  if (error_.empty() && complete_) CheckEveryWorkerEnded();
  if (error_.empty() && !ended_ && !complete_ && !Quiescent()) {
    error_ = "not live: the event queue ran dry";
  }
  if (!error_.empty()) error_ += "\n" + Describe();
  return error_;
}

SimWorker& Sim::W(WorkerId id) {
  auto it = workers_.find(id);
  if (it == workers_.end()) {
    Fail("unknown worker " + std::to_string(id));
    static SimWorker ghost(-1);
    ghost.alive = false;
    return ghost;
  }
  return it->second;
}

int64_t Sim::Rand(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
}

int64_t Sim::ChannelTime(int64_t from, int64_t to) {
  int64_t& last = channel_[{from, to}];
  last = std::max(last, now_ + Rand(1, 30));
  return last;
}

void Sim::FeedAt(int64_t t, DeciderEvent::Any e) {
  const int ep = epoch_;
  Schedule(t, [this, e, ep] {
    if (ep == epoch_) Feed(e);
  });
}

void Sim::ToCoordinator(WorkerId from, DeciderEvent::Any e) {
  FeedAt(ChannelTime(from, -1), e);
  if (Chance(0.05)) FeedAt(now_ + Rand(30, 400), e);
}

void Sim::ToWorkerMsg(WorkerId to, ToWorker m) {
  Schedule(ChannelTime(-1, to), [this, to, m] { Deliver(to, m); });
  if (Chance(0.05)) Schedule(now_ + Rand(30, 400), [this, to, m] { Deliver(to, m); });
}

void Sim::SpawnWorker(int64_t delay) {
  WorkerId id = next_id_++;
  workers_.emplace(id, SimWorker(id));
  Schedule(now_ + delay, [this, id] {
    SimWorker& w = W(id);
    if (!w.alive) return;
    w.connected = true;
    w.joined_after_end = complete_;  // the coordinator is gone: it cannot join
    Feed(DeciderEvent::Join{.worker = id, .host = "h"});
    Poke(id);
  });
}

void Sim::Chaos() {
  // The job starts once its initial workers joined; the schedules disturb it after that.
  if (decider_.current().id == 0 || complete_) return;
  int kind = static_cast<int>(Rand(0, 9));
  std::vector<WorkerId> live, unranked_live, nonleaving;
  for (auto& [id, w] : workers_) {
    if (!w.alive || !w.connected || w.core.finished()) continue;
    live.push_back(id);
    if (w.core.rank() < 0) unranked_live.push_back(id);
  }
  // The last worker that may hold the state never leaves (that would end the job).
  for (WorkerId id : decider_.candidates()) {
    if (!leave_asked_.count(id) && W(id).alive) nonleaving.push_back(id);
  }
  if (kind <= 2 && live.size() < 10) {
    SpawnWorker(Rand(1, 50));
  } else if (kind <= 4 && nonleaving.size() > 1) {
    WorkerId w = nonleaving[Rand(0, nonleaving.size() - 1)];
    leave_asked_.insert(w);
    leave_sent_.insert(w);
    ToCoordinator(w, DeciderEvent::LeaveRequest{.worker = w});
  } else if (kind <= 7) {
    ResizeRequest r{.request_id = next_request_++};
    if (Chance(0.7) || nonleaving.size() < 2) {
      r.world_size = static_cast<int>(Rand(0, 9));  // 0 is refused
    } else if (Chance(0.5)) {
      r.add = static_cast<int>(Rand(1, 3));
    } else {
      r.remove = {nonleaving[Rand(0, nonleaving.size() - 1)]};
      leave_asked_.insert(r.remove[0]);  // if refused (a change in flight) it stays; fine
    }
    requests_.insert(r.request_id);
    Feed(DeciderEvent::Resize{r});
  } else if (kind == 8 && !unranked_live.empty() && live.size() > 1) {
    // A worker with no rank dies (a joiner mid-change, a spare): its peers in the change's
    // exchange fail, the change does not apply, the job goes on.
    WorkerId id = unranked_live[Rand(0, unranked_live.size() - 1)];
    Kill(id);
  } else if (kind == 9 && live.size() > 2 && kills_ < 3) {
    // A worker holding a rank dies mid-step, mid-change, anywhere: the survivors' collectives
    // hang until the recovery aborts them; the job recovers from the survivors' state.
    std::vector<WorkerId> ranked;
    for (WorkerId id : live) {
      if (W(id).core.rank() >= 0) ranked.push_back(id);
    }
    if (ranked.size() > 1) {
      ++kills_;
      Kill(ranked[Rand(0, ranked.size() - 1)]);
    }
  }
}

void Sim::Kill(WorkerId id, const std::string& reason) {
  SimWorker& w = W(id);
  w.alive = false;
  // Its connection drops: the coordinator notices after a delay; a process that exits
  // normally closes it after what it sent (its Done is read first).
  const int64_t at = reason == "exited" ? ChannelTime(id, -1) : now_ + Rand(1, 40);
  FeedAt(at, DeciderEvent::Lost{.worker = id, .reason = reason});
  // Any closing barrier it was part of fails.
  for (auto& [gid, parts] : barrier_parts_) {
    if (parts.count(id) && !barrier_done_.count(gid)) FailBarrier(gid);
  }
}

void Sim::CheckEveryWorkerEnded() {
  for (auto& [id, w] : workers_) {
    if (!w.alive || !w.connected || w.joined_after_end) continue;
    if (!w.finished_loop && !w.core.finished()) {
      Fail("the job completed but worker " + std::to_string(id) + " still waits");
    }
    if (w.exit_when_acked && !w.done_delivered) {
      Fail("the job completed but worker " + std::to_string(id) +
           " still waits for the acknowledgment of its Done");
    }
  }
}

void Sim::Feed(DeciderEvent::Any e) {
  if (std::getenv("MORPH_SIM_TRACE")) {
    std::visit(
        [&](auto& x) {
          using E = std::decay_t<decltype(x)>;
          std::string n = typeid(E).name();
          if constexpr (requires { x.worker; }) n += " worker " + std::to_string(x.worker);
          if constexpr (std::is_same_v<E, StepReportMsg>) {
            n += " g" + std::to_string(x.generation) + " b " + std::to_string(x.last_free_step);
          }
          if constexpr (std::is_same_v<E, DeciderEvent::Resize>) {
            n += " ws " + std::to_string(x.request.world_size.value_or(-1)) + " add " +
                 std::to_string(x.request.add) + " rm " +
                 std::to_string(x.request.remove.empty() ? -1 : x.request.remove[0]);
          }
          fprintf(stderr, "t=%ld %s (phase %s)\n", static_cast<long>(now_), n.c_str(),
                  std::string(DeciderPhaseName(decider_.phase())).c_str());
        },
        e);
  }
  std::vector<DeciderAction::Any> actions = decider_.Handle(now_, std::move(e));
  size_t cut = actions.size();
  bool die = false;
  if (max_successions_ > 0) {
    persisted_ = decider_.Save();  // what the leader writes before it acts
    if (SuccessionChance(0.02)) {
      Decider copy(options_);
      if (Status s = copy.Load(persisted_); !s.ok() || copy.Save() != persisted_) {
        Fail("the saved decider state does not load back: " + s.ToString());
      }
    }
    if (successions_ < max_successions_ && decider_.current().id != 0 && !complete_ &&
        SuccessionChance(0.01)) {
      cut = std::uniform_int_distribution<size_t>(0, actions.size())(succession_rng_);
      die = true;
    }
  }
  for (size_t i = 0; i < cut; ++i) Execute(actions[i]);
  // The job's end is no message: the successor reaches it from the saved phase (the shell
  // finishes the job when it restores a completed, stopped or failed one).
  for (size_t i = cut; i < actions.size(); ++i) {
    if (std::holds_alternative<DeciderAction::JobComplete>(actions[i]) ||
        std::holds_alternative<DeciderAction::JobFailed>(actions[i]) ||
        std::holds_alternative<DeciderAction::JobStopped>(actions[i])) {
      Execute(actions[i]);
    }
  }
  if (die) Succeed();
}

void Sim::Succeed() {
  ++successions_;
  ++epoch_;
  Decider next(options_);
  if (Status s = next.Load(persisted_); !s.ok()) return Fail("restore: " + s.ToString());
  decider_ = std::move(next);
  store_gen_ = 0;     // the successor's store starts afresh
  requests_.clear();  // the dead leader's HTTP clients saw their connection close
  open_commit_ = decider_.phase() == Decider::Phase::kCommitted && decider_.pending()
                     ? decider_.pending()->id
                     : 0;
  for (auto& a : decider_.Resume(now_)) Execute(a);
  const int ep = epoch_;
  Schedule(now_ + options_.rejoin_timeout_ms + 1, [this, ep] {
    if (ep == epoch_) Feed(DeciderEvent::Tick{});
  });
  for (auto& [id, w] : workers_) {
    if (!w.alive || !w.connected || (w.core.finished() && !w.finished_loop)) continue;
    const WorkerId wid = id;
    const int64_t delay = std::uniform_int_distribution<int64_t>(5, 200)(succession_rng_);
    Schedule(now_ + delay, [this, wid, ep] { Rejoin(wid, ep); });
  }
}

void Sim::Execute(DeciderAction::Any& action) {
  std::visit(
      [&](auto& a) {
        using A = std::decay_t<decltype(a)>;
        if constexpr (std::is_same_v<A, DeciderAction::ComputePlan>) {
          PlanRequest req = a.request;
          const int ep = epoch_;
          Schedule(now_ + Rand(1, 60), [this, req, ep] {
            if (ep != epoch_) return;  // the planner died with its coordinator
            Feed(DeciderEvent::PlanReady{.generation = req.generation, .plan = Plan(req)});
          });
        } else if constexpr (std::is_same_v<A, DeciderAction::ChooseRecovery>) {
          // Pure DP: any whole state holds every piece; the newest whole step wins.
          DeciderAction::ChooseRecovery req = a;
          const int ep = epoch_;
          Schedule(now_ + Rand(1, 60), [this, req, ep] {
            if (ep != epoch_) return;
            StatusOr<RecoveryChoice> choice = DataLossError("no surviving state");
            int64_t best = -1;
            for (const StepReportMsg& r : req.reports) {
              if (r.state_ok) best = std::max(best, r.state_step);
            }
            if (best >= 0) {
              RecoveryChoice c;
              c.resume_step = best;
              for (const StepReportMsg& r : req.reports) {
                if (!(r.state_ok && r.state_step == best)) c.stale.push_back(r.worker);
              }
              c.plan_digest = 2000 + req.generation;
              choice = c;
            }
            Feed(DeciderEvent::RecoveryReady{.generation = req.generation,
                                             .choice = std::move(choice)});
          });
        } else if constexpr (std::is_same_v<A, DeciderAction::FindResumeCheckpoint>) {
          if (!resume_) Fail("looked for a checkpoint to resume from with resume off");
          // Again only when the first generation did not apply (a participant died in it).
          if (decider_.current().id != 0) Fail("looked for a checkpoint in a running job");
          const int64_t gen = a.generation;
          const int ep = epoch_;
          Schedule(now_ + Rand(1, 60), [this, gen, ep] {
            if (ep != epoch_) return;
            DeciderEvent::ResumeReady found{.generation = gen};
            const int64_t kind = Rand(0, 19);
            if (kind == 0) {
              found.status = FailedPreconditionError("checkpoint does not match: tensor 'w'");
            } else if (kind < 14) {
              const int64_t step = 4 * Rand(0, 12);
              found.checkpoint =
                  RecoveryCheckpoint{.step = step, .path = "ckpt/step-" + std::to_string(step)};
            }
            Feed(found);
          });
        } else if constexpr (std::is_same_v<A, DeciderAction::SendPrepare>) {
          CheckOneChange(a.msg.next.id);
          for (WorkerId w : a.to) ToWorkerMsg(w, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendCommit>) {
          CheckOneChange(a.msg.next.id);
          if (a.msg.next.id < first_generation_) Fail("a generation below the first one");
          // A successor sends the commit again to a participant that may not have it.
          auto [it, fresh] = commits_.emplace(a.msg.next.id, a.msg);
          if (!fresh && !(it->second == a.msg)) Fail("generation changed after its commit");
          if (a.msg.from_generation == 0) {
            // The first generation: afresh at 0, or resumed at the checkpoint's step.
            const bool from_ckpt = a.msg.change.recovery;
            if (from_ckpt &&
                (!resume_ || a.msg.recovery.source != RecoveryDecision::Source::kCheckpoint ||
                 a.msg.recovery.checkpoint !=
                     "ckpt/step-" + std::to_string(a.msg.next.start_step) ||
                 a.msg.recovery.newest_step != a.msg.next.start_step)) {
              Fail("a first generation's recovery that is no resume from its checkpoint");
            }
            if (!from_ckpt && a.msg.next.start_step != 0) Fail("a fresh start past step 0");
            if (from_ckpt && fresh) ++resumed_;
          }
          if (a.msg.change.recovery && fresh) {
            ++recoveries_;
            // Steps from the resume step on are trained again in the new generation.
            step_gen_.erase(step_gen_.lower_bound(a.msg.next.start_step), step_gen_.end());
          }
          open_commit_ = a.msg.next.id;
          barrier_parts_[a.msg.next.id] = std::set<WorkerId>(a.msg.change.participants.begin(),
                                                             a.msg.change.participants.end());
          for (WorkerId w : a.to) ToWorkerMsg(w, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendAbort>) {
          for (WorkerId w : a.to) ToWorkerMsg(w, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendAbandon>) {
          if (open_commit_ == a.msg.generation) Fail("abandoned a committed generation");
          for (WorkerId w : a.to) ToWorkerMsg(w, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendOutcome>) {
          auto [it, fresh] = outcomes_.emplace(a.msg.generation, a.msg.applied);
          if (it->second != a.msg.applied) Fail("an outcome changed");
          if (open_commit_ == a.msg.generation) {
            open_commit_ = 0;
          } else if (!commits_.count(a.msg.generation) || (fresh && successions_ == 0)) {
            Fail("outcome for a generation not committed");
          }
          for (WorkerId w : a.to) ToWorkerMsg(w, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendRelease>) {
          ToWorkerMsg(a.to, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::AckDone>) {
          ToWorkerMsg(a.to, DoneMsg{});
        } else if constexpr (std::is_same_v<A, DeciderAction::AdvanceStore>) {
          if (a.generation <= store_gen_) Fail("store generation did not rise");
          store_gen_ = a.generation;
        } else if constexpr (std::is_same_v<A, DeciderAction::AnswerResize>) {
          if (!requests_.erase(a.request_id)) Fail("resize answered twice or never asked");
        } else if constexpr (std::is_same_v<A, DeciderAction::LaunchWorkers>) {
          for (int i = 0; i < a.count; ++i) SpawnWorker(Rand(5, 200));
        } else if constexpr (std::is_same_v<A, DeciderAction::Disconnect>) {
          if (a.reason.starts_with("did not reconnect") || a.reason.find("declared lost") !=
                                                               std::string::npos) {
            if (W(a.worker).alive) Kill(a.worker, "disconnected");  // it cannot come back
          } else {
            Fail("no heartbeats are simulated, yet a worker was disconnected");
          }
        } else if constexpr (std::is_same_v<A, DeciderAction::JobComplete>) {
          if (total_steps_ == 0) Fail("a job without an end completed");
          complete_ = true;
          for (auto& [id, w] : workers_) {
            if (w.alive && w.lingers) {
              const WorkerId wid = id;
              Schedule(now_ + Rand(1, 20), [this, wid] { Kill(wid, "exited"); });
            }
          }
        } else if constexpr (std::is_same_v<A, DeciderAction::JobStopped>) {
          // A scheduler's shrink racing with the last workers' preemption notices ends the
          // job as asked, as long as nobody was left to take the state.
          if (!decider_.candidates().empty()) Fail("stopped with candidates left");
          ended_ = true;
        } else if constexpr (std::is_same_v<A, DeciderAction::JobFailed>) {
          // The same with a worker lost on the way: the job failed, legitimately.
          if (a.status.code() == StatusCode::kFailedPrecondition &&
              a.status.message().starts_with("every worker is leaving") &&
              decider_.candidates().empty()) {
            ended_ = true;
          } else if (a.status.code() == StatusCode::kDataLoss && kills_ > 0) {
            ended_ = true;  // every holder of the state died (never continue without it)
          } else if (resume_ && decider_.current().id == 0 &&
                     a.status.message().starts_with("checkpoint does not match")) {
            ended_ = true;  // the checkpoint to resume from is another job's: never start
          } else {
            Fail("job failed: " + a.status.ToString());
          }
        }
      },
      action);
}

StatusOr<PlannedChange> Sim::Plan(const PlanRequest& req) {
  int world = req.target_world;
  if (world > 1 && Chance(0.15)) world -= 1;
  if (world < 1) return InvalidArgumentError("no candidates");
  std::vector<WorkerId> order;
  std::set<WorkerId> cand(req.candidates.begin(), req.candidates.end());
  for (WorkerId w : req.from.ranks) {
    if (cand.count(w)) order.push_back(w);
  }
  for (WorkerId w : req.candidates) {
    if (std::find(order.begin(), order.end(), w) == order.end()) order.push_back(w);
  }
  order.resize(world);
  if (Chance(0.2)) std::shuffle(order.begin(), order.end(), rng_);
  PlannedChange p;
  p.config.dp = world;
  p.ranks = order;
  p.plan_digest = 1000 + req.generation;
  p.explanation = "dp=" + std::to_string(world);
  return p;
}

void Sim::CheckOneChange(int64_t id) {
  // A change whose every participant died has nobody to send its outcome to.
  if (open_commit_ != 0 && open_commit_ != id) {
    bool any_alive = false;
    for (WorkerId p : barrier_parts_[open_commit_]) any_alive = any_alive || W(p).alive;
    if (!any_alive) open_commit_ = 0;
  }
  if (open_commit_ != 0 && open_commit_ != id) {
    Fail("generation " + std::to_string(id) + " proposed while " + std::to_string(open_commit_) +
         " is committed without an outcome");
  }
}

void Sim::CheckInvariants() {
  const Generation& cur = decider_.current();
  if (cur.id != 0) {
    auto it = commits_.find(cur.id);
    if (it == commits_.end() || !(it->second.next == cur)) {
      Fail("the decider's current generation differs from its commit");
    }
  }
}

bool Sim::Quiescent() {
  if (decider_.phase() != Decider::Phase::kStable) return false;
  if (!requests_.empty()) return false;
  const Generation& cur = decider_.current();
  for (auto& [id, w] : workers_) {
    if (!w.alive || !w.connected || w.core.finished() || w.finished_loop) continue;
    bool ranked = cur.RankOf(id) >= 0;
    if (ranked && (w.core.generation().id != cur.id || w.last_step < cur.start_step + 5)) {
      return false;
    }
  }
  return true;
}

std::string Sim::Describe() {
  std::ostringstream os;
  const Generation& cur = decider_.current();
  os << "successions " << successions_ << "; decider: phase " << DeciderPhaseName(decider_.phase()) << ", current g" << cur.id
     << " S=" << cur.start_step << " ranks";
  for (WorkerId w : cur.ranks) os << " " << w;
  if (decider_.pending()) os << ", pending g" << decider_.pending()->id;
  os << ", resize " << decider_.resize_in_progress() << ", open requests " << requests_.size()
     << "\n";
  for (auto& [id, w] : workers_) {
    os << "  worker " << id << ": alive " << w.alive << " connected " << w.connected
       << " finished " << w.core.finished() << " g" << w.core.generation().id << " rank "
       << w.core.rank() << " next_step " << w.next_step << " in_step " << w.step.in_step()
       << " failed " << w.step.failed() << " last "
       << w.last_step << " gate " << w.core.gate() << " commit "
       << (w.core.pending_commit() ? w.core.pending_commit()->next.id : 0) << " barrier "
       << w.arrived_for << "\n";
  }
  return os.str();
}

void Sim::Fail(const std::string& what) {
  if (error_.empty()) error_ = "t=" + std::to_string(now_) + ": " + what;
}

}  // namespace morph::decider_sim
