#include "runtime/coordinator/coordinator.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <limits>
#include <numeric>

#include "base/host_port.h"
#include "base/logging.h"
#include "base/params.h"
#include "base/printable.h"
#include "collectives/store/store_protocol.h"
#include "runtime/coordinator/coordinator_impl.h"
#include "runtime/plan/plan_input.h"
#include "runtime/recovery/checkpoint_catalog.h"

namespace morph {
namespace {

// A connection speaks for the worker it registered as, and only for it: a message whose body
// names another worker is refused (and the connection closed), never silently re-addressed.
Status SpeaksForItself(std::string_view field, WorkerId named, WorkerId self) {
  if (named == self) return Status::Ok();
  return PermissionDeniedError(std::string(field) + ": names worker " + std::to_string(named) +
                               ", but this connection is worker " + std::to_string(self));
}

// The largest state one rank holds under `c`: DP rank 0 holds the longest ZeRO range, so the
// pp*tp ranks with d = 0 bound every rank (cost pp*tp*tensors, not world*tensors).
int64_t MaxStateBytesPerRank(const JobManifest& m, const ParallelConfig& c) {
  int64_t most = 0;
  for (int p = 0; p < c.pp; ++p) {
    for (int t = 0; t < c.tp; ++t) {
      StatusOr<int64_t> b = StateBytesOfRank(m, c, (p * c.dp) * c.tp + t);
      if (!b.ok()) return std::numeric_limits<int64_t>::max();  // does not fit this config
      most = std::max(most, *b);
    }
  }
  return most;
}

}  // namespace

StatusOr<PlannedChange> PlanChange(const JobManifest& manifest, const ConfigPolicy& policy,
                                   const PlanRequest& req) {
  auto shared = std::make_shared<const JobManifest>(manifest);
  ModelConstraints mc{.num_layers = manifest.model.num_layers,
                      .num_heads = manifest.model.num_heads,
                      .tp_candidates = manifest.model.tp_candidates,
                      .pp_candidates = manifest.model.pp_candidates,
                      .global_batch = manifest.model.global_batch,
                      .micro_batches = manifest.model.micro_batches,
                      .zero_stage = manifest.model.zero_stage,
                      .memory_per_rank = nullptr,
                      .device_memory_bytes = manifest.model.device_memory_bytes};
  for (const TensorSpec& t : manifest.tensors) {
    const int g = t.layout.zero_group();
    if (g > 1) mc.dp_multiple = std::lcm(mc.dp_multiple, g);
  }
  if (manifest.model.device_memory_bytes > 0) {
    mc.memory_per_rank = [shared](const ParallelConfig& c) {
      return MaxStateBytesPerRank(*shared, c);
    };
  }
  MORPH_ASSIGN_OR_RETURN(ConfigPlanner planner, ConfigPlanner::Create(std::move(mc), policy));
  MORPH_ASSIGN_OR_RETURN(ConfigChoice choice,
                         planner.Choose(req.target_world, req.from.id ? &req.from.config : nullptr));
  MORPH_ASSIGN_OR_RETURN(std::vector<WorkerId> ranks,
                         AssignRanks(manifest, req.from, req.lost, req.candidates, choice.config));
  Generation next{.id = req.generation, .config = choice.config, .ranks = ranks};
  ChangeParticipants change{.participants = ParticipantOrder(req.from, req.lost, ranks),
                            .lost = req.lost};
  MORPH_ASSIGN_OR_RETURN(ChangePlan plan, PlanForChange(manifest, req.from, next, change));
  return PlannedChange{.config = choice.config,
                       .ranks = std::move(ranks),
                       .plan_digest = plan.digest,
                       .explanation = choice.explanation};
}

StatusOr<ResumeMode> ParseResumeMode(std::string_view value, std::string_view what) {
  std::string v(value);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (v == "auto") return ResumeMode::kAuto;
  if (v == "always") return ResumeMode::kAlways;
  if (v == "never") return ResumeMode::kNever;
  return InvalidArgumentError(std::string(what) + ": '" + std::string(value) +
                              "' is not one of auto, always, never");
}

std::string_view ResumeModeName(ResumeMode mode) {
  switch (mode) {
    case ResumeMode::kAuto:
      return "auto";
    case ResumeMode::kAlways:
      return "always";
    case ResumeMode::kNever:
      return "never";
  }
  return "?";
}

StatusOr<int64_t> ParseRestartCount(const char* value) {
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(value, &end, 10);
  if (errno != 0 || *end != '\0' || n < 0) {
    return InvalidArgumentError("SLURM_RESTART_COUNT: '" + std::string(value) +
                                "' is not a count of restarts");
  }
  return static_cast<int64_t>(n);
}

StatusOr<CoordinatorOptions> CoordinatorOptions::FromEnv() {
  CoordinatorOptions o;
  MORPH_ASSIGN_OR_RETURN(o.address, params::CoordinatorAddr());
  MORPH_ASSIGN_OR_RETURN(int64_t port, params::CoordinatorPort());
  o.port = static_cast<uint16_t>(port);
  MORPH_ASSIGN_OR_RETURN(o.advertise_host, params::CoordinatorAdvertise());
  MORPH_ASSIGN_OR_RETURN(o.token, JobTokenFromEnv());
  MORPH_ASSIGN_OR_RETURN(int64_t initial, params::InitialWorld());
  MORPH_ASSIGN_OR_RETURN(int64_t max_world, params::MaxWorld());
  if (initial > max_world) {
    return InvalidArgumentError("MORPH_INITIAL_WORLD: " + std::to_string(initial) +
                                " exceeds MORPH_MAX_WORLD " + std::to_string(max_world));
  }
  o.initial_world = static_cast<int>(initial);
  o.max_world = static_cast<int>(max_world);
  MORPH_ASSIGN_OR_RETURN(o.heartbeat_timeout_ms, params::HeartbeatTimeoutMs());
  MORPH_ASSIGN_OR_RETURN(o.local_watch_ms, params::LocalWatchMs());
  MORPH_ASSIGN_OR_RETURN(o.max_unauthenticated, params::CoordinatorMaxUnauthenticated());
  MORPH_ASSIGN_OR_RETURN(o.checkpoint_dir, params::CheckpointDir());
  MORPH_ASSIGN_OR_RETURN(std::string resume, params::Resume());
  MORPH_ASSIGN_OR_RETURN(o.resume, ParseResumeMode(resume));
  MORPH_ASSIGN_OR_RETURN(o.restart_count, ParseRestartCount(std::getenv("SLURM_RESTART_COUNT")));
  MORPH_ASSIGN_OR_RETURN(o.http, HttpServerOptions::FromEnv());
  o.http.token = o.token;
  MORPH_ASSIGN_OR_RETURN(o.store, TcpStoreServerOptions::FromEnv());
  MORPH_ASSIGN_OR_RETURN(std::string etcd, params::Etcd());
  if (!etcd.empty()) {
    MORPH_ASSIGN_OR_RETURN(o.etcd, EtcdOptions::Parse(etcd, "MORPH_ETCD"));
  }
  MORPH_ASSIGN_OR_RETURN(o.etcd_prefix, params::EtcdPrefix());
  MORPH_ASSIGN_OR_RETURN(o.etcd_ttl_s, params::EtcdTtlS());
  MORPH_ASSIGN_OR_RETURN(o.rejoin_timeout_ms, params::EtcdRejoinMs());
  return o;
}

Status Coordinator::Impl::Start() {
  const CoordinatorOptions& o = options_;
  if (o.token.empty()) return InvalidArgumentError("token: the job token is empty (MORPH_TOKEN)");
  if (o.initial_world < 1) {
    return InvalidArgumentError("initial_world: must be at least 1, got " +
                                std::to_string(o.initial_world));
  }
  if (o.max_world < o.initial_world) {
    return InvalidArgumentError("max_world: " + std::to_string(o.max_world) +
                                " is below initial_world " + std::to_string(o.initial_world));
  }
  if (manifest_) {
    MORPH_RETURN_IF_ERROR(ValidateManifest(*manifest_)) << "manifest";
  }
  error_code ec;
  asio::ip::address ip = asio::ip::make_address(o.address, ec);
  if (ec) {
    return InvalidArgumentError("address: '" + o.address + "' is not an IP address: " +
                                ec.message());
  }
  {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) == 0) local_hostname_ = name;
  }
  advertise_host_ = o.advertise_host;
  if (advertise_host_.empty()) {
    advertise_host_ = o.address;
    if (ip.is_unspecified()) {
      char name[256] = {};
      if (::gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') advertise_host_ = name;
    }
  }
  MORPH_ASSIGN_OR_RETURN(store_, TcpStoreServer::Start(o.address, 0, o.token, o.store),
                         "starting the coordinator's store");
  tcp::endpoint ep(ip, o.port);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return UnavailableError("coordinator: cannot listen on " + JoinHostPort(o.address, o.port) +
                            ": " + ec.message());
  }
  port_ = acceptor_.local_endpoint().port();
  waiting_.set_cap(PreAuthCap(o.max_unauthenticated));
  if (o.serve_http) {
    HttpServerOptions h = o.http;
    if (h.token.empty()) h.token = o.token;
    // With failover the job's largest world is the job's (its saved record), which this
    // candidate learns only when it leads: the decider checks it (ValidateResize).
    h.max_world = o.etcd ? (1 << 16) : o.max_world;
    std::weak_ptr<Impl> weak = weak_from_this();
    http_ = std::make_unique<HttpServer>(
        io_, h,
        HttpServer::Callbacks{
            .resize =
                [this](ResizeCall call, HttpServer::Answer answer) {
                  return SubmitResize(std::move(call.request), std::move(answer),
                                      "the scheduler API");
                },
            .snapshot = [this] { return BuildSnapshot(); }});
    MORPH_RETURN_IF_ERROR(http_->Start()) << "starting the scheduler API";
    http_port_ = http_->port();
  }
  published_ = BuildSnapshot();
  work_.emplace(asio::make_work_guard(io_));
  Accept();
  ArmTick();
  if (ha()) {
    MORPH_RETURN_IF_ERROR(StartCampaign());
  }
  io_thread_ = std::thread([this] { io_.run(); });
  if (pthread_getcpuclockid(io_thread_.native_handle(), &io_clock_) == 0) has_io_clock_ = true;
  MORPH_LOG(INFO, log_) << "control channel on " << JoinHostPort(advertise_host_, port_)
            << ", store on " << JoinHostPort(advertise_host_, store_->port())
            << (http_ ? ", scheduler API on port " + std::to_string(http_port_) : "")
            << "; waiting for " << o.initial_world << " worker(s) (at most " << waiting_.cap()
            << " connections before their hello)";
  return Status::Ok();
}

