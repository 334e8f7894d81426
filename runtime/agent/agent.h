// Agent: the worker's side of the control channel (docs/design.md §9, runtime/agent/). It holds
// the connection to the coordinator (runtime/agent/control_client.h), sends heartbeats,
// feeds the coordinator's messages to the pure AgentCore (agent_core.h) and answers prepares
// with the step the training thread may reach, all on a control thread of its own. The training
// thread asks it at each step boundary whether to proceed:
//
//   agent->NoteBegin(step);                    // every BeginStep: one store, one load
//   if (agent->pending()) {                    // a change is in the air: the slow path
//     Agent::Decision d = agent->Decide(step, deadline);
//     ...  // kSwitch: apply d.commit, then agent->SwitchDone(ok)
//   }
//
// Ordering: NoteBegin stores the step and then loads the pending flag; the control thread sets
// the flag and then loads the step (both sequentially consistent). So either the training thread
// sees the flag at this boundary, or the control thread sees this step and promises at least
// the next one: a worker never begins a step beyond its promise (the gate) without the decision.
//
// Threads: NoteBegin, pending, Decide, SwitchDone belong to the training thread; RequestLeave,
// SendDone, Close and the accessors are for any thread. The callbacks run on the control thread.
#ifndef MORPH_RUNTIME_AGENT_AGENT_H_
#define MORPH_RUNTIME_AGENT_AGENT_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "morph/deadline.h"
#include "morph/status.h"
#include "base/logging.h"
#include "runtime/agent/agent_core.h"
#include "runtime/agent/control_client.h"
#include "runtime/protocol/wire.h"

namespace morph {

struct AgentOptions {
  int64_t heartbeat_ms = 1000;
  // Heartbeats unacknowledged this long mean the coordinator's host went silent: the
  // connection counts as lost (ControlClient::SetUnackedTimeout). 0: TCP's own limit.
  int64_t coordinator_timeout_ms = 0;
  // Called on the control thread when a prepare names this worker as a participant (old rank
  // or joiner): the runtime starts building the new generation beside the running one, and
  // calls `ready` (any thread, once) when that is done, or failed. Only then does the agent
  // answer the prepare with its step report, so that training goes on while the new world is
  // built and the switch step's stall is the state transfer alone. Null: answer at once.
  std::function<void(const PrepareMsg&, std::function<void()> ready)> on_prepare;
  // Called on the control thread for an abandon: drop what was built for that generation.
  std::function<void(int64_t generation)> on_abandon;
  // Called on the control thread for the coordinator's Abort of the current generation (a
  // member was lost): the runtime aborts its collectives and any switch in flight.
  std::function<void(const AbortMsg&)> on_abort;
  // Called on the control thread once when the coordinator connection is lost (or it sent an
  // error): the runtime aborts its collectives so that no worker trains on alone.
  std::function<void(const Status& why)> on_connection_lost;
  // Polled on the control thread every few tens of milliseconds: true (once) when this worker
  // was asked to leave from outside (SIGTERM, the preemption notice): the leave request goes out
  // then, not at the training thread's next step boundary, so that the change away from this
  // worker is prepared while its step runs.
  std::function<bool()> leave_requested;
  // Coordinator failover: when the connection drops (not closed by an ErrorMsg, nor after Done),
  // the control thread calls `reconnect` until it returns a registered client or
  // reconnect_timeout_ms passes, while the training thread trains on (the connection counts as
  // lost only then). It looks up the leader and connects as this worker, saying where it stands
  // (`state`); then the agent sends what the dead leader may not have had
  // (AgentCore::Outstanding) and calls on_reconnected with the new Welcome (the store moved).
  // Sends that fail meanwhile are not errors: the rejoin carries them. Null: no failover.
  std::function<StatusOr<std::unique_ptr<ControlClient>>(WorkerId me, const ResumeState& state,
                                                         Deadline deadline)>
      reconnect;
  int64_t reconnect_timeout_ms = 10000;
  std::function<void(const WelcomeMsg&)> on_reconnected;
  // Polled on the control thread with leave_requested: true when another coordinator leads now
  // (the leader key names it) while this worker's connection still stands (a frozen leader's
  // sockets stay open): the agent drops the connection and reconnects.
  std::function<bool()> leader_moved;
  // After a failed reconnect attempt: true when it failed because the control plane itself
  // (etcd) could not be reached. Such attempts do not count against reconnect_timeout_ms: the
  // control plane being away pauses changes, not training (the worker keeps training in its
  // generation and rejoins when a leader is back).
  std::function<bool()> control_plane_down;
};

class Agent {
 public:
  // Connects and registers (ControlClient::Connect's errors). The control thread starts with
  // StartThread, so that the callbacks may use whatever the caller sets up with the returned
  // agent first (messages that arrive meanwhile wait in the socket).
  static StatusOr<std::unique_ptr<Agent>> Connect(const std::string& address,
                                                  const HelloMsg& hello, const RegisterMsg& reg,
                                                  AgentOptions options, Deadline deadline);
  ~Agent();  // Close()
  void StartThread();

