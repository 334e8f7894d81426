// Deterministic simulation of the change protocol: one Decider, a dozen AgentCores, a simulated
// network with random delays and late duplicates (per-connection FIFO, as TCP, plus stale
// copies delivered out of order), random joins, leave requests, resizes and deaths of workers
// that hold no rank, and training threads coupled by their collectives (a step completes only
// when every rank of its generation began it). After every event the invariants are checked:
//   - every step number is trained in one generation only, by every worker that trains it
//     (all workers switch at the same step boundary);
//   - each worker's steps are consecutive and a generation's first step is its start step;
//   - one change at a time; a generation never changes once committed; store generations rise;
// and at the end the job is live: stable, everybody in the last generation, training. Workers
// holding a rank die too: the survivors are aborted, report the step their state holds, and
// the recovery resumes every rank at one step (steps from it on are trained again).
// Half the schedules are a job of a fixed number of steps L: a ranked worker ends its loop at
// the boundary of step L (in the style of examples/gpt: BeginStep(L), then break; or, in the
// other style, right after step L-1 without calling BeginStep(L)), sends Done and exits at
// once or lingers until the job completes (a hosting rank 0), whatever change is being planned,
// prepared or committed meanwhile. Such a job must complete: every worker ends, none trains
// step L or later, and nothing is left waiting.
// Two schedules in five lose their coordinator up to three times (coordinator failover): the
// leader dies after persisting its decider's state (Decider::Save) and before carrying out some
// or all of that event's actions; what workers sent it since is lost; a successor restores the
// saved state (Load, Resume), every live worker reconnects (Rejoin) and sends again what it is
// owed an answer for (AgentCore::Outstanding); the same invariants hold, and a re-sent commit is
// the original one.
// MORPH_TEST_SEED=<n> runs one seed (printed on failure); MORPH_SIM_RUNS overrides the count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <typeinfo>
#include <variant>
#include <vector>

#include "runtime/agent/agent_core.h"
#include "runtime/state/step_core.h"
#include "runtime/coordinator/decider.h"

namespace morph {
namespace {

using ToWorker =
    std::variant<PrepareMsg, CommitMsg, AbandonMsg, OutcomeMsg, ReleaseMsg, AbortMsg>;

struct SimWorker {
  explicit SimWorker(WorkerId id) : core(id) {}
  AgentCore core;
  bool alive = true;
  bool connected = false;  // Join delivered
  int64_t next_step = 0;
  // The training thread's step lifecycle (the runtime's StepCore): in_step() while it began
  // next_step - 1 and waits for its collectives.
  StepCore step;
  int64_t in_step_gen = 0;
  int64_t last_step = -1;  // last step begun, -1: none
  int64_t last_step_gen = 0;
  int64_t arrived_for = 0;  // generation whose closing barrier it waits at
  bool reported_exit = false;
  bool poked = false;
  bool finished_loop = false;  // its training loop ended (it sent Done)
  bool lingers = false;        // after Done it stays connected until the job completes
  bool done_delivered = false;     // a leader has its Done (or it needs none)
  bool exit_after_rejoin = false;  // it exits once a successor has heard its Done
  // The change it was preparing or had committed when an Abort of the generation that change
  // starts from came: its switch fails (the runtime aborts that change, not later ones).
  int64_t aborted_change = 0;
  int64_t prepared_id = 0;       // the last change it received a Prepare for
  int64_t prepared_from = 0;     // ... and the generation that change starts from
  bool joined_after_end = false;
  bool switch_failed = false;  // SwitchDone(false): waiting for the outcome
};

class Sim {
 public:
  explicit Sim(uint64_t seed)
      : rng_(seed), succession_rng_(seed * 7919 + 17),
        decider_(DeciderOptions{.initial_world = 0, .max_world = 12}) {}