void Coordinator::Impl::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  // A leader that stops resigns: a successor leads at once, not a lease TTL later.
  if (election_) election_->Stop();
  if (io_thread_.joinable()) {
    std::promise<void> closed;
    asio::post(io_, [this, &closed] {
      stopping_ = true;
      error_code ec;
      acceptor_.close(ec);
      accept_backoff_.cancel();
      while (!waiting_.empty()) {
        std::shared_ptr<Conn> c = waiting_.oldest();
        c->gone_reported = true;
        CloseSocket(c);
      }
      tick_.cancel();
      watch_timer_.cancel();
      publish_timer_.cancel();
      if (http_) http_->Stop();
      for (auto& [id, c] : conns_) {
        c->gone_reported = true;
        CloseSocket(c);
      }
      conns_.clear();
      hosts_.clear();
      hosts_known_.store(0);
      for (auto& [id, answer] : answers_) answer(AbortedError("the coordinator stopped"));
      answers_.clear();
      work_.reset();
      io_.stop();
      closed.set_value();
    });
    closed.get_future().wait();
    io_thread_.join();
  }
  planner_.join();
  launcher_.join();
  store_.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!result_) result_ = AbortedError("the coordinator stopped before the job ended");
  }
  cv_.notify_all();
}

void Coordinator::Impl::Accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket sock) {
    if (stopping_ || !acceptor_.is_open()) return;
    if (ec) {
      // Out of descriptors: free one held by a stranger, as the store does; either way wait
      // before the next try instead of spinning on a listener that stays readable.
      const int e = ec.value();
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) DropOldestWaiting();
      if (int64_t folded = 0; accept_warnings_.Allow(&folded)) {
        MORPH_LOG(WARNING, log_) << "control channel: accept failed: " << ec.message()
                     << "; retrying every 20 ms" << Folded(folded);
      }
      accept_backoff_.expires_after(std::chrono::milliseconds(20));
      accept_backoff_.async_wait([this](error_code e2) {
        if (!e2 && !stopping_) Accept();
      });
      return;
    }
    accepted_.fetch_add(1);
    error_code ignored;
    sock.set_option(tcp::no_delay(true), ignored);
    auto c = std::make_shared<Conn>(io_, std::move(sock));
    if (waiting_.full()) DropOldestWaiting();
    c->waiting = waiting_.Add(c);
    c->timer.expires_after(std::chrono::milliseconds(options_.handshake_timeout_ms));
    c->timer.async_wait([this, weak = std::weak_ptr<Conn>(c)](error_code e) {
      auto c = weak.lock();
      if (e || !c || c->state == Conn::State::kJoined) return;
      refused_.fetch_add(1);
      MORPH_VLOG(1, log_) << "handshake timed out";
      c->gone_reported = true;
      CloseSocket(c);
    });
    ReadHeader(c);
    Accept();
  });
}

