#include "runtime/agent/agent.h"

#include <glog/logging.h>

#include <chrono>
#include <thread>
#include <utility>
#include <variant>

namespace morph {

StatusOr<std::unique_ptr<Agent>> Agent::Connect(const std::string& address,
                                                const HelloMsg& hello, const RegisterMsg& reg,
                                                AgentOptions options, Deadline deadline) {
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client,
                         ControlClient::Connect(address, hello, reg, deadline));
  if (options.coordinator_timeout_ms > 0) {
    MORPH_RETURN_IF_ERROR(client->SetUnackedTimeout(
        std::chrono::milliseconds(options.coordinator_timeout_ms)));
  }
  return std::unique_ptr<Agent>(new Agent(std::move(client), std::move(options)));
}

void Agent::StartThread() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

Agent::Agent(std::unique_ptr<ControlClient> client, AgentOptions options)
    : client_(std::shared_ptr<ControlClient>(std::move(client))),
      options_(std::move(options)),
      welcome_(client_->welcome()),
      log_("worker " + std::to_string(welcome_.worker)),
      core_(welcome_.worker) {
  std::lock_guard<std::mutex> l(mu_);
  UpdatePendingLocked();  // no generation yet: BeginStep must ask
}

Agent::~Agent() { Close(); }

std::shared_ptr<ControlClient> Agent::Client() const {
  std::lock_guard<std::mutex> l(client_mu_);
  return client_;
}

Status Agent::SendOrDefer(const WireMessage& m) {
  Status s = Client()->Send(m);
  if (!s.ok() && options_.reconnect && !stop_.load()) {
    MORPH_VLOG(1, log_) << "not sent (the rejoin carries it): " << s;
    return Status();
  }
  return s;
}

int64_t Agent::core_generation_id() {
  std::lock_guard<std::mutex> l(mu_);
  return core_.generation().id;
}

