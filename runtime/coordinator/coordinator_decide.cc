// Coordinator::Impl, the decider's side (coordinator_impl.h): events fed to the Decider and the
// actions it returns, the tick, the same-host process watch, the snapshot it publishes, the end.
#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <filesystem>
#include <future>
#include <limits>

#include "base/logging.h"
#include "runtime/coordinator/coordinator_impl.h"
#include "runtime/plan/plan_input.h"
#include "runtime/recovery/checkpoint_catalog.h"

namespace morph {
namespace coordinator_internal {

ResumeFinder FolderResumeFinder(std::string dir,
                                std::shared_ptr<std::optional<RecoveryCheckpoint>> resumed) {
  return [dir = std::move(dir), resumed = std::move(resumed)](
             const JobManifest& m) -> StatusOr<std::optional<RecoveryCheckpoint>> {
    const LogContext log("coordinator");  // before the first generation
    auto matches = [&m](const CheckpointReader& reader, const std::string& path) {
      return CheckCheckpointMatches(reader, path, m.tensors, m.scalars);
    };
    std::vector<SkippedCheckpoint> skipped;
    StatusOr<CheckpointRef> c = NewestIntactCheckpoint(dir, matches, &skipped);
    for (const SkippedCheckpoint& s : skipped) {
      MORPH_LOG(WARNING, log) << "resume passes over checkpoint " << s.ref.path << " (step "
                   << s.ref.step << "): " << s.why;
    }
    if (c.status().code() == StatusCode::kNotFound) return std::optional<RecoveryCheckpoint>();
    if (!c.ok()) return c.status();
    if (!skipped.empty()) {
      const int64_t lost = std::max<int64_t>(0, skipped.front().ref.step - c->step);
      MORPH_LOG(WARNING, log) << "resuming from checkpoint " << c->path << " at step " << c->step
                   << " instead of the newest complete one, " << skipped.front().ref.path
                   << ", which is damaged: " << lost << " steps"
                   << (lost > 0 ? " (" + std::to_string(c->step) + ".." +
                                      std::to_string(c->step + lost - 1) + ")"
                                : std::string())
                   << " are lost and trained again";
    }
    *resumed = RecoveryCheckpoint{
        .step = c->step,
        .path = c->path,
        .skipped_step = skipped.empty() ? -1 : skipped.front().ref.step};
    return *resumed;
  };
}

ResumeFinder CallbackResumeFinder(std::function<std::optional<RecoveryCheckpoint>()> latest) {
  if (!latest) return nullptr;
  return [latest = std::move(latest)](
             const JobManifest& m) -> StatusOr<std::optional<RecoveryCheckpoint>> {
    std::optional<RecoveryCheckpoint> c = latest();
    if (!c) return c;
    MORPH_ASSIGN_OR_RETURN(CheckpointReader reader, CheckpointReader::Open(c->path),
                           "resuming from checkpoint " << c->path);
    if (reader.step() != c->step) {
      return FailedPreconditionError("resuming from checkpoint " + c->path + ": it holds step " +
                                     std::to_string(reader.step()) + ", not " +
                                     std::to_string(c->step));
    }
    MORPH_RETURN_IF_ERROR(CheckCheckpointMatches(reader, c->path, m.tensors, m.scalars));
    MORPH_RETURN_IF_ERROR(reader.Verify()) << "resuming from checkpoint " << c->path;
    return c;
  };
}

DeciderEvent::ResumeReady ResumeCheckpoint(int64_t generation,
                                           const std::shared_ptr<const JobManifest>& manifest,
                                           const ResumeFinder& find) {
  DeciderEvent::ResumeReady out{.generation = generation};
  if (!manifest) {
    out.status = FailedPreconditionError("no manifest registered");
    return out;
  }
  if (!find) return out;
  StatusOr<std::optional<RecoveryCheckpoint>> c = find(*manifest);
  if (c.ok()) {
    out.checkpoint = *std::move(c);
  } else {
    out.status = c.status().WithContext("resuming the job");
  }
  return out;
}

}  // namespace coordinator_internal

template <typename M>
void Coordinator::Impl::SendTo(const std::vector<WorkerId>& to, const M& msg, bool commit) {
  auto frame = std::make_shared<const std::string>(EncodeFrame(msg));
  for (WorkerId w : to) {
    auto it = conns_.find(w);
    if (it != conns_.end()) Enqueue(it->second, frame, commit);
  }
}

void Coordinator::Impl::Feed(DeciderEvent::Any event) {
  // An action can end a connection (a failed or overfull write) and so produce an event while
  // the previous event's actions run: it waits until they all ran, so sends keep their order.
  events_.push_back(std::move(event));
  if (feeding_) return;
  feeding_ = true;
  while (!events_.empty()) {
    DeciderEvent::Any e = std::move(events_.front());
    events_.pop_front();
    bool heartbeat = std::holds_alternative<DeciderEvent::Heartbeat>(e) ||
                     std::holds_alternative<DeciderEvent::Tick>(e);
    if (!leading_) continue;  // a follower decides nothing (a planner's late answer, say)
    std::vector<DeciderAction::Any> actions = decider_.Handle(NowMs(), std::move(e));
    // Coordinator failover: the decision is durable before anything of it is carried out.
    if (ha() && !(heartbeat && actions.empty()) && !Persist()) break;
    FollowGeneration();
    for (DeciderAction::Any& a : actions) Execute(a);
    if (!heartbeat || !actions.empty()) MarkDirty();
  }
  feeding_ = false;
}

void Coordinator::Impl::Execute(DeciderAction::Any& action) {
  std::visit(
      [&](auto& a) {
        using A = std::decay_t<decltype(a)>;
        if constexpr (std::is_same_v<A, DeciderAction::ComputePlan>) {
          PlanRequest req = a.request;
          timing_ = ChangeTiming{.from_generation = req.from.id,
                                 .from_world = static_cast<int>(req.from.ranks.size()),
                                 .planned = Clock::now()};
          MORPH_LOG(INFO, log_) << "planning generation " << req.generation << " from "
                    << req.from.id << ": " << req.candidates.size() << " candidates, target world "
                    << req.target_world << ", lost " << Ids(req.lost);
          std::shared_ptr<const JobManifest> manifest = manifest_;
          ConfigPolicy policy = options_.policy;
          std::weak_ptr<Impl> weak = weak_from_this();
          asio::post(planner_, [weak, manifest, policy, req = std::move(req)] {
            auto start = Clock::now();
            StatusOr<PlannedChange> plan =
                manifest
                    ? PlanChange(*manifest, policy, req)
                    : StatusOr<PlannedChange>(FailedPreconditionError("no manifest registered"));
            double ms = Ms(Clock::now() - start);
            auto strong = weak.lock();
            if (!strong) return;
            // The io-thread handler holds no strong reference: one left queued at Stop must not
            // keep the coordinator alive.
            asio::post(strong->io_, [weak, gen = req.generation, ms, plan = std::move(plan)] {
              auto self = weak.lock();
              if (!self || self->stopping_) return;
              if (self->timing_) self->timing_->plan_ms = ms;
              self->Feed(DeciderEvent::PlanReady{.generation = gen, .plan = std::move(plan)});
            });
          });
        } else if constexpr (std::is_same_v<A, DeciderAction::ChooseRecovery>) {
          MORPH_LOG(INFO, log_) << "recovery into generation " << a.generation << ": "
                    << a.reports.size() << " survivors reported their state";
          std::shared_ptr<const JobManifest> manifest = manifest_;
          std::function<std::optional<RecoveryCheckpoint>()> latest = options_.latest_checkpoint;
          std::weak_ptr<Impl> weak = weak_from_this();
          asio::post(planner_, [weak, manifest, latest, a = std::move(a)] {
            auto start = Clock::now();
            StatusOr<RecoveryChoice> choice =
                manifest
                    ? ChooseRecovery(*manifest, a.from, a.next, a.change, a.reports,
                                     latest ? latest() : std::nullopt)
                    : StatusOr<RecoveryChoice>(FailedPreconditionError("no manifest registered"));
            double ms = Ms(Clock::now() - start);
            auto strong = weak.lock();
            if (!strong) return;
            asio::post(strong->io_, [weak, gen = a.generation, ms, choice = std::move(choice)] {
              auto self = weak.lock();
              if (!self || self->stopping_) return;
              if (self->timing_) self->timing_->plan_ms += ms;
              if (choice.ok()) {
                MORPH_LOG(INFO, self->log_) << "generation " << gen << " recovers "
                          << choice->explanation;
              }
              self->Feed(
                  DeciderEvent::RecoveryReady{.generation = gen, .choice = std::move(choice)});
            });
          });
        } else if constexpr (std::is_same_v<A, DeciderAction::FindResumeCheckpoint>) {
          MORPH_LOG(INFO, log_) << "generation " << a.generation
                    << " is the job's first: looking for a checkpoint to resume from (MORPH_RESUME="
                    << ResumeModeName(options_.resume.value_or(ResumeMode::kNever))
                    << ", SLURM_RESTART_COUNT=" << options_.restart_count << ")";
          std::shared_ptr<const JobManifest> manifest = manifest_;
          ResumeFinder find = resume_finder_;
          std::weak_ptr<Impl> weak = weak_from_this();
          asio::post(planner_, [weak, manifest, find, gen = a.generation] {
            auto start = Clock::now();
            DeciderEvent::ResumeReady found = ResumeCheckpoint(gen, manifest, find);
            double ms = Ms(Clock::now() - start);
            auto strong = weak.lock();
            if (!strong) return;
            asio::post(strong->io_, [weak, gen, ms, found = std::move(found)]() mutable {
              auto self = weak.lock();
              if (!self || self->stopping_) return;
              if (self->timing_) self->timing_->plan_ms += ms;
              if (!found.status.ok()) {
                MORPH_LOG(ERROR, self->log_) << "generation " << gen
                           << " cannot resume: " << found.status;
              } else if (found.checkpoint) {
                MORPH_LOG(INFO, self->log_) << "generation " << gen << " resumes from checkpoint "
                          << std::filesystem::path(found.checkpoint->path).filename().string()
                          << " at step " << found.checkpoint->step << " (" << found.checkpoint->path
                          << ")";
              } else if (self->options_.restart_count > 0) {
                MORPH_LOG(WARNING, self->log_) << "a restart (SLURM_RESTART_COUNT="
                             << self->options_.restart_count
                             << ") but no complete checkpoint to resume from in '"
                             << self->options_.checkpoint_dir << "': the job starts afresh";
              } else {
                MORPH_LOG(INFO, self->log_) << "no complete checkpoint to resume from: a fresh start";
              }
              self->Feed(std::move(found));
            });
          });
        } else if constexpr (std::is_same_v<A, DeciderAction::SendPrepare>) {
          if (timing_) {
            timing_->prepared = Clock::now();
            timing_->has_prepare = true;
          }
          MORPH_LOG(INFO, log_) << "prepare generation " << a.msg.next.id << " ("
                    << a.msg.next.config.ToString() << ", " << a.msg.next.ranks.size()
                    << " ranks) to " << a.to.size() << " participants; leavers "
                    << Ids(a.msg.change.leavers) << ", exiting " << Ids(a.msg.change.exiting)
                    << "; " << decider_.last_explanation();
          SendTo(a.to, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendCommit>) {
          if (timing_) timing_->committed = Clock::now();
          MORPH_LOG(INFO, log_) << "commit generation " << a.msg.next.id << " at step "
                    << a.msg.next.start_step << " (" << a.msg.next.config.ToString() << ", digest "
                    << std::hex << a.msg.next.plan_digest << std::dec << ") to " << a.to.size()
                    << " participants";
          SendTo(a.to, a.msg, /*commit=*/true);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendAbort>) {
          MORPH_LOG(WARNING, log_) << "abort generation " << a.msg.generation << " on "
                       << a.to.size() << " workers: " << a.msg.reason;
          SendTo(a.to, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendAbandon>) {
          MORPH_LOG(INFO, log_) << "abandon generation " << a.msg.generation
                    << " (a participant was lost before the commit)";
          SendTo(a.to, a.msg);
          timing_.reset();
        } else if constexpr (std::is_same_v<A, DeciderAction::SendOutcome>) {
          MORPH_LOG(INFO, log_) << "generation " << a.msg.generation
                    << (a.msg.applied ? " applied" : " not applied (old generation stands)")
                    << " on " << a.to.size() << " participants";
          SendTo(a.to, a.msg);
          if (timing_ && a.msg.applied && timing_->from_generation != 0) {
            auto now = Clock::now();
            ReconfigurationRecord r;
            r.from_generation = timing_->from_generation;
            r.to_generation = a.msg.generation;
            r.from_world = timing_->from_world;
            r.to_world = decider_.current().config.world();
            r.plan_ms = timing_->plan_ms;
            r.agree_ms = timing_->has_prepare ? Ms(timing_->committed - timing_->prepared) : 0;
            r.total_ms = Ms(now - timing_->planned);
            // The workers' phases: the slowest participant's, per phase.
            const AppliedMsg::Phases& p = timing_->slowest;
            r.communicators_ms = static_cast<double>(p.communicators_us) / 1000;
            r.plan_ms += static_cast<double>(p.plan_us) / 1000;
            r.transfer_ms = static_cast<double>(p.transfer_us) / 1000;
            r.resume_ms = static_cast<double>(p.resume_us) / 1000;
            r.stall_ms = static_cast<double>(p.stall_us) / 1000;
            r.explanation = decider_.last_explanation();
            last_record_ = r;
            ++reconfigurations_;
          }
          timing_.reset();
        } else if constexpr (std::is_same_v<A, DeciderAction::SendRelease>) {
          MORPH_LOG(INFO, log_) << "release worker " << a.to;
          SendTo({a.to}, a.msg);
        } else if constexpr (std::is_same_v<A, DeciderAction::AckDone>) {
          SendTo({a.to}, DoneMsg{});  // its Done is recorded (and persisted, with failover)
        } else if constexpr (std::is_same_v<A, DeciderAction::AdvanceStore>) {
          store_->AdvanceGeneration(a.generation);
        } else if constexpr (std::is_same_v<A, DeciderAction::AnswerResize>) {
          MORPH_LOG(INFO, log_) << "resize request " << a.request_id << ": "
                    << (a.status.ok() ? std::string("accepted") : a.status.ToString());
          auto it = answers_.find(a.request_id);
          if (it != answers_.end()) {
            auto answer = std::move(it->second);
            answers_.erase(it);
            answer(a.status);
          }
        } else if constexpr (std::is_same_v<A, DeciderAction::LaunchWorkers>) {
          MORPH_LOG(INFO, log_) << "asking for " << a.count << " more worker(s)"
                    << (options_.launch_workers ? "" : " (no launcher: start them yourself)");
          if (options_.launch_workers) {
            asio::post(launcher_, [fn = options_.launch_workers, n = a.count] { fn(n); });
          }
        } else if constexpr (std::is_same_v<A, DeciderAction::Disconnect>) {
          MORPH_LOG(WARNING, log_) << "worker " << a.worker << " lost: " << a.reason;
          auto it = conns_.find(a.worker);
          if (it != conns_.end()) {
            std::shared_ptr<Conn> c = it->second;
            c->gone_reported = true;  // the decider declared it lost itself
            conns_.erase(it);
            connected_.fetch_sub(1);
            c->close_after_write = false;
            Enqueue(c, std::make_shared<const std::string>(EncodeFrame(
                           ErrorMsg{.code = static_cast<int32_t>(StatusCode::kUnavailable),
                                    .message = "declared lost: " + a.reason})));
            c->close_after_write = true;
            Gone(c, a.reason);
          }
        } else if constexpr (std::is_same_v<A, DeciderAction::JobFailed>) {
          MORPH_LOG(ERROR, log_) << "the job failed: " << a.status;
          EndEveryConnection(a.status.code(), "the job failed: " + std::string(a.status.message()));
          Finish(a.status);
        } else if constexpr (std::is_same_v<A, DeciderAction::JobStopped>) {
          MORPH_LOG(INFO, log_) << "" << a.status.message();
          EndEveryConnection(a.status.code(), std::string(a.status.message()));
          Finish(a.status);
        } else if constexpr (std::is_same_v<A, DeciderAction::JobComplete>) {
          MORPH_LOG(INFO, log_) << "the job completed in generation " << a.generation;
          Finish(Status::Ok());
        }
      },
      action);
}

int64_t Coordinator::Impl::SubmitResize(ResizeRequest request, std::function<void(Status)> answer,
                                        std::string_view via) {
  const int64_t id = next_request_id_++;
  request.request_id = id;
  if (!leading_) {
    const std::string etcd = election_ ? election_->etcd_error() : std::string();
    answer(UnavailableError(
        etcd.empty() ? std::string("this coordinator does not lead the job (coordinator "
                                   "failover): ask the leader")
                     : "no coordinator can lead the job while etcd is unreachable (" + etcd +
                           "): no change can be committed; training goes on"));
    return id;
  }
  answers_[id] = std::move(answer);
  MORPH_LOG(INFO, log_) << "resize request " << id << " from " << via;
  Feed(DeciderEvent::Resize{std::move(request)});
  return id;
}

void Coordinator::Impl::EndEveryConnection(StatusCode code, const std::string& message) {
  auto frame = std::make_shared<const std::string>(
      EncodeFrame(ErrorMsg{.code = static_cast<int32_t>(code), .message = message}));
  for (auto& [id, c] : conns_) {
    Enqueue(c, frame);
    c->close_after_write = true;
    if (!c->writing) CloseSocket(c);
  }
}

void Coordinator::Impl::Finish(Status s) {
  if (!ended_) ended_ = s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!result_) result_ = std::move(s);
  }
  cv_.notify_all();
}

void Coordinator::Impl::ArmTick() {
  if (options_.heartbeat_timeout_ms <= 0 && !ha()) return;
  // With failover the tick also ends a successor's wait for the workers to reconnect.
  int64_t period = options_.heartbeat_timeout_ms > 0 ? options_.heartbeat_timeout_ms : INT64_MAX;
  if (ha()) period = std::min(period, options_.rejoin_timeout_ms);
  period = std::clamp<int64_t>(period / 4, 5, 1000);
  tick_.expires_after(std::chrono::milliseconds(period));
  tick_.async_wait([this](error_code ec) {
    if (ec || stopping_) return;
    Feed(DeciderEvent::Tick{});
    ArmTick();
  });
}

void Coordinator::Impl::MaybeWatch(const std::shared_ptr<Conn>& c) {
  // Bounded: each proof reads /proc/net/tcp (every connection of the host) and the worker's
  // open files on the io thread; a host runs a few dozen workers at most.
  constexpr size_t kMaxWatched = 256;
  if (options_.local_watch_ms <= 0 || c->pid <= 0 || c->host != local_hostname_ ||
      local_hostname_.empty() || watched_ >= kMaxWatched) {
    return;
  }
  error_code e1, e2;
  tcp::endpoint ours = c->sock.local_endpoint(e1), theirs = c->sock.remote_endpoint(e2);
  if (e1 || e2) return;
  auto end = [](const tcp::endpoint& ep) {
    SocketEnd s;
    if (ep.address().is_v4()) {
      auto b = ep.address().to_v4().to_bytes();
      s.address.assign(reinterpret_cast<const char*>(b.data()), b.size());
    } else {
      auto b = ep.address().to_v6().to_bytes();
      s.address.assign(reinterpret_cast<const char*>(b.data()), b.size());
    }
    s.port = ep.port();
    return s;
  };
  c->watched = VerifyPeerProcess(static_cast<pid_t>(c->pid), end(ours), end(theirs));
  if (!c->watched) {
    MORPH_VLOG(1, log_) << "worker " << c->id << " says pid " << c->pid
            << " on this host, not proven to hold its connection: not watched";
    return;
  }
  ++watched_;
  MORPH_VLOG(1, log_) << "watching worker " << c->id << "'s process " << c->pid;
  ArmWatch();
}

void Coordinator::Impl::ArmWatch() {
  if (watch_armed_ || watched_ == 0 || stopping_) return;
  watch_armed_ = true;
  watch_timer_.expires_after(std::chrono::milliseconds(options_.local_watch_ms));
  watch_timer_.async_wait([this](error_code ec) {
    watch_armed_ = false;
    if (ec || stopping_) return;
    Watch();
    ArmWatch();
  });
}

void Coordinator::Impl::Watch() {
  std::map<pid_t, bool> gone;  // one look per process (several workers may share one)
  std::vector<std::shared_ptr<Conn>> lost;
  for (auto& [id, c] : conns_) {
    if (!c->watched) continue;
    auto [it, fresh] = gone.try_emplace(c->watched->pid, false);
    if (fresh) it->second = ProcessGone(*c->watched);
    if (!it->second) {
      c->exiting_ticks = 0;
      continue;
    }
    // Twice in a row, with nothing left to read: frames it sent before it began to exit (a
    // Done, a failure report) are handled first, as they would be before an end of file.
    error_code ec;
    const size_t unread = c->sock.available(ec);
    if (++c->exiting_ticks >= 2 && unread == 0 && c->body.empty()) lost.push_back(c);
  }
  for (const auto& c : lost) {
    MORPH_LOG(WARNING, log_) << "worker " << c->id << "'s process " << c->pid
                 << " is exiting while its connection is still open";
    Gone(c, "its process " + std::to_string(c->pid) + " exited");
  }
}

void Coordinator::Impl::FollowGeneration() {
  const Generation& g = decider_.current();
  if (g.id == step_generation_) return;
  step_generation_ = g.id;
  step_since_ms_ = NowMs();
  log_.Set(g.id, -1, static_cast<int>(g.ranks.size()));
  member_steps_.clear();
  for (WorkerId w : g.ranks) member_steps_[w] = std::numeric_limits<int64_t>::min();
}

void Coordinator::Impl::NoteStep(WorkerId worker, int64_t step) {
  FollowGeneration();
  auto it = member_steps_.find(worker);  // a standby worker's step says nothing
  if (it == member_steps_.end() || it->second == step) return;
  it->second = step;
  MarkDirty();  // the snapshot shows the step (morphctl watch, tests)
}

int64_t Coordinator::Impl::GenerationStep() const {
  const Generation& g = decider_.current();
  if (g.id != step_generation_ || member_steps_.empty()) return g.start_step;
  int64_t least = std::numeric_limits<int64_t>::max();
  for (const auto& [worker, step] : member_steps_) least = std::min(least, step);
  if (least <= g.start_step) return g.start_step;  // a member has not begun past the start
  const int64_t ms = std::max<int64_t>(0, NowMs() - step_since_ms_);
  int64_t most = 0;
  if (__builtin_mul_overflow(kMaxStepsPerMs, ms, &most) ||
      __builtin_add_overflow(most, g.start_step, &most)) {
    most = std::numeric_limits<int64_t>::max();
  }
  return std::min(least, most);
}

void Coordinator::Impl::MarkDirty() {
  if (publish_armed_) return;
  publish_armed_ = true;
  publish_timer_.expires_after(kPublishInterval);
  publish_timer_.async_wait([this](error_code ec) {
    publish_armed_ = false;
    if (ec || stopping_) return;
    Publish();
  });
}

CoordinatorSnapshot Coordinator::Impl::BuildSnapshot() const {
  CoordinatorSnapshot s = SnapshotOf(decider_);
  for (auto& m : s.members) {
    auto it = hosts_.find(m.worker);
    if (it != hosts_.end()) m.host = it->second;
  }
  s.step = GenerationStep();
  s.reconfigurations = reconfigurations_;
  s.last_reconfiguration = last_record_;
  return s;
}

void Coordinator::Impl::Publish() {
  CoordinatorSnapshot s = BuildSnapshot();
  std::lock_guard<std::mutex> lock(mu_);
  published_ = std::move(s);
}

}  // namespace morph