void Coordinator::Impl::DropOldestWaiting() {
  if (waiting_.empty()) return;
  std::shared_ptr<Conn> oldest = waiting_.oldest();
  refused_.fetch_add(1);
  dropped_.fetch_add(1);
  if (int64_t folded = 0; drop_warnings_.Allow(&folded)) {
    MORPH_LOG(WARNING, log_) << "control channel: " << waiting_.size()
                 << " connections have not sent their hello (at most " << waiting_.cap()
                 << ": MORPH_COORDINATOR_MAX_UNAUTHENTICATED, an eighth of the open-file "
                    "limit): closing the oldest"
                 << Folded(folded);
  }
  oldest->gone_reported = true;
  oldest->timer.cancel();
  CloseSocket(oldest);
}

void Coordinator::Impl::StopWaiting(Conn& c) {
  if (!c.waiting) return;
  waiting_.Remove(*c.waiting);
  c.waiting.reset();
}

void Coordinator::Impl::ReadHeader(const std::shared_ptr<Conn>& c) {
  asio::async_read(c->sock, asio::buffer(c->header), [this, c](error_code ec, size_t) {
    if (c->state == Conn::State::kClosed) return;
    if (ec) return Gone(c, ec == asio::error::eof ? "connection closed" : ec.message());
    StatusOr<FrameHeader> h = DecodeHeader(std::string_view(c->header.data(), c->header.size()));
    if (!h.ok()) return Refuse(c, h.status());
    bool hello = h->type == static_cast<uint16_t>(WireType::kHello);
    bool reg = h->type == static_cast<uint16_t>(WireType::kRegister);
    if (c->state == Conn::State::kHello && !hello) {
      return Refuse(c, UnauthenticatedError("the first frame must be hello, got " +
                                            std::string(WireTypeName(h->type))));
    }
    if (c->state == Conn::State::kRegister && !reg) {
      return Refuse(c, FailedPreconditionError("after hello a worker must register, got " +
                                               std::string(WireTypeName(h->type))));
    }
    if (c->state == Conn::State::kJoined && (hello || reg)) {
      return Refuse(c, FailedPreconditionError("already registered, got " +
                                               std::string(WireTypeName(h->type))));
    }
    c->hdr = *h;
    c->body.clear();
    ReadBody(c);
  });
}