  WorkerId id() const { return welcome_.worker; }
  // This worker's log lines: "[g4 r5/8 worker 12] ..." (generation, rank/world as committed).
  LogContext& log() { return log_; }
  const WelcomeMsg& welcome() const { return welcome_; }

  // The training thread is about to begin `step`.
  void NoteBegin(int64_t step) { begun_.store(step, std::memory_order_seq_cst); }
  // Something the training thread must look at (a prepare, a commit, a release, a lost
  // connection). One sequentially consistent load.
  bool pending() const { return pending_.load(std::memory_order_seq_cst); }

  struct Decision {
    AgentCore::Action action = AgentCore::Action::kProceed;
    std::optional<CommitMsg> commit;  // kSwitch: the change to apply now
  };
  // Blocks until the core lets `step` proceed, tells it to switch or that it is finished.
  // kUnavailable when the coordinator connection is gone (its reason), kDeadlineExceeded.
  StatusOr<Decision> Decide(int64_t step, Deadline deadline);
  // The training thread's step failed (Runtime::AbortStep) or its switch did: no step of the
  // current generation begins any more (AgentCore::OnStepFailed).
  void NoteStepFailed();
  // The training thread's half of a recovery's step report (Decide said kReport): `state`'s
  // state fields (the step its state holds and whether it is whole, its snapshots, undo copy
  // and commit vote; AgentCore::OnRecoveryState).
  Status ReportState(StepReportMsg state);
  // Reports the switch's result (sends Applied). After ok the core is in the new generation.
  Status SwitchDone(bool ok, const std::string& error = "", AppliedMsg::Phases phases = {});
  // After a failed switch: waits for the coordinator's outcome (true: applied elsewhere).
  StatusOr<bool> AwaitOutcome(Deadline deadline);

  // The committed generation this worker is in (a copy; id 0 before the first).
  Generation generation() const;
  bool finished() const;
  bool released() const;  // AgentCore::released()

  // Sends Leave (once). Any thread.
  void RequestLeave(const std::string& reason);
  // Sends Done: this worker's training ended normally. Any thread. With failover a Done the
  // coordinator has not acknowledged is said again to a successor (the rejoin carries it).
  Status SendDone();
  // After SendDone: waits until a coordinator acknowledged the Done (it recorded it; with
  // failover, persisted). False after `deadline`, or once the control thread ended (the
  // connection closed for good, no successor found). Any thread.
  bool WaitDoneAck(Deadline deadline);
  // Sends a FailureReport (Runtime::AbortStep). Any thread. kUnavailable ("connection to the
  // coordinator lost: ...") when the coordinator is gone.
  Status SendFailure(const FailureReportMsg& report);
  // Closes the connection and joins the control thread. Idempotent.
  void Close();

 private:
  Agent(std::unique_ptr<ControlClient> client, AgentOptions options);
  void Run();  // the control thread
  void Handle(WireMessage m);
  // Answers `p` with the step report (the prepare's work is done).
  void ReportPrepared(const PrepareMsg& p);
  void UpdatePendingLocked();
  int64_t core_generation_id();
  void ConnectionLost();  // calls on_connection_lost once, outside mu_
  // The coordinator closed the connection ending the job as asked (JobStopped: its ErrorMsg
  // was CANCELLED): marks the core finished and connection_ CANCELLED, and says so. mu_ held.
  bool JobStoppedLocked();
  // The connection dropped for `why`: reconnects to a successor (AgentOptions::reconnect).
  // False when there is none to try or it could not be reached in time.
  bool Reconnect(const Status& why);
  std::shared_ptr<ControlClient> Client() const;
  // A send on the control channel; with failover a failed one is left to the rejoin.
  Status SendOrDefer(const WireMessage& m);

  mutable std::mutex client_mu_;
  std::shared_ptr<ControlClient> client_;  // client_mu_ (replaced on reconnect)
  AgentOptions options_;
  WelcomeMsg welcome_;
  LogContext log_;
  std::atomic<int64_t> begun_{-1};
  std::atomic<bool> pending_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> leave_sent_{false};
  std::string leave_reason_;  // under mu_, with leave_sent_'s change
  std::atomic<bool> lost_reported_{false};
  // SendDone went out: this worker finished; the coordinator closing the connection afterwards
  // (the job ended, a hosting process stopped it) is expected, not a loss to act on.
  std::atomic<bool> done_sent_{false};
  bool done_acked_ = false;  // mu_: a coordinator acknowledged the Done
  bool run_ended_ = false;   // mu_: the control thread returned

  mutable std::mutex mu_;
  std::condition_variable cv_;
  AgentCore core_;
  Status connection_;  // not OK once the connection is gone
  std::optional<bool> outcome_;  // after a failed switch
  std::thread thread_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_AGENT_AGENT_H_
