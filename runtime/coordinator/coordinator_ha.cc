// Coordinator failover, the shell's half (coordinator.h "Coordinator failover"): the campaign,
// restoring the persisted state on winning, the fenced write after each decision, stepping down,
// and workers that reconnect as themselves.
#include <nlohmann/json.hpp>

#include <type_traits>

#include "base/sha256.h"

#include "runtime/coordinator/coordinator_impl.h"

namespace morph {

namespace {
using json = nlohmann::json;
std::string StateKey(const std::string& prefix) { return prefix + "/state"; }

// What names the job in its saved state without revealing its token.
std::string TokenDigest(const std::string& token) {
  return Sha256Hex(std::string("morph-job") + '\0' + token);
}
}  // namespace

json Coordinator::Impl::JobRecord() const {
  return json{{"token_sha256", TokenDigest(options_.token)},
              {"initial_world", options_.initial_world},
              {"max_world", options_.max_world},
              {"heartbeat_timeout_ms", options_.heartbeat_timeout_ms},
              {"rejoin_timeout_ms", options_.rejoin_timeout_ms}};
}

Status Coordinator::Impl::AdoptJobRecord(const json& job) {
  if (!job.is_object()) return Status::Ok();  // saved before the record existed
  const std::string theirs = job.value("token_sha256", std::string());
  const std::string mine = TokenDigest(options_.token);
  if (!theirs.empty() && theirs != mine) {
    return FailedPreconditionError(
        "the state under " + options_.etcd_prefix + " belongs to another job (its token's digest " +
        theirs.substr(0, 12) + "..., this candidate's " + mine.substr(0, 12) +
        "...): this candidate does not lead it; give it the job's token, or another prefix");
  }
  // The job's settings are the job's, whichever candidate leads it.
  auto adopt = [&](const char* key, auto& field) {
    using T = std::decay_t<decltype(field)>;
    if (!job.contains(key) || !job[key].is_number_integer()) return;
    const T value = job[key].get<T>();
    if (value != field) {
      MORPH_LOG(WARNING, log_) << "the job's " << key << " is " << value << " (this candidate was "
                               << "given " << field << "): the job's holds";
      field = value;
    }
  };
  adopt("initial_world", options_.initial_world);
  adopt("max_world", options_.max_world);
  adopt("heartbeat_timeout_ms", options_.heartbeat_timeout_ms);
  adopt("rejoin_timeout_ms", options_.rejoin_timeout_ms);
  return Status::Ok();
}

DeciderOptions Coordinator::Impl::MakeDeciderOptions() const {
  return DeciderOptions{
      .initial_world = options_.initial_world,
      .max_world = options_.max_world,
      .heartbeat_timeout_ms = options_.heartbeat_timeout_ms,
      .resume = options_.ResumeEnabled() && static_cast<bool>(resume_finder_),
      .first_generation = options_.first_generation,
      .rejoin_timeout_ms = options_.rejoin_timeout_ms};
}

Status Coordinator::Impl::StartCampaign() {
  leading_ = false;
  leading_flag_ = false;
  // What followers and workers need to reach this candidate once it leads.
  const std::string where = CoordinatorAddresses(
      JoinHostPort(advertise_host_, port_), JoinHostPort(advertise_host_, store_->port()),
      http_port_);
  std::weak_ptr<Impl> weak = weak_from_this();
  Election::Callbacks cb{
      .elected =
          [weak](const EtcdFence& fence) {
            if (auto self = weak.lock()) {
              asio::post(self->io_, [weak, fence] {
                auto s = weak.lock();
                if (s && !s->stopping_) s->OnElected(fence);
              });
            }
          },
      .deposed =
          [weak](const Status& why) {
            if (auto self = weak.lock()) {
              asio::post(self->io_, [weak, why] {
                auto s = weak.lock();
                if (s && !s->stopping_ && s->leading_) s->StepDown(why, /*resign=*/false);
              });
            }
          }};
  MORPH_ASSIGN_OR_RETURN(election_,
                         Election::Start(ElectionOptions{.etcd = *options_.etcd,
                                                         .prefix = options_.etcd_prefix,
                                                         .value = where,
                                                         .ttl_s = options_.etcd_ttl_s},
                                         std::move(cb)),
                         "coordinator failover");
  MORPH_LOG(INFO, log_) << "candidate for " << options_.etcd_prefix << " on etcd "
                        << options_.etcd->endpoints.front()
                        << (options_.etcd->endpoints.size() > 1 ? ",..." : "") << " (lease TTL "
                        << options_.etcd_ttl_s << " s): following until elected";
  return Status::Ok();
}

void Coordinator::Impl::OnElected(const EtcdFence& fence) {
  if (fence.lease != election_->fence().lease) return;  // deposed again meanwhile
  const auto t0 = Clock::now();
  StatusOr<std::optional<EtcdKv>> got = election_->etcd().Get(StateKey(options_.etcd_prefix));
  if (!got.ok()) {
    MORPH_LOG(WARNING, log_) << "elected, but the job's state cannot be read: " << got.status();
    election_->Resign();
    return;
  }
  std::vector<DeciderAction::Any> actions;
  json j;
  if (got->has_value()) {
    j = json::parse((*got)->value, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("job")) {
      if (Status mine = AdoptJobRecord(j["job"]); !mine.ok()) {
        // Another job's state (a candidate started with another token on this prefix): it
        // must not lead it, write to it, or fail it. It stops campaigning and ends.
        MORPH_LOG(ERROR, log_) << mine.message();
        Finish(mine);
        election_->Stop();
        return;
      }
    }
  }
  decider_ = Decider(MakeDeciderOptions());
  if (got->has_value()) {
    Status loaded = j.is_object() && j.contains("decider") && j["decider"].is_string()
                        ? decider_.Load(j["decider"].get<std::string>())
                        : DataLossError("not a saved coordinator state");
    if (loaded.ok() && j.contains("manifest") && j["manifest"].is_string()) {
      StatusOr<std::string> frame = Base64Decode(j["manifest"].get<std::string>());
      StatusOr<WireMessage> m =
          frame.ok() ? DecodeFrame(*frame) : StatusOr<WireMessage>(frame.status());
      if (m.ok() && std::holds_alternative<RegisterMsg>(*m)) {
        manifest_ = std::make_shared<const JobManifest>(std::get<RegisterMsg>(*m).manifest);
        manifest_frame_ = *frame;
      } else {
        loaded = DataLossError("the saved manifest does not decode");
      }
    }
    if (!loaded.ok()) {
      // Never lead on a state this coordinator cannot read: the job would start over.
      MORPH_LOG(ERROR, log_) << "elected, but the saved state in " << options_.etcd_prefix
                             << " is unreadable: " << loaded;
      Finish(loaded);
      election_->Resign();
      return;
    }
    // The job ended under an earlier leader: so does this candidate (morphd exits as it did).
    switch (decider_.phase()) {
      case Decider::Phase::kComplete:
        Finish(Status::Ok());
        election_->Resign();
        return;
      case Decider::Phase::kStopped:
        Finish(CancelledError("the job stopped under an earlier leader"));
        election_->Resign();
        return;
      case Decider::Phase::kFailed:
        Finish(FailedPreconditionError("the job failed under an earlier leader"));
        election_->Resign();
        return;
      default:
        break;
    }
    next_worker_ = std::max<WorkerId>(next_worker_, j.value("next_worker", WorkerId{1}));
    options_.first_generation = j.value("first_generation", options_.first_generation);
    actions = decider_.Resume(NowMs());
    successions_.fetch_add(1);
  }
  fence_ = fence;
  leading_ = true;
  leading_flag_ = true;
  saved_.clear();
  log_.Set(decider_.current().id, -1, static_cast<int>(decider_.current().ranks.size()));
  MORPH_LOG(INFO, log_) << "leading " << options_.etcd_prefix << " (lease " << fence.lease << "): "
                        << (got->has_value()
                                ? "restored generation " + std::to_string(decider_.current().id) +
                                      " (" + std::string(DeciderPhaseName(decider_.phase())) +
                                      "), " + std::to_string(decider_.candidates().size()) +
                                      " worker(s) may reconnect"
                                : std::string("a new job"))
                        << " in " << Ms(Clock::now() - t0) << " ms";
  if (!Persist()) return;
  for (DeciderAction::Any& a : actions) Execute(a);
  MarkDirty();
}

void Coordinator::Impl::StepDown(const Status& why, bool resign) {
  if (!leading_) return;
  leading_ = false;
  leading_flag_ = false;
  MORPH_LOG(WARNING, log_) << "no longer leading " << options_.etcd_prefix << ": " << why
                           << "; closing " << conns_.size() << " worker connection(s)";
  for (auto& [id, c] : conns_) {
    c->gone_reported = true;  // they reconnect to the leader; nothing is decided here
    CloseSocket(c);
  }
  conns_.clear();
  hosts_.clear();
  hosts_known_.store(0);
  connected_.store(0);
  for (auto& [id, answer] : answers_) answer(UnavailableError("the coordinator stepped down"));
  answers_.clear();
  events_.clear();
  decider_ = Decider(MakeDeciderOptions());
  saved_.clear();
  timing_.reset();
  if (resign && election_) election_->Resign();
  MarkDirty();
}

void Coordinator::Resign() {
  std::weak_ptr<Impl> weak = impl_;
  asio::post(impl_->io_, [weak] {
    auto s = weak.lock();
    if (s && !s->stopping_ && s->leading_ && s->ha()) {
      s->StepDown(AbortedError("resigned (the worker that hosts it leaves the job)"),
                  /*resign=*/true);
    }
  });
}

std::string Coordinator::Impl::SavedState() const {
  json j{{"decider", decider_.Save()},
         {"next_worker", next_worker_},
         {"first_generation", options_.first_generation},
         {"job", JobRecord()}};
  if (!manifest_frame_.empty()) j["manifest"] = Base64Encode(manifest_frame_);
  return j.dump();
}

bool Coordinator::Impl::Persist() {
  if (!ha()) return true;
  if (!leading_) return false;
  if (manifest_ && manifest_frame_.empty()) {
    manifest_frame_ = EncodeFrame(RegisterMsg{.manifest = *manifest_});
  }
  std::string state = SavedState();
  if (state == saved_) return true;
  const auto t0 = Clock::now();
  Status s = election_->etcd().FencedPut(fence_, {{StateKey(options_.etcd_prefix), state}});
  const int64_t us =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
  etcd_writes_.fetch_add(1);
  etcd_write_us_.fetch_add(us);
  if (us > etcd_write_max_us_.load()) etcd_write_max_us_.store(us);
  if (!s.ok()) {
    // Deposed (the fence is gone) or etcd unreachable: what was decided is not durable, so it
    // must not be carried out; a successor decides from the last state written.
    StepDown(s, /*resign=*/true);
    return false;
  }
  saved_ = std::move(state);
  return true;
}

void Coordinator::Impl::SendWelcome(const std::shared_ptr<Conn>& c) {
  const Generation& g = decider_.current();
  Enqueue(c, std::make_shared<const std::string>(EncodeFrame(
                 WelcomeMsg{.worker = c->id,
                            .generation = g.id,
                            .store_address = JoinHostPort(advertise_host_, store_->port()),
                            .current = g,
                            .first_generation = options_.first_generation})));
}

void Coordinator::Impl::OnResumeRegister(const std::shared_ptr<Conn>& c, const RegisterMsg& m) {
  const WorkerId id = c->resume_id;
  if (conns_.count(id)) {
    return Refuse(c, AlreadyExistsError("worker " + std::to_string(id) + " is connected already"));
  }
  c->timer.cancel();
  c->id = id;
  next_worker_ = std::max(next_worker_, id + 1);
  c->state = Conn::State::kJoined;
  conns_[c->id] = c;
  hosts_[c->id] = c->host;
  hosts_known_.store(static_cast<int64_t>(hosts_.size()));
  MaybeWatch(c);
  connected_.fetch_add(1);
  SendWelcome(c);
  MORPH_LOG(INFO, log_) << "worker " << id << " reconnected from " << c->host << " (generation "
                        << m.resume.generation << ", next step " << m.resume.step << ")";
  Feed(DeciderEvent::Rejoin{.worker = id,
                            .host = c->host,
                            .generation = m.resume.generation,
                            .awaiting_outcome = m.resume.awaiting_outcome,
                            .done = m.resume.done,
                            .leaving = m.resume.leaving,
                            .prepared = m.resume.prepared});
}

}  // namespace morph