void Coordinator::Impl::ReadBody(const std::shared_ptr<Conn>& c) {
  size_t have = c->body.size();
  if (have == c->hdr.length) {
    StatusOr<WireMessage> m = DecodeBody(c->hdr, c->body);
    std::string().swap(c->body);
    if (!m.ok()) return Refuse(c, m.status());
    received_.fetch_add(1);
    OnFrame(c, *std::move(m));
    if (c->state != Conn::State::kClosed) ReadHeader(c);
    return;
  }
  // The buffer grows as bytes arrive: a header alone never makes us allocate its length.
  size_t chunk = std::min<size_t>(c->hdr.length - have, kReadChunk);
  c->body.resize(have + chunk);
  asio::async_read(c->sock, asio::buffer(c->body.data() + have, chunk),
                   [this, c](error_code ec, size_t) {
                     if (c->state == Conn::State::kClosed) return;
                     if (ec) return Gone(c, ec == asio::error::eof ? "connection closed"
                                                                   : ec.message());
                     ReadBody(c);
                   });
}

void Coordinator::Impl::OnFrame(const std::shared_ptr<Conn>& c, WireMessage m) {
  if (auto* hello = std::get_if<HelloMsg>(&m)) return OnHello(c, *hello);
  if (auto* reg = std::get_if<RegisterMsg>(&m)) return OnRegister(c, std::move(*reg));
  const WorkerId id = c->id;
  std::visit(
      [&](auto& msg) {
        using M = std::decay_t<decltype(msg)>;
        if constexpr (std::is_same_v<M, HeartbeatMsg>) {
          NoteStep(id, msg.step);
          Feed(DeciderEvent::Heartbeat{id});
        } else if constexpr (std::is_same_v<M, LeaveMsg>) {
          MORPH_LOG(INFO, log_) << "worker " << id << " asks to leave: " << Printable(msg.reason);
          Feed(DeciderEvent::LeaveRequest{id});
        } else if constexpr (std::is_same_v<M, StepReportMsg>) {
          if (Status s = SpeaksForItself("step_report.worker", msg.worker, id); !s.ok()) {
            return Refuse(c, s);
          }
          Feed(msg);
        } else if constexpr (std::is_same_v<M, AppliedMsg>) {
          if (Status s = SpeaksForItself("applied.worker", msg.worker, id); !s.ok()) {
            return Refuse(c, s);
          }
          if (timing_ && msg.ok) {
            AppliedMsg::Phases& p = timing_->slowest;
            p.communicators_us = std::max(p.communicators_us, msg.phases.communicators_us);
            p.plan_us = std::max(p.plan_us, msg.phases.plan_us);
            p.transfer_us = std::max(p.transfer_us, msg.phases.transfer_us);
            p.resume_us = std::max(p.resume_us, msg.phases.resume_us);
            p.stall_us = std::max(p.stall_us, msg.phases.stall_us);
          }
          if (!msg.ok) {
            MORPH_LOG(WARNING, log_) << "worker " << id << " failed to apply generation "
                         << msg.generation << ": " << Printable(msg.error);
          }
          Feed(msg);
        } else if constexpr (std::is_same_v<M, DoneMsg>) {
          MORPH_LOG(INFO, log_) << "worker " << id << " finished training";
          Feed(DeciderEvent::Done{id});
        } else if constexpr (std::is_same_v<M, FailureReportMsg>) {
          MORPH_LOG(WARNING, log_) << "worker " << id << " failed step " << msg.step
                       << " of generation " << msg.generation << " (suspects " << Ids(msg.peers)
                       << "): " << Printable(msg.error);
          Feed(DeciderEvent::FailureReport{.worker = id, .report = std::move(msg)});
        } else if constexpr (std::is_same_v<M, ErrorMsg>) {
          c->close_after_write = true;
          Gone(c, "worker error " + std::string(StatusCodeName(static_cast<StatusCode>(msg.code))) +
                      ": " + Printable(msg.message));
        } else {
          Refuse(c, InvalidArgumentError("a worker may not send " +
                                         std::string(WireTypeName(
                                             static_cast<uint16_t>(WireMessage(msg).index() + 1)))));
        }
      },
      m);
}