bool Agent::Reconnect(const Status& why) {
  if (!options_.reconnect || stop_.load()) return false;
  if (Client()->last_error()) return false;  // the coordinator ended this worker on purpose
  {
    std::lock_guard<std::mutex> l(mu_);
    // A Done not acknowledged may have died with the leader: a successor must hear it, or it
    // would count this worker lost. One acknowledged: the job ending closes the connection.
    const bool owed_ack = done_sent_.load() && !done_acked_;
    if (done_sent_.load() && !owed_ack) return false;
    if ((core_.finished() && !owed_ack) || !connection_.ok()) return false;
  }
  const auto t0 = std::chrono::steady_clock::now();
  MORPH_LOG(WARNING, log_) << "coordinator connection lost (" << why.message()
                           << "); reconnecting to the leader, training goes on";
  Deadline deadline = Deadline::AfterMs(options_.reconnect_timeout_ms);
  Status last = why;
  bool outage_logged = false;
  while (!stop_.load() && !deadline.Expired()) {
    ResumeState state;
    std::optional<std::variant<StepReportMsg, AppliedMsg>> outstanding;
    {
      std::lock_guard<std::mutex> l(mu_);
      state = ResumeState{.generation = core_.generation().id,
                          .step = begun_.load() + 1,
                          .awaiting_outcome = core_.awaiting_outcome(),
                          .prepared = core_.prepared(),
                          .done = done_sent_.load(),
                          .leaving = leave_sent_.load()};
    }
    StatusOr<std::unique_ptr<ControlClient>> c = options_.reconnect(id(), state, deadline);
    if (c.ok()) {
      if (options_.coordinator_timeout_ms > 0) {
        (void)(*c)->SetUnackedTimeout(std::chrono::milliseconds(options_.coordinator_timeout_ms));
      }
      WelcomeMsg welcome = (*c)->welcome();
      std::string address = (*c)->address();
      {
        std::lock_guard<std::mutex> l(client_mu_);
        client_ = std::shared_ptr<ControlClient>(std::move(*c));
      }
      std::vector<WireMessage> since;
      {
        std::lock_guard<std::mutex> l(mu_);
        outstanding = core_.Outstanding();
        // The rejoin says where this worker stood when the attempt began; the training thread
        // went on meanwhile. A switch it completed since sent its Applied to the dead
        // connection (a successor that believes it is still in the old generation would wait
        // for that Applied for ever), and a Done it sent since went the same way.
        if (core_.generation().id != state.generation) {
          since.push_back(
              AppliedMsg{.worker = id(), .generation = core_.generation().id, .ok = true});
        }
        if (done_sent_.load() && !state.done) since.push_back(DoneMsg{});
        // So did a leave asked for meanwhile (SIGTERM reaching the training thread's step
        // boundary while this thread reconnected): without it the worker never left.
        if (leave_sent_.load() && !state.leaving) since.push_back(LeaveMsg{.reason = leave_reason_});
      }
      if (outstanding) {
        std::visit([&](auto& m) { (void)Client()->Send(m); }, *outstanding);
      }
      for (const WireMessage& m : since) (void)Client()->Send(m);
      MORPH_LOG(INFO, log_) << "reconnected to the coordinator at " << address << " in "
                            << std::chrono::duration<double, std::milli>(
                                   std::chrono::steady_clock::now() - t0)
                                   .count()
                            << " ms";
      if (options_.on_reconnected) options_.on_reconnected(welcome);
      return true;
    }
    last = c.status();
    MORPH_VLOG(1, log_) << "reconnect: " << last;
    if (options_.control_plane_down && options_.control_plane_down()) {
      if (!outage_logged) {
        outage_logged = true;
        MORPH_LOG(WARNING, log_) << "the control plane is unreachable (" << last.message()
                                 << "): training goes on in generation "
                                 << core_generation_id() << " until a leader is back";
      }
      deadline = Deadline::AfterMs(options_.reconnect_timeout_ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  MORPH_LOG(WARNING, log_) << "no coordinator to reconnect to within "
                           << options_.reconnect_timeout_ms << " ms: " << last;
  return false;
}

void Agent::Close() {
  stop_.store(true);
  Client()->Close();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Agent::UpdatePendingLocked() {
  bool p = !connection_.ok() || core_.finished() || core_.pending_commit().has_value() ||
           core_.gate() != AgentCore::kNoGate || core_.rank() < 0 || core_.generation_failed();
  pending_.store(p, std::memory_order_seq_cst);
}

void Agent::Run() {
  struct Ended {  // WaitDoneAck stops waiting once nothing can acknowledge any more
    Agent& a;
    ~Ended() {
      std::lock_guard<std::mutex> l(a.mu_);
      a.run_ended_ = true;
      a.cv_.notify_all();
    }
  } ended{*this};
  auto next_beat = std::chrono::steady_clock::now();
  const auto beat = std::chrono::milliseconds(options_.heartbeat_ms);
  while (!stop_.load()) {
    auto now = std::chrono::steady_clock::now();
    if (now >= next_beat) {
      Status s = Client()->Send(HeartbeatMsg{.step = begun_.load()});
      if (!s.ok() && !stop_.load() && Reconnect(s)) continue;
      if (!s.ok() && !stop_.load()) {
        // The coordinator's closing word may be unread: read what is there before judging.
        (void)Client()->Receive(Deadline::AfterMs(0));
        bool stopped;
        {
          std::lock_guard<std::mutex> l(mu_);
          stopped = JobStoppedLocked();
          if (!stopped) connection_ = s;
          UpdatePendingLocked();
          cv_.notify_all();
        }
        if (!stopped) ConnectionLost();
        return;
      }
      next_beat = now + beat;
    }
    // Short waits so that a leave request from a signal handler goes out promptly.
    if (options_.leave_requested && options_.leave_requested()) {
      RequestLeave("SIGTERM (preemption notice)");
    }
    if (options_.leader_moved && options_.leader_moved()) {
      // A successor leads while this connection stands (its leader frozen): follow it.
      MORPH_LOG(WARNING, log_) << "another coordinator leads the job now: leaving this one";
      Client()->Close();
    }
    Deadline d(std::min(next_beat, now + std::chrono::milliseconds(50)));
    StatusOr<WireMessage> m = Client()->Receive(d);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kDeadlineExceeded) continue;
      if (stop_.load()) return;
      if (Reconnect(m.status())) continue;
      bool lost = false;
      {
        std::lock_guard<std::mutex> l(mu_);
        if (JobStoppedLocked()) {
          // Ended as asked: BeginStep returns done(), nothing is lost.
        } else if (!core_.finished()) {
          if (connection_.ok()) {
            connection_ = UnavailableError("connection to the coordinator lost: " +
                                           std::string(m.status().message()));
          }
          if (done_sent_.load()) {
            // This worker said it is done; the job ending closes the connection.
            MORPH_VLOG(1, log_) << "connection closed after done: "
                    << m.status().message();
          } else {
            MORPH_LOG(WARNING, log_) << "" << connection_.message();
            lost = true;
          }
        }
        UpdatePendingLocked();
        cv_.notify_all();
      }
      if (lost) ConnectionLost();
      return;
    }
    Handle(std::move(*m));
  }
}

bool Agent::JobStoppedLocked() {
  // The control client keeps the coordinator's last word (an ErrorMsg closes the connection,
  // control_client.h): CANCELLED is JobStopped, every worker asked to leave and this one too.
  const std::optional<ErrorMsg>& e = Client()->last_error();
  if (!e || static_cast<StatusCode>(e->code) != StatusCode::kCancelled) return false;
  if (!core_.finished()) {
    MORPH_LOG(INFO, log_) << "the coordinator ended the job as asked: " << e->message;
  }
  connection_ = Status(StatusCode::kCancelled, "coordinator: " + e->message);
  core_.OnJobStopped();
  return true;
}

void Agent::ConnectionLost() {
  if (lost_reported_.exchange(true) || !options_.on_connection_lost) return;
  Status why;
  {
    std::lock_guard<std::mutex> l(mu_);
    why = connection_;
  }
  options_.on_connection_lost(why);
}

void Agent::Handle(WireMessage m) {
  std::optional<StepReportMsg> report;
  std::optional<PrepareMsg> prepared;
  std::optional<int64_t> abandoned;
  std::optional<AbortMsg> aborted;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (auto* p = std::get_if<PrepareMsg>(&m)) {
      const auto& parts = p->change.participants;
      bool mine = std::find(parts.begin(), parts.end(), id()) != parts.end() &&
                  p->next.id > core_.generation().id;
      if (mine && options_.on_prepare) {
        // A recovery stops the training thread at its next boundary at once.
        if (p->change.recovery) core_.OnRecoveryPrepare(*p);
        prepared = *p;  // reported once the new world is built (ReportPrepared)
      } else {
        // Dekker with NoteBegin: raise the flag, then read the step (see agent.h).
        pending_.store(true, std::memory_order_seq_cst);
        report = core_.OnPrepare(*p, begun_.load(std::memory_order_seq_cst) + 1);
      }
    } else if (auto* c = std::get_if<CommitMsg>(&m)) {
      core_.OnCommit(*c);
    } else if (auto* a = std::get_if<AbandonMsg>(&m)) {
      core_.OnAbandon(*a);
      abandoned = a->generation;
    } else if (auto* o = std::get_if<OutcomeMsg>(&m)) {
      bool waiting = core_.pending_commit().has_value();
      core_.OnOutcome(*o);
      if (waiting && !core_.pending_commit()) outcome_ = o->applied;
    } else if (auto* r = std::get_if<ReleaseMsg>(&m)) {
      core_.OnRelease(*r);
    } else if (auto* ab = std::get_if<AbortMsg>(&m)) {
      core_.OnAbort(*ab);
      aborted = *ab;
    } else if (std::holds_alternative<DoneMsg>(m)) {
      done_acked_ = true;  // the coordinator recorded this worker's Done (WaitDoneAck)
    } else if (auto* e = std::get_if<ErrorMsg>(&m)) {
      connection_ = Status(static_cast<StatusCode>(e->code), "coordinator: " + e->message);
      // Every worker was asked to leave (JobStopped): this one leaves as asked.
      if (connection_.code() == StatusCode::kCancelled) core_.OnJobStopped();
    } else {
      MORPH_LOG(WARNING, log_) << "unexpected message type " << m.index() + 1
                   << " from the coordinator; ignored";
    }
    UpdatePendingLocked();
    cv_.notify_all();
  }
  if (report) {
    Status s = SendOrDefer(*report);
    if (!s.ok()) MORPH_LOG(WARNING, log_) << "step report not sent: " << s;
  }
  if (prepared) {
    PrepareMsg p = *prepared;
    options_.on_prepare(p, [this, p] { ReportPrepared(p); });
  }
  if (abandoned && options_.on_abandon) options_.on_abandon(*abandoned);
  if (aborted && options_.on_abort) options_.on_abort(*aborted);
}

void Agent::ReportPrepared(const PrepareMsg& p) {
  std::optional<StepReportMsg> report;
  {
    std::lock_guard<std::mutex> l(mu_);
    // Dekker with NoteBegin: raise the flag, then read the step (see agent.h).
    pending_.store(true, std::memory_order_seq_cst);
    report = p.change.recovery
                 ? core_.OnRecoveryBuilt(p.next.id)
                 : core_.OnPrepare(p, begun_.load(std::memory_order_seq_cst) + 1);
    UpdatePendingLocked();
    cv_.notify_all();
  }
  if (report) {
    Status s = SendOrDefer(*report);
    if (!s.ok()) MORPH_LOG(WARNING, log_) << "step report not sent: " << s;
  }
}

void Agent::NoteStepFailed() {
  std::lock_guard<std::mutex> l(mu_);
  core_.OnStepFailed();
  UpdatePendingLocked();
}

StatusOr<Agent::Decision> Agent::Decide(int64_t step, Deadline deadline) {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    AgentCore::Action a = core_.AtStep(step);
    if (a == AgentCore::Action::kFinished) return Decision{.action = a};
    if (a == AgentCore::Action::kSwitch || a == AgentCore::Action::kCannotSwitch) {
      return Decision{.action = a, .commit = *core_.pending_commit()};
    }
    if (!connection_.ok()) return connection_;
    if (a != AgentCore::Action::kWait) return Decision{.action = a};
    if (cv_.wait_until(l, deadline.when()) == std::cv_status::timeout &&
        core_.AtStep(step) == AgentCore::Action::kWait && connection_.ok()) {
      return DeadlineExceededError("step " + std::to_string(step) +
                                   ": no decision from the coordinator in time (worker " +
                                   std::to_string(id()) + ", generation " +
                                   std::to_string(core_.generation().id) + ")");
    }
  }
}

