// The decider simulation's workers (decider_sim.h): the coordinator's messages delivered to
// their AgentCores, their training threads coupled by collectives, switches and closing
// barriers, rejoining a successor, and the end of their loops (Done, its acknowledgment, exit).
#include "runtime/coordinator/decider_sim.h"

namespace morph::decider_sim {

void Sim::EndLoop(SimWorker& w) {
  if (w.finished_loop) return;
  w.finished_loop = true;
  w.step.Finished();
  if (!w.core.finished() || w.core.released()) {
    if (decider_.pending() && !done_sent_) done_during_change_ = true;
    done_sent_ = true;
    const WorkerId me = w.core.me();
    const int ep = epoch_;
    Schedule(ChannelTime(me, -1), [this, me, ep] {
      if (ep != epoch_) return;  // lost with the leader: the rejoin says it again
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

void Sim::ExitAfterDone(WorkerId id) {
  SimWorker& w = W(id);
  if (max_successions_ == 0 || w.done_delivered) return Kill(id, "exited");
  w.exit_when_acked = true;
}

void Sim::OnDoneAck(WorkerId id) {
  SimWorker& w = W(id);
  if (!w.alive || !w.finished_loop) return;
  w.done_delivered = true;
  if (w.exit_when_acked) Schedule(now_ + 1, [this, id] { Kill(id, "exited"); });
}

void Sim::Rejoin(WorkerId id, int ep) {
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
  if (auto m = w.core.Outstanding()) {
    std::visit([&](auto& x) { ToCoordinator(id, x); }, *m);
  }
}

void Sim::Deliver(WorkerId to, const ToWorker& m) {
  SimWorker& w = W(to);
  if (std::getenv("MORPH_SIM_TRACE")) {
    fprintf(stderr, "t=%ld -> worker %ld: msg %zu next_step %ld g%ld\n", static_cast<long>(now_),
            static_cast<long>(to), m.index(), static_cast<long>(w.next_step),
            static_cast<long>(w.core.generation().id));
  }
  if (std::holds_alternative<DoneMsg>(m)) return OnDoneAck(to);
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

void Sim::Poke(WorkerId id) {
  SimWorker& w = W(id);
  if (w.poked) return;  // one wake-up pending is enough
  w.poked = true;
  Schedule(now_ + Rand(1, 15), [this, id] { Progress(id); });
}

void Sim::Progress(WorkerId id) {
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

const Generation& Sim::GenOf(int64_t id) {
  auto it = commits_.find(id);
  if (it == commits_.end()) {
    Fail("unknown generation " + std::to_string(id));
    static Generation empty;
    return empty;
  }
  return it->second.next;
}

void Sim::BeginStep(SimWorker& w) {
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

void Sim::ArriveAtBarrier(SimWorker& w) {
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

void Sim::FailBarrier(int64_t gid) {
  barrier_failed_.insert(gid);
  for (WorkerId p : arrived_[gid]) {
    SimWorker& w = W(p);
    if (w.alive && w.arrived_for == gid) FinishSwitch(w, false);
  }
}

void Sim::FinishSwitch(SimWorker& w, bool ok) {
  int64_t start = w.core.pending_commit()->next.start_step;
  w.arrived_for = 0;
  AppliedMsg m = w.core.SwitchDone(ok, ok ? "" : "peer gone");
  if (ok) w.step.Recovered();
  w.switch_failed = !ok;
  if (ok && w.core.rank() >= 0) w.next_step = start;
  ToCoordinator(w.core.me(), m);
  Poke(w.core.me());
}

}  // namespace morph::decider_sim