void Coordinator::Impl::OnHello(const std::shared_ptr<Conn>& c, const HelloMsg& m) {
  if (!store_wire::TokensEqual(m.token, options_.token)) {  // constant time, as the store
    return Refuse(c, UnauthenticatedError("wrong job token"));
  }
  StopWaiting(*c);  // it holds the token: no longer a stranger
  // The host goes into log lines and /v1/status: a name, never a line break or an escape.
  if (!m.host.empty()) {
    if (Status s = CheckHostName("hello.host", m.host); !s.ok()) return Refuse(c, s);
  }
  error_code ec;
  tcp::endpoint remote = c->sock.remote_endpoint(ec);
  c->host = !m.host.empty() ? m.host : ec ? std::string("?") : remote.address().to_string();
  c->pid = m.pid;
  c->resume_id = m.resume_id;
  c->state = Conn::State::kRegister;
}

void Coordinator::Impl::OnRegister(const std::shared_ptr<Conn>& c, RegisterMsg m) {
  if (ended_ && (ended_->ok() || ended_->code() == StatusCode::kCancelled)) {
    // A joiner a grow started just before the job completed (or stopped as asked): nothing to
    // join and nothing failed. It is released, as the joiners of a change that the end closed
    // are (its Start returns with Finished()), instead of refused.
    Enqueue(c, std::make_shared<const std::string>(EncodeFrame(ReleaseMsg{})));
    c->close_after_write = true;
    return Gone(c, "released: the job ended before it registered");
  }
  if (ended_) {
    return Refuse(c, FailedPreconditionError("the job has ended: " + ended_->ToString()));
  }
  if (!leading_) {
    return Refuse(c, UnavailableError("this coordinator does not lead the job (coordinator "
                                      "failover): look up the leader in etcd"));
  }
  Status valid = ValidateManifest(m.manifest);
  if (!valid.ok()) {
    return Refuse(c, InvalidArgumentError("registration: " + std::string(valid.message())));
  }
  if (!manifest_) {
    manifest_ = std::make_shared<const JobManifest>(std::move(m.manifest));
    MORPH_LOG(INFO, log_) << "the job's manifest is " << manifest_->tensors.size()
              << " tensors, " << manifest_->scalars.size() << " scalars (defined by the first "
              << "registration, from " << c->host << ")";
  } else {
    std::string why = FirstDifference(*manifest_, m.manifest);
    if (!why.empty()) {
      return Refuse(c, FailedPreconditionError("registration differs from the job's: " + why));
    }
  }
  // A worker reconnecting to a successor as itself: only with failover (a lone coordinator gives
  // every registration a fresh id, so that a token holder cannot take over another's identity).
  if (c->resume_id != 0 && ha()) return OnResumeRegister(c, m);
  c->timer.cancel();
  c->id = next_worker_++;
  c->state = Conn::State::kJoined;
  conns_[c->id] = c;
  hosts_[c->id] = c->host;
  hosts_known_.store(static_cast<int64_t>(hosts_.size()));
  MaybeWatch(c);
  registered_.fetch_add(1);
  connected_.fetch_add(1);
  SendWelcome(c);
  MORPH_VLOG(1, log_) << "worker " << c->id << " registered from " << c->host;
  Feed(DeciderEvent::Join{.worker = c->id, .host = c->host});
}