  // Returns "" or the first violated invariant.
  std::string Run() {
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

  int64_t commits() const { return static_cast<int64_t>(commits_.size()); }
  bool complete() const { return complete_; }
  bool done_during_change() const { return done_during_change_; }
  int64_t resumed() const { return resumed_; }
  bool ended() const { return ended_; }
  int64_t recoveries() const { return recoveries_; }
  int successions() const { return successions_; }

 private:
  struct Event {
    int64_t time;
    int64_t seq;
    std::function<void()> fn;
    bool operator<(const Event& o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };

  SimWorker& W(WorkerId id) {
    auto it = workers_.find(id);
    if (it == workers_.end()) {
      Fail("unknown worker " + std::to_string(id));
      static SimWorker ghost(-1);
      ghost.alive = false;
      return ghost;
    }
    return it->second;
  }

  int64_t Rand(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  void Schedule(int64_t t, std::function<void()> fn) { queue_.push({t, seq_++, std::move(fn)}); }

  // Per-connection FIFO with random delay; sometimes a stale duplicate arrives much later.
  int64_t ChannelTime(int64_t from, int64_t to) {
    int64_t& last = channel_[{from, to}];
    last = std::max(last, now_ + Rand(1, 30));
    return last;
  }
  // Fed only if the coordinator it was meant for still leads (a dead one's input is lost).
  void FeedAt(int64_t t, DeciderEvent::Any e) {
    const int ep = epoch_;
    Schedule(t, [this, e, ep] {
      if (ep == epoch_) Feed(e);
    });
  }
  void ToCoordinator(WorkerId from, DeciderEvent::Any e) {
    FeedAt(ChannelTime(from, -1), e);
    if (Chance(0.05)) FeedAt(now_ + Rand(30, 400), e);
  }
  void ToWorkerMsg(WorkerId to, ToWorker m) {
    Schedule(ChannelTime(-1, to), [this, to, m] { Deliver(to, m); });
    if (Chance(0.05)) Schedule(now_ + Rand(30, 400), [this, to, m] { Deliver(to, m); });
  }

  void SpawnWorker(int64_t delay) {
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

  void Chaos() {
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

  void Kill(WorkerId id, const std::string& reason = "killed") {
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

  // The training loop ends (Runtime::Finish): Done, then the process exits, at once or (a
  // hosting rank 0) when the job completed. A worker released by the job's end says Done too.
  void EndLoop(SimWorker& w) {
    if (w.finished_loop) return;
    w.finished_loop = true;
    w.step.Finished();
    if (!w.core.finished() || w.core.released()) {
      if (decider_.pending() && !done_sent_) done_during_change_ = true;
      done_sent_ = true;
      const WorkerId me = w.core.me();
      const int ep = epoch_;
      Schedule(ChannelTime(me, -1), [this, me, ep] {
        if (ep != epoch_) return;
        W(me).done_delivered = true;
        Feed(DeciderEvent::Done{.worker = me});
      });
      if (Chance(0.05)) FeedAt(now_ + Rand(30, 400), DeciderEvent::Done{.worker = me});
    } else {
      w.done_delivered = true;
    }
    w.lingers = Chance(0.5);
    const WorkerId id = w.core.me();
    if (!w.lingers) Schedule(now_ + Rand(1, 60), [this, id] { ExitAfterDone(id); });
  }

  // With failover the runtime's Finish returns only once a leader has its Done: a Done lost with
  // a dead leader is said again in the rejoin, and the process exits after that.
  void ExitAfterDone(WorkerId id) {
    SimWorker& w = W(id);
    if (max_successions_ == 0 || w.done_delivered) return Kill(id, "exited");
    w.exit_after_rejoin = true;
    const int ep = epoch_;
    Schedule(now_ + 5, [this, id, ep] {
      if (ep == epoch_ && W(id).alive && W(id).done_delivered) Kill(id, "exited");
    });
  }

  void CheckEveryWorkerEnded() {
    for (auto& [id, w] : workers_) {
      if (!w.alive || !w.connected || w.joined_after_end) continue;
      if (!w.finished_loop && !w.core.finished()) {
        Fail("the job completed but worker " + std::to_string(id) + " still waits");
      }
    }
  }

  void Feed(DeciderEvent::Any e) {
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

  bool SuccessionChance(double p) { return std::bernoulli_distribution(p)(succession_rng_); }

  // The leader died after writing persisted_ (and after some of its last actions): a successor
  // restores it; every live worker reconnects to it.
  void Succeed() {
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

  void Rejoin(WorkerId id, int ep) {
    if (ep != epoch_) return;  // another succession since: it reconnects to that leader
    SimWorker& w = W(id);
    // A finished process exits instead (the agent never reconnects once finished).
    if (!w.alive || (w.core.finished() && !w.finished_loop)) return;
    Feed(DeciderEvent::Rejoin{.worker = id,
                              .host = "h",
                              .generation = w.core.generation().id,
                              .awaiting_outcome = w.core.awaiting_outcome(),
                              .done = w.finished_loop,
                              .leaving = leave_sent_.count(id) > 0,
                              .prepared = w.core.prepared()});
    if (ep != epoch_) return;
    if (w.finished_loop) w.done_delivered = true;  // the rejoin said so
    if (auto m = w.core.Outstanding()) {
      std::visit([&](auto& x) { ToCoordinator(id, x); }, *m);
    }
    if (w.exit_after_rejoin && w.alive) Schedule(now_ + 1, [this, id] { Kill(id, "exited"); });
  }

  void Execute(DeciderAction::Any& action) {
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

  // A config planner: keep old ranks where they are, fill with the others; sometimes a smaller
  // world than allowed (the policy leaves spares), sometimes a shuffled assignment.
  StatusOr<PlannedChange> Plan(const PlanRequest& req) {
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

  void Deliver(WorkerId to, const ToWorker& m) {
    SimWorker& w = W(to);
    if (std::getenv("MORPH_SIM_TRACE")) {
      fprintf(stderr, "t=%ld -> worker %ld: msg %zu next_step %ld g%ld\n", static_cast<long>(now_),
              static_cast<long>(to), m.index(), static_cast<long>(w.next_step),
              static_cast<long>(w.core.generation().id));
    }
    if (!w.alive || w.core.finished() || w.finished_loop) return;
    std::visit(
        [&](auto& msg) {
          using M = std::decay_t<decltype(msg)>;
          if constexpr (std::is_same_v<M, PrepareMsg>) {
            if (msg.next.id > w.prepared_id) {
              w.prepared_id = msg.next.id;
              w.prepared_from = msg.from_generation;
            }
            if (msg.change.recovery) {
              // The agent aborts the running generation's collectives: a step waiting on them
              // fails, its updates never began (the state holds the step's values).
              if (msg.from_generation == w.core.generation().id && w.core.rank() >= 0 &&
                  w.core.Participates(msg.change) && w.step.in_step() &&
                  w.in_step_gen == w.core.generation().id) {
                (void)w.step.Abort();  // the agent aborts the generation's collectives
                --w.next_step;
              }
              w.core.OnRecoveryPrepare(msg);
              auto report = w.core.OnRecoveryBuilt(msg.next.id);
              if (report) ToCoordinator(to, *report);
            } else {
              auto report = w.core.OnPrepare(msg, w.next_step);
              if (report) ToCoordinator(to, *report);
            }
          } else if constexpr (std::is_same_v<M, CommitMsg>) {
            w.core.OnCommit(msg);
          } else if constexpr (std::is_same_v<M, AbandonMsg>) {
            w.core.OnAbandon(msg);
          } else if constexpr (std::is_same_v<M, OutcomeMsg>) {
            const bool waiting = w.switch_failed;
            w.core.OnOutcome(msg);
            if (waiting && w.core.reverted()) {
              // Nobody passed the closing barrier: the old generation stands, failed; a
              // recovery follows (the runtime's SlowPath).
              w.switch_failed = false;
              w.step.SwitchFailed(/*torn=*/false);
              w.core.OnStepFailed();
            } else if (waiting && !w.core.pending_commit()) {
              w.switch_failed = false;  // applied elsewhere: it follows into the new generation
            }
          } else if constexpr (std::is_same_v<M, ReleaseMsg>) {
            w.core.OnRelease(msg);
          } else if constexpr (std::is_same_v<M, AbortMsg>) {
            if (msg.generation == w.core.generation().id && w.core.rank() >= 0 &&
                w.step.in_step() && w.in_step_gen == msg.generation) {
              (void)w.step.Abort();  // its step's collectives fail: the step did not happen
              --w.next_step;
            }
            w.core.OnAbort(msg);
            // The runtime aborts its change from that generation, built or running
            // (Runtime::Impl::AbortSwitchFrom): its exchange fails for every participant.
            const auto& c = w.core.pending_commit();
            if (c && c->from.id == msg.generation) {
              w.aborted_change = c->next.id;
              if (w.arrived_for == c->next.id) FailBarrier(w.arrived_for);
            } else if (w.prepared_from == msg.generation) {
              w.aborted_change = w.prepared_id;
            }
          }
        },
        m);
    Poke(to);
  }

  // The training thread makes progress at random times.
  void Poke(WorkerId id) {
    SimWorker& w = W(id);
    if (w.poked) return;  // one wake-up pending is enough
    w.poked = true;
    Schedule(now_ + Rand(1, 15), [this, id] { Progress(id); });
  }

  void Progress(WorkerId id) {
    SimWorker& w = W(id);
    w.poked = false;
    if (!w.alive || !w.connected || w.finished_loop) return;
    if (w.step.in_step()) {
      // The step's collectives complete once every rank of its generation began it; then its
      // update (local writes) and EndStep.
      const Generation& g = GenOf(w.in_step_gen);
      for (WorkerId r : g.ranks) {
        if (!began_[{w.in_step_gen, w.next_step - 1}].count(r)) return;  // poked by r
      }
      w.step.BeginUpdate();
      if (!w.step.End().ok()) Fail("EndStep refused");
    }
    if (w.arrived_for) return;  // at a closing barrier
    const bool at_end = total_steps_ > 0 && w.next_step >= total_steps_ && w.core.rank() >= 0;
    if (at_end && break_before_last_) return EndLoop(w);  // never calls BeginStep(L)
    switch (w.core.AtStep(w.next_step)) {
      case AgentCore::Action::kProceed:
        if (w.step.failed()) {
          return Fail("worker " + std::to_string(id) + " trains on at step " +
                      std::to_string(w.next_step) + " after a failed step, without a recovery");
        }
        if (at_end) return EndLoop(w);  // BeginStep(L) returned: the loop ends
        BeginStep(w);
        Poke(id);
        break;
      case AgentCore::Action::kWait:
        break;  // a message pokes it again
      case AgentCore::Action::kSwitch:
        ArriveAtBarrier(w);
        break;
      case AgentCore::Action::kCannotSwitch: {
        AppliedMsg m = w.core.SwitchDone(false, "step failed before the switch step");
        w.switch_failed = true;
        ToCoordinator(id, m);
        break;
      }
      case AgentCore::Action::kReport: {
        auto report = w.core.OnRecoveryState(w.next_step, !w.step.torn(), -1, -1);
        if (report) ToCoordinator(id, *report);
        Poke(id);
        break;
      }
      case AgentCore::Action::kFinished:
        if (w.core.released() && w.core.rank() >= 0) {
          EndLoop(w);  // a member released because the job ends: Done, then it exits
        } else if (!w.reported_exit) {
          w.reported_exit = true;
          FeedAt(now_ + Rand(1, 20), DeciderEvent::Lost{.worker = id, .reason = "exited"});
        }
        break;
    }
  }

  const Generation& GenOf(int64_t id) {
    auto it = commits_.find(id);
    if (it == commits_.end()) {
      Fail("unknown generation " + std::to_string(id));
      static Generation empty;
      return empty;
    }
    return it->second.next;
  }

  void BeginStep(SimWorker& w) {
    const Generation& g = w.core.generation();
    int64_t step = w.next_step;
    if (!w.step.CheckBegin(step).ok()) Fail("BeginStep with a step open");
    w.step.Begin(step);
    if (!w.step.CanVote(step).ok()) Fail("the step cannot vote");  // it declares its update
    std::ostringstream who;
    who << "worker " << w.core.me() << " step " << step << " gen " << g.id;
    auto [it, fresh] = step_gen_.emplace(step, g.id);
    if (!fresh && it->second != g.id) {
      Fail(who.str() + ": step already trained in generation " + std::to_string(it->second));
    }
    if (w.last_step >= 0 && w.last_step_gen == g.id && step != w.last_step + 1) {
      Fail(who.str() + ": not consecutive after " + std::to_string(w.last_step));
    }
    if (w.last_step_gen != g.id && step != g.start_step && w.last_step >= 0 &&
        step != w.last_step + 1) {
      Fail(who.str() + ": first step of the generation is not its start step");
    }
    if (step < g.start_step) Fail(who.str() + ": before the generation's start step");
    if (total_steps_ > 0 && step >= total_steps_) Fail(who.str() + ": past the job's last step");
    if (complete_) Fail(who.str() + ": after the job completed");
    if (w.core.rank() < 0) Fail(who.str() + ": trains without a rank");
    auto& began = began_[{g.id, step}];
    began.insert(w.core.me());
    if (began.size() == g.ranks.size()) {
      for (WorkerId r : g.ranks) Poke(r);  // the step's collectives complete
    }
    w.last_step = step;
    w.last_step_gen = g.id;
    w.in_step_gen = g.id;
    ++w.next_step;
  }

  void ArriveAtBarrier(SimWorker& w) {
    const CommitMsg c = *w.core.pending_commit();  // a copy: FinishSwitch resets it
    int64_t gid = c.next.id;
    w.arrived_for = gid;
    arrived_[gid].insert(w.core.me());
    if (barrier_failed_.count(gid)) return FinishSwitch(w, false);
    if (w.aborted_change == gid) return FailBarrier(gid);  // aborted before it ran
    for (WorkerId p : c.change.participants) {
      if (!W(p).alive) return FailBarrier(gid);
    }
    for (WorkerId p : c.change.participants) {
      if (!arrived_[gid].count(p)) return;  // wait for the others
    }
    barrier_done_.insert(gid);
    for (WorkerId p : c.change.participants) FinishSwitch(W(p), true);
  }

  void FailBarrier(int64_t gid) {
    barrier_failed_.insert(gid);
    for (WorkerId p : arrived_[gid]) {
      SimWorker& w = W(p);
      if (w.alive && w.arrived_for == gid) FinishSwitch(w, false);
    }
  }

  void FinishSwitch(SimWorker& w, bool ok) {
    int64_t start = w.core.pending_commit()->next.start_step;
    w.arrived_for = 0;
    AppliedMsg m = w.core.SwitchDone(ok, ok ? "" : "peer gone");
    if (ok) w.step.Recovered();
    w.switch_failed = !ok;
    if (ok && w.core.rank() >= 0) w.next_step = start;
    ToCoordinator(w.core.me(), m);
    Poke(w.core.me());
  }

  void CheckOneChange(int64_t id) {
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

  void CheckInvariants() {
    const Generation& cur = decider_.current();
    if (cur.id != 0) {
      auto it = commits_.find(cur.id);
      if (it == commits_.end() || !(it->second.next == cur)) {
        Fail("the decider's current generation differs from its commit");
      }
    }
  }

  bool Quiescent() {
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

  std::string Describe() {
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

  void Fail(const std::string& what) {
    if (error_.empty()) error_ = "t=" + std::to_string(now_) + ": " + what;
  }

  std::mt19937_64 rng_;
  std::mt19937_64 succession_rng_;
  DeciderOptions options_;
  Decider decider_;
  int max_successions_ = 0;
  int successions_ = 0;
  int epoch_ = 0;           // which coordinator leads (a dead one's input is dropped)
  std::string persisted_;   // the leader's last write
  std::set<WorkerId> leave_sent_;
  std::map<int64_t, bool> outcomes_;
  std::priority_queue<Event> queue_;
  int64_t now_ = 0;
  int64_t seq_ = 0;
  std::map<std::pair<int64_t, int64_t>, int64_t> channel_;
  std::map<WorkerId, SimWorker> workers_;
  WorkerId next_id_ = 1;
  int64_t next_request_ = 1;
  std::set<int64_t> requests_;
  std::set<WorkerId> leave_asked_;
  std::map<int64_t, CommitMsg> commits_;
  int64_t open_commit_ = 0;
  int64_t store_gen_ = 0;
  std::map<int64_t, std::set<WorkerId>> barrier_parts_, arrived_;
  std::set<int64_t> barrier_done_, barrier_failed_;
  std::map<int64_t, int64_t> step_gen_;
  std::map<std::pair<int64_t, int64_t>, std::set<WorkerId>> began_;
  std::string error_;
  bool ended_ = false;
  int kills_ = 0;  // ranked workers killed
  bool resume_ = false;  // resume at start (a restarted job)
  int64_t first_generation_ = 1;
  int64_t resumed_ = 0;     // first generations resumed from a checkpoint
  int64_t total_steps_ = 0;  // the job's last step + 1 (0: it trains for ever)
  bool break_before_last_ = false;  // the loop ends after step L-1, without BeginStep(L)
  bool complete_ = false;           // JobComplete came
  bool done_sent_ = false;
  bool done_during_change_ = false;  // the first Done came with a change in progress
  int64_t recoveries_ = 0;  // recovery commits
};

TEST(DeciderSimTest, SeededSchedulesKeepEveryInvariant) {
  int runs = 10000;
  uint64_t first = 1;
  if (const char* s = std::getenv("MORPH_TEST_SEED")) {
    first = std::strtoull(s, nullptr, 10);
    runs = 1;
  }
  if (const char* r = std::getenv("MORPH_SIM_RUNS")) runs = std::atoi(r);
  int64_t commits = 0, ended = 0, recoveries = 0, resumed = 0, complete = 0, mid_change = 0,
          successions = 0;
  for (int i = 0; i < runs; ++i) {
    uint64_t seed = first + i;
    Sim sim(seed);
    std::string err = sim.Run();
    ASSERT_EQ(err, "") << "seed " << seed << " (MORPH_TEST_SEED=" << seed << ")";
    commits += sim.commits();
    successions += sim.successions();
    recoveries += sim.recoveries();
    resumed += sim.resumed();
    ended += sim.ended() ? 1 : 0;
    complete += sim.complete() ? 1 : 0;
    mid_change += sim.done_during_change() ? 1 : 0;
  }
  // Jobs of a fixed length complete, and the end often meets a change in progress.
  EXPECT_GT(complete * 4, runs) << complete << " of " << runs << " runs completed";
  EXPECT_GT(mid_change * 50, runs) << mid_change << " runs ended during a change";
  // Few schedules end with every worker gone; most run to a live, quiescent job.
  EXPECT_LE(ended * 10, runs) << ended << " of " << runs << " runs ended";
  // The schedules exercise changes, not just the first generation.
  EXPECT_GT(commits, 3 * runs);
  // Deaths of ranked workers are recovered from, often.
  EXPECT_GT(recoveries, runs / 2) << recoveries << " recoveries in " << runs << " runs";
  // Coordinators die often (up to three times in two schedules of five).
  EXPECT_GT(successions * 5, runs) << successions << " successions in " << runs << " runs";
  // About a fifth of the schedules resume their first generation from a checkpoint.
  EXPECT_GT(resumed * 10, runs) << resumed << " resumed in " << runs << " runs";
}

}  // namespace
}  // namespace morph