Status Agent::ReportState(StepReportMsg state) {
  std::optional<StepReportMsg> report;
  {
    std::lock_guard<std::mutex> l(mu_);
    report = core_.OnRecoveryState(std::move(state));
    UpdatePendingLocked();
    cv_.notify_all();
  }
  if (!report) return Status();
  return SendOrDefer(*report);
}

Status Agent::SwitchDone(bool ok, const std::string& error, AppliedMsg::Phases phases) {
  AppliedMsg applied;
  {
    std::lock_guard<std::mutex> l(mu_);
    outcome_.reset();
    applied = core_.SwitchDone(ok, error);
    applied.phases = phases;
    if (ok) {
      const Generation& g = core_.generation();
      log_.Set(g.id, g.RankOf(id()), g.config.world());
    }
    UpdatePendingLocked();
  }
  return SendOrDefer(applied);
}

StatusOr<bool> Agent::AwaitOutcome(Deadline deadline) {
  std::unique_lock<std::mutex> l(mu_);
  if (!cv_.wait_until(l, deadline.when(), [&] { return outcome_.has_value() || !connection_.ok(); })) {
    return DeadlineExceededError("no outcome from the coordinator in time");
  }
  if (outcome_) return *outcome_;
  return connection_;
}

Generation Agent::generation() const {
  std::lock_guard<std::mutex> l(mu_);
  return core_.generation();
}