void Coordinator::Impl::Refuse(const std::shared_ptr<Conn>& c, const Status& s) {
  if (c->state == Conn::State::kClosed) return;
  bool joined = c->state == Conn::State::kJoined;
  if (!joined) refused_.fetch_add(1);
  // A stranger's refusal (no Hello with the token yet) is what a flood repeats: one line per
  // 10 s at most. A token holder's is worth a line each.
  const bool stranger = c->waiting.has_value();
  if (int64_t folded = 0; !stranger || refuse_warnings_.Allow(&folded)) {
    std::string from = c->host;
    if (from.empty()) {
      error_code ec;
      tcp::endpoint remote = c->sock.remote_endpoint(ec);
      from = ec ? "?" : JoinHostPort(remote.address().to_string(), remote.port());
    }
    MORPH_LOG(WARNING, log_) << "closing " << (joined ? "worker " + std::to_string(c->id) : "a")
                 << " connection from " << from << ": " << s << Folded(folded);
  }
  int32_t code = static_cast<int32_t>(s.ok() ? StatusCode::kInternal : s.code());
  Enqueue(c, std::make_shared<const std::string>(
                 EncodeFrame(ErrorMsg{.code = code, .message = std::string(s.message())})));
  c->close_after_write = true;
  Gone(c, std::string(s.message()));
}

