// The decider's deterministic simulation (decider_sim_test.cc runs it over thousands of seeds;
// the schedules and invariants are described there): Sim drives one Decider and a dozen
// simulated workers (AgentCore and StepCore, as the runtime's) through a seeded scheduler with a
// simulated network, and reports the first invariant it saw violated. decider_sim.cc is the
// job's side (the schedule, the coordinator shell and its successions, the network, the
// invariants); decider_sim_workers.cc the workers' (their messages, training threads,
// switches and the end of their loops).
//
//   decider_sim::Sim sim(seed);
//   std::string error = sim.Run();  // "" or the first violated invariant, with a description
//
// Test-only; one thread.
#ifndef MORPH_RUNTIME_COORDINATOR_DECIDER_SIM_H_
#define MORPH_RUNTIME_COORDINATOR_DECIDER_SIM_H_

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
#include "runtime/protocol/wire.h"

namespace morph::decider_sim {

// DoneMsg: the coordinator's acknowledgment of a worker's Done (DeciderAction::AckDone).
using ToWorker =
    std::variant<PrepareMsg, CommitMsg, AbandonMsg, OutcomeMsg, ReleaseMsg, AbortMsg, DoneMsg>;

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
  bool done_delivered = false;  // a leader acknowledged its Done (or it needs none)
  bool exit_when_acked = false;  // its Finish waits for that acknowledgment, then it exits
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
  std::string Run();

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

  SimWorker& W(WorkerId id);

  int64_t Rand(int64_t lo, int64_t hi);
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  void Schedule(int64_t t, std::function<void()> fn) { queue_.push({t, seq_++, std::move(fn)}); }

  // Per-connection FIFO with random delay; sometimes a stale duplicate arrives much later.
  int64_t ChannelTime(int64_t from, int64_t to);
  // Fed only if the coordinator it was meant for still leads (a dead one's input is lost).
  void FeedAt(int64_t t, DeciderEvent::Any e);
  void ToCoordinator(WorkerId from, DeciderEvent::Any e);
  void ToWorkerMsg(WorkerId to, ToWorker m);

  void SpawnWorker(int64_t delay);

  void Chaos();

  void Kill(WorkerId id, const std::string& reason = "killed");

  // The training loop ends (Runtime::Finish): Done, then the process exits, at once or (a
  // hosting rank 0) when the job completed. A worker released by the job's end says Done too.
  void EndLoop(SimWorker& w);

  // With failover the runtime's Finish returns only once a leader acknowledged its Done (the
  // leader persisted it first): a Done lost with a dead leader is said again in the rejoin, and
  // the process exits once that is acknowledged. Without failover it exits at once.
  void ExitAfterDone(WorkerId id);
  void OnDoneAck(WorkerId id);

  void CheckEveryWorkerEnded();

  void Feed(DeciderEvent::Any e);

  bool SuccessionChance(double p) { return std::bernoulli_distribution(p)(succession_rng_); }

  // The leader died after writing persisted_ (and after some of its last actions): a successor
  // restores it; every live worker reconnects to it.
  void Succeed();

  void Rejoin(WorkerId id, int ep);

  void Execute(DeciderAction::Any& action);

  // A config planner: keep old ranks where they are, fill with the others; sometimes a smaller
  // world than allowed (the policy leaves spares), sometimes a shuffled assignment.
  StatusOr<PlannedChange> Plan(const PlanRequest& req);

  void Deliver(WorkerId to, const ToWorker& m);

  // The training thread makes progress at random times.
  void Poke(WorkerId id);

  void Progress(WorkerId id);

  const Generation& GenOf(int64_t id);

  void BeginStep(SimWorker& w);

  void ArriveAtBarrier(SimWorker& w);

  void FailBarrier(int64_t gid);

  void FinishSwitch(SimWorker& w, bool ok);

  void CheckOneChange(int64_t id);

  void CheckInvariants();

  bool Quiescent();

  std::string Describe();

  void Fail(const std::string& what);

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

}  // namespace morph::decider_sim

#endif  // MORPH_RUNTIME_COORDINATOR_DECIDER_SIM_H_