bool Agent::finished() const {
  std::lock_guard<std::mutex> l(mu_);
  return core_.finished();
}

bool Agent::released() const {
  std::lock_guard<std::mutex> l(mu_);
  return core_.released();
}

void Agent::RequestLeave(const std::string& reason) {
  {
    std::lock_guard<std::mutex> l(mu_);  // a reconnect reads both at once
    if (leave_sent_.exchange(true)) return;
    leave_reason_ = reason;
  }
  Status s = SendOrDefer(LeaveMsg{.reason = reason});
  if (!s.ok()) MORPH_LOG(WARNING, log_) << "leave request not sent: " << s;
}

Status Agent::SendDone() {
  done_sent_.store(true);
  return Client()->Send(DoneMsg{});
}

bool Agent::WaitDoneAck(Deadline deadline) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait_until(l, deadline.when(), [&] { return done_acked_ || run_ended_; });
  return done_acked_;
}

Status Agent::SendFailure(const FailureReportMsg& report) {
  // A failure report right after the coordinator died (its death aborted the step) says so,
  // as BeginStep would, rather than what the socket said. After the job stopped as asked (the
  // step failed because the others left) there is nothing to report: BeginStep returns done().
  {
    std::lock_guard<std::mutex> l(mu_);
    if (core_.finished() && connection_.code() == StatusCode::kCancelled) return Status();
    if (!connection_.ok()) return connection_;
  }
  Status s = SendOrDefer(report);
  if (s.code() == StatusCode::kUnavailable) {
    // The control thread may not have read the coordinator's closing word yet (it reads every
    // 50 ms): give it a moment to say whether the job stopped as asked.
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, std::chrono::seconds(1), [&] { return !connection_.ok(); });
    if (core_.finished() && connection_.code() == StatusCode::kCancelled) return Status();
    return UnavailableError("connection to the coordinator lost: " + std::string(s.message()));
  }
  return s;
}

}  // namespace morph