void Coordinator::Impl::Gone(const std::shared_ptr<Conn>& c, const std::string& reason) {
  bool was_joined = c->state == Conn::State::kJoined;
  c->state = Conn::State::kClosed;
  c->timer.cancel();
  if (!c->close_after_write || !c->writing) {
    CloseSocket(c);
  } else {
    // The last frame (an ErrorMsg) is being written: a peer that does not read gets 5 s.
    c->timer.expires_after(std::chrono::seconds(5));
    c->timer.async_wait([this, weak = std::weak_ptr<Conn>(c)](error_code e) {
      auto c = weak.lock();
      if (!e && c) CloseSocket(c);
    });
  }
  if (c->watched) {
    c->watched.reset();
    --watched_;
  }
  if (!was_joined) return;
  hosts_.erase(c->id);  // lost, released or disconnected: nothing keeps its host
  hosts_known_.store(static_cast<int64_t>(hosts_.size()));
  if (c->gone_reported) return;
  c->gone_reported = true;
  conns_.erase(c->id);
  connected_.fetch_sub(1);
  Feed(DeciderEvent::Lost{.worker = c->id, .reason = reason});
}

void Coordinator::Impl::CloseSocket(const std::shared_ptr<Conn>& c) {
  if (c->socket_closed) return;
  c->socket_closed = true;
  c->state = Conn::State::kClosed;
  StopWaiting(*c);
  error_code ec;
  c->sock.shutdown(tcp::socket::shutdown_both, ec);
  c->sock.close(ec);
  c->out.clear();
  c->queued_bytes = 0;
}

void Coordinator::Impl::Enqueue(const std::shared_ptr<Conn>& c,
                                std::shared_ptr<const std::string> frame, bool commit) {
  if (c->socket_closed || c->close_after_write) return;
  c->queued_bytes += frame->size();
  c->out.push_back({std::move(frame), commit});
  if (c->queued_bytes > kMaxQueuedBytes) {
    Gone(c, "its connection has " + std::to_string(c->queued_bytes) + " bytes unread");
    CloseSocket(c);
    return;
  }
  if (!c->writing) DoWrite(c);
}

void Coordinator::Impl::DoWrite(const std::shared_ptr<Conn>& c) {
  if (c->out.empty() || c->socket_closed) {
    c->writing = false;
    if (c->close_after_write) CloseSocket(c);
    return;
  }
  c->writing = true;
  asio::async_write(c->sock, asio::buffer(*c->out.front().frame),
                    [this, c](error_code ec, size_t) {
                      if (c->socket_closed) return;
                      if (ec) {
                        c->writing = false;
                        Gone(c, "write failed: " + ec.message());
                        CloseSocket(c);
                        return;
                      }
                      sent_.fetch_add(1);
                      if (c->out.front().commit) commits_sent_.fetch_add(1);
                      c->queued_bytes -= c->out.front().frame->size();
                      c->out.pop_front();
                      DoWrite(c);
                    });
}

// ---- Coordinator -----------------------------------------------------------------------------

StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(CoordinatorOptions options) {
  const LogContext log("coordinator");  // before the first generation
  if (options.first_generation > kMaxCheckpointGeneration + 1) {
    return InvalidArgumentError("first_generation " + std::to_string(options.first_generation) +
                                " leaves no room to number generations after it (at most " +
                                std::to_string(kMaxCheckpointGeneration + 1) + ")");
  }
  if (options.first_generation <= 0) {
    options.first_generation = 1;
    if (!options.checkpoint_dir.empty()) {
      // Never past kMaxCheckpointGeneration + 1: the folder names are checked.
      MORPH_ASSIGN_OR_RETURN(
          int64_t newest, NewestCheckpointGeneration(options.checkpoint_dir),
          "numbering the job's generations after the checkpoints in " << options.checkpoint_dir);
      options.first_generation = newest + 1;
    }
  }
  if (!options.checkpoint_dir.empty()) {
    MORPH_LOG(INFO, log) << "the job's first generation is " << options.first_generation
              << ": checkpoint folders in " << options.checkpoint_dir << " of a lower generation"
              << " are an earlier run's, never deleted by this job";
  }
  ResumeFinder resume_finder;
  if (!options.latest_checkpoint && !options.checkpoint_dir.empty()) {
    // A recovery reads this job's own checkpoints (generation >= first_generation: an earlier
    // run's are another training's state unless this job resumed from one) or the one it
    // resumed from, whichever is newer. Both run on the planner thread.
    auto resumed = std::make_shared<std::optional<RecoveryCheckpoint>>();
    options.latest_checkpoint = [dir = options.checkpoint_dir, floor = options.first_generation,
                                 resumed]() -> std::optional<RecoveryCheckpoint> {
      StatusOr<CheckpointRef> c = LatestCompleteCheckpoint(dir, floor);
      if (c.ok() && (!resumed->has_value() || c->step >= (*resumed)->step)) {
        return RecoveryCheckpoint{.step = c->step, .path = c->path};
      }
      return *resumed;
    };
    resume_finder = FolderResumeFinder(options.checkpoint_dir, resumed);
  }
  if (options.ResumeEnabled() && !options.latest_checkpoint) {
    MORPH_LOG(WARNING, log) << "MORPH_RESUME=" << ResumeModeName(*options.resume)
                 << (options.restart_count > 0
                         ? " on restart " + std::to_string(options.restart_count)
                         : std::string())
                 << " but no checkpoint folder (MORPH_CHECKPOINT_DIR): the job starts afresh";
  }
  auto impl = std::make_shared<Impl>(std::move(options), std::move(resume_finder));
  Status s = impl->Start();
  if (!s.ok()) {
    impl->Stop();
    return s;
  }
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

Coordinator::Coordinator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() { Stop(); }
void Coordinator::Stop() { impl_->Stop(); }

std::string Coordinator::control_address() const {
  return JoinHostPort(impl_->advertise_host_, impl_->port_);
}
std::string Coordinator::store_address() const {
  return JoinHostPort(impl_->advertise_host_, impl_->store_ ? impl_->store_->port() : 0);
}
uint16_t Coordinator::http_port() const { return impl_->http_port_; }
TcpStoreServer& Coordinator::store() { return *impl_->store_; }

CoordinatorSnapshot Coordinator::Snapshot() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->published_;
}

Status Coordinator::Resize(ResizeRequest request, Deadline deadline) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    if (impl_->stopped_) return FailedPreconditionError("the coordinator is stopped");
  }
  auto answer = std::make_shared<std::promise<Status>>();
  std::future<Status> f = answer->get_future();
  Impl* impl = impl_.get();
  asio::post(impl->io_, [impl, answer, request = std::move(request)]() mutable {
    impl->SubmitResize(
        std::move(request), [answer](Status s) { answer->set_value(std::move(s)); },
        "Coordinator::Resize");
  });
  // In slices, so a Stop meanwhile (which may drop the request unanswered) is seen.
  while (f.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
    if (deadline.Expired()) {
      return DeadlineExceededError("the coordinator did not answer the resize request in time");
    }
    std::lock_guard<std::mutex> lock(impl_->mu_);
    if (impl_->stopped_) return AbortedError("the coordinator stopped");
  }
  return f.get();
}

Status Coordinator::Wait(Deadline deadline) {
  std::unique_lock<std::mutex> lock(impl_->mu_);
  auto ended = [&] { return impl_->result_.has_value(); };
  if (deadline.IsInfinite()) {
    impl_->cv_.wait(lock, ended);
  } else if (!impl_->cv_.wait_until(lock, deadline.when(), ended)) {
    return DeadlineExceededError("the job is still running");
  }
  return *impl_->result_;
}

Coordinator::Stats Coordinator::stats() const {
  Stats s;
  s.connections_accepted = impl_->accepted_.load();
  s.handshakes_refused = impl_->refused_.load();
  s.unauthenticated_dropped = impl_->dropped_.load();
  s.workers_registered = impl_->registered_.load();
  s.workers_connected = impl_->connected_.load();
  s.frames_received = impl_->received_.load();
  s.frames_sent = impl_->sent_.load();
  s.commits_sent = impl_->commits_sent_.load();
  s.hosts_known = impl_->hosts_known_.load();
  s.leading = impl_->leading_flag_.load();
  s.successions = impl_->successions_.load();
  s.etcd_writes = impl_->etcd_writes_.load();
  s.etcd_write_ms_total = static_cast<double>(impl_->etcd_write_us_.load()) / 1000.0;
  s.etcd_write_ms_max = static_cast<double>(impl_->etcd_write_max_us_.load()) / 1000.0;
  timespec ts{};
  std::lock_guard<std::mutex> lock(impl_->mu_);
  if (impl_->has_io_clock_.load() && !impl_->stopped_ &&
      clock_gettime(impl_->io_clock_, &ts) == 0) {
    s.io_cpu_seconds = static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
  }
  return s;
}

}  // namespace morph
