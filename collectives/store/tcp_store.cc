#include "collectives/store/tcp_store.h"

#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "base/connection_limit.h"
#include "base/host_port.h"
#include "base/params.h"
#include "collectives/store/store_protocol.h"

namespace morph {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using store_wire::DecodeRequest;
using store_wire::DecodeResponse;
using store_wire::EncodeRequest;
using store_wire::EncodeResponse;
using store_wire::Frame;

// The largest response a client reads.
constexpr uint32_t kMaxResponseFrame = 1u << 30;
// How long a client waits past its own deadline for the server's "timed out" answer.
constexpr auto kGrace = std::chrono::seconds(2);
// Bytes the server reads from one connection per syscall, and per wake-up before it lets
// other connections run.
constexpr size_t kReadChunk = 64u << 10;
constexpr size_t kReadBudget = 1u << 20;
// After a failed accept (EMFILE, ENFILE, ...): wait this long before the next, so a full file
// table does not make the accept loop spin.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(20);
// Descriptors left to the rest of the process below its open-file limit.
constexpr int64_t kFdReserve = 32;


// IP addresses as they are; names through the system resolver (blocking: /etc/hosts, DNS).
StatusOr<std::vector<tcp::endpoint>> Resolve(const std::string& host, const std::string& port,
                                             std::string_view what) {
  error_code ec;
  asio::ip::address ip = asio::ip::make_address(host, ec);
  uint16_t port_number = static_cast<uint16_t>(std::stoi(port));
  if (!ec) return std::vector<tcp::endpoint>{tcp::endpoint(ip, port_number)};
  asio::io_context io;
  tcp::resolver resolver(io);
  tcp::resolver::results_type results = resolver.resolve(host, port, ec);
  if (ec == asio::error::host_not_found || ec == asio::error::no_data ||
      ec == asio::error::service_not_found) {
    return InvalidArgumentError(std::string(what) + ": host '" + host +
                                "' is not known: " + ec.message());
  }
  if (ec || results.empty()) {
    return UnavailableError(std::string(what) + ": cannot resolve host '" + host +
                            "': " + (ec ? ec.message() : "no addresses"));
  }
  std::vector<tcp::endpoint> out;
  // IPv4 first: servers given a name usually listen on its IPv4 address.
  for (const auto& r : results) {
    if (r.endpoint().address().is_v4()) out.push_back(r.endpoint());
  }
  for (const auto& r : results) {
    if (!r.endpoint().address().is_v4()) out.push_back(r.endpoint());
  }
  return out;
}

// Every network failure (refused, reset, closed by the server) means "not reachable now".
Status NetError(const error_code& ec, std::string_view what) {
  return UnavailableError(std::string(what) + ": " + ec.message());
}

bool Mutates(KvTable::Op op) {
  return op == KvTable::Op::kSet || op == KvTable::Op::kAdd || op == KvTable::Op::kCas;
}

}  // namespace

StatusOr<std::string> JobTokenFromEnv() {
  MORPH_ASSIGN_OR_RETURN(std::string token, params::Token());
  if (token.empty()) {
    MORPH_ASSIGN_OR_RETURN(std::string path, params::TokenFile());
    if (path.empty()) {
      return FailedPreconditionError("no job token: set MORPH_TOKEN or MORPH_TOKEN_FILE");
    }
    std::ifstream in(path);
    if (!in) {
      int err = errno;
      return Status(err == EACCES ? StatusCode::kPermissionDenied : StatusCode::kNotFound,
                    "MORPH_TOKEN_FILE=" + path + ": cannot read: " + std::strerror(err));
    }
    std::stringstream text;
    text << in.rdbuf();
    token = text.str();
    size_t b = token.find_first_not_of(" \t\r\n"), e = token.find_last_not_of(" \t\r\n");
    token = b == std::string::npos ? "" : token.substr(b, e - b + 1);
    if (token.empty()) return InvalidArgumentError("MORPH_TOKEN_FILE=" + path + " is empty");
  }
  return token;
}

StatusOr<TcpStoreServerOptions> TcpStoreServerOptions::FromEnv() {
  TcpStoreServerOptions o;
  MORPH_ASSIGN_OR_RETURN(o.max_connections, params::StoreMaxConnections());
  MORPH_ASSIGN_OR_RETURN(uint64_t frame, params::StoreMaxFrameBytes());
  if (frame < 64 || frame > (uint64_t{1} << 30)) {
    return InvalidArgumentError("MORPH_STORE_MAX_FRAME_BYTES=" + std::to_string(frame) +
                                ": must be between 64 bytes and 1GiB");
  }
  o.max_frame_bytes = static_cast<uint32_t>(frame);
  MORPH_ASSIGN_OR_RETURN(o.auth_timeout_ms, params::StoreAuthTimeoutMs());
  return o;
}

// ---- server ---------------------------------------------------------------------------------
class TcpStoreServer::Impl {
 public:
  class Session;

  Impl(std::string token, const TcpStoreServerOptions& options)
      : token_(std::move(token)), options_(options) {}
  ~Impl();

  Status Listen(const std::string& host, uint16_t port);

  void Accept();
  void OnAccepted(tcp::socket sock);
  // Closes the connection that has waited longest for authentication; false if none.
  bool DropOldestUnauthenticated();

  // Runs a decoded request for `s`: answers it, or parks it until its keys appear.
  void Execute(Session* s, KvTable::Request request, int64_t timeout_ms);
  // After a mutation: re-examines the requests waiting for its key (or, after an advance,
  // those of the generations now too old).
  void Wake(const KvTable::Request& mutation);
  void WakeOlderThan(int64_t min_generation);
  void Register(Session* s, int64_t generation, const std::string& key);
  void Unregister(Session* s);
  void Remove(Session* s);

  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  asio::steady_timer accept_backoff_{io_};
  std::string token_;
  TcpStoreServerOptions options_;
  int64_t max_connections_ = 0;
  std::string host_;
  uint16_t port_ = 0;
  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
  // io thread only:
  std::unordered_map<Session*, std::shared_ptr<Session>> sessions_;
  PreAuthQueue<Session*> unauthenticated_;  // oldest first, capped (base/connection_limit.h)
  // generation -> key -> the sessions whose waiting request needs that key next.
  std::map<int64_t, std::unordered_map<std::string, std::unordered_set<Session*>>> waiters_;
  bool stopping_ = false;
  // Written on the io thread, read by stats() from any thread.
  std::atomic<int64_t> connections_{0}, unauthenticated_count_{0}, pending_waits_{0},
      buffered_bytes_{0}, waiter_checks_{0}, refused_{0}, accept_errors_{0};
  std::thread thread_;
};

class TcpStoreServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Impl* server, tcp::socket sock)
      : server_(server),
        sock_(std::move(sock)),
        timer_(server->io_),
        reader_(store_wire::kMaxHelloBytes) {}

  void Start(PreAuthQueue<Session*>::Handle unauth_it) {
    unauth_it_ = unauth_it;
    error_code ec;
    sock_.non_blocking(true, ec);
    uint64_t seq = ++timer_seq_;
    timer_.expires_after(std::chrono::milliseconds(server_->options_.auth_timeout_ms));
    timer_.async_wait([self = shared_from_this(), seq](error_code ec) {
      if (ec || self->closed_ || self->timer_seq_ != seq || self->authenticated_) return;
      self->Close();
    });
    ArmRead();
  }

  // Keeps the read side armed at all times (also while a request waits), so that a client
  // that disconnects is noticed and its waiting request dropped. Reading pauses only while a
  // complete frame waits behind one still being answered.
  void ArmRead() {
    if (reading_ || closed_) return;
    reading_ = true;
    sock_.async_wait(tcp::socket::wait_read, [self = shared_from_this()](error_code ec) {
      self->reading_ = false;
      if (self->closed_) return;
      if (ec) return self->Close();
      self->OnReadable();
    });
  }

  void OnReadable() {
    size_t budget = kReadBudget;
    while (!closed_) {
      if (reader_.has_frame()) {
        if (busy_) return;  // resumed when the answer is written
        HandleFrame();
        continue;
      }
      if (budget == 0) return ArmRead();
      std::span<char> space = reader_.Prepare(std::min(kReadChunk, budget));
      AccountHeld();
      error_code ec;
      size_t n = sock_.read_some(asio::buffer(space.data(), space.size()), ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) return ArmRead();
      if (ec) return Close();
      budget -= std::min(budget, n);
      Status s = reader_.Commit(n);
      if (!s.ok()) {
        // Before authentication nothing is said to a stranger; after it, the client learns
        // why (e.g. a value above MORPH_STORE_MAX_FRAME_BYTES).
        if (!authenticated_) return Close();
        KvTable::Response r;
        r.status = s.WithContext("MORPH_STORE_MAX_FRAME_BYTES");
        busy_ = true;
        return Respond(r, /*close_after=*/true);
      }
    }
  }

  void HandleFrame() {
    busy_ = true;
    std::string_view body = reader_.frame();
    if (!authenticated_) {
      StatusOr<std::string> token = store_wire::DecodeHello(body);
      reader_.Pop();
      AccountHeld();
      KvTable::Response r;
      if (!token.ok() || !store_wire::TokensEqual(*token, server_->token_)) {
        r.status = UnauthenticatedError("store: the job token was refused");
        return Respond(r, /*close_after=*/true);
      }
      authenticated_ = true;
      server_->unauthenticated_.Remove(unauth_it_);
      --server_->unauthenticated_count_;
      ++timer_seq_;
      timer_.cancel();
      reader_.set_max_body(server_->options_.max_frame_bytes);
      return Respond(r, false);
    }
    StatusOr<store_wire::WireRequest> wire = DecodeRequest(body);
    reader_.Pop();
    AccountHeld();
    if (!wire.ok()) {
      KvTable::Response r;
      r.status = wire.status();
      return Respond(r, /*close_after=*/true);
    }
    wire->request.bounded_advance = true;
    server_->Execute(this, std::move(wire->request), wire->timeout_ms);
  }

  // Parks the request: answered by RetryPending or when `timeout_ms` passes.
  void Park(KvTable::Request request, size_t first_missing, int64_t timeout_ms) {
    pending_ = std::move(request);
    wait_index_ = first_missing;
    ++server_->pending_waits_;
    server_->Register(this, pending_->generation, pending_->keys[first_missing]);
    uint64_t seq = ++timer_seq_;
    timer_.expires_after(std::chrono::milliseconds(timeout_ms));
    timer_.async_wait([self = shared_from_this(), seq](error_code ec) {
      if (ec || self->closed_ || !self->pending_ || self->timer_seq_ != seq) return;
      self->server_->Unregister(self.get());
      KvTable::Response timed_out = self->server_->table_->TimedOut(*self->pending_);
      self->DropPending();
      self->Respond(timed_out, false);
    });
  }

  void RetryPending() {
    if (!pending_ || closed_) return;
    ++server_->waiter_checks_;
    std::optional<KvTable::Response> r = server_->table_->TryApply(*pending_, &wait_index_);
    if (!r) {
      server_->Register(this, pending_->generation, pending_->keys[wait_index_]);
      return;
    }
    DropPending();
    ++timer_seq_;
    timer_.cancel();
    Respond(*r, false);
  }

  void Respond(const KvTable::Response& r, bool close_after) {
    out_ = Frame(EncodeResponse(r));
    asio::async_write(sock_, asio::buffer(out_),
                      [self = shared_from_this(), close_after](error_code ec, size_t) {
                        if (self->closed_) return;
                        if (ec || close_after) return self->Close();
                        std::string().swap(self->out_);
                        self->busy_ = false;
                        if (self->reader_.has_frame()) return self->OnReadable();
                        self->ArmRead();
                      });
  }

  void Close() {
    if (closed_) return;
    auto self = shared_from_this();  // Remove drops the server's reference
    closed_ = true;
    server_->Unregister(this);
    DropPending();
    ++timer_seq_;
    timer_.cancel();
    error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
    reader_ = store_wire::FrameReader(0);
    AccountHeld();
    if (!authenticated_) {
      server_->unauthenticated_.Remove(unauth_it_);
      --server_->unauthenticated_count_;
      authenticated_ = true;  // out of the list
    }
    server_->Remove(this);
  }

  // Where this session waits in server_->waiters_, if it does.
  bool registered_ = false;
  int64_t wait_generation_ = 0;
  std::string wait_key_;

 private:
  void DropPending() {
    if (!pending_) return;
    pending_.reset();
    --server_->pending_waits_;
  }

  void AccountHeld() {
    int64_t held = static_cast<int64_t>(reader_.held());
    server_->buffered_bytes_ += held - held_;
    held_ = held;
  }

  Impl* server_;
  tcp::socket sock_;
  asio::steady_timer timer_;  // authentication timeout, then the waiting request's timeout
  uint64_t timer_seq_ = 0;
  store_wire::FrameReader reader_;
  int64_t held_ = 0;
  std::string out_;
  bool authenticated_ = false;
  bool closed_ = false;
  bool reading_ = false;  // an async_wait for readability is armed
  bool busy_ = false;     // a request is being answered (waiting or written)
  PreAuthQueue<Session*>::Handle unauth_it_;
  std::optional<KvTable::Request> pending_;
  size_t wait_index_ = 0;  // pending_->keys before it are set
};

Status TcpStoreServer::Impl::Listen(const std::string& host, uint16_t port) {
  StatusOr<std::vector<tcp::endpoint>> eps =
      Resolve(host, std::to_string(port == 0 ? 1 : port), "store server");
  if (!eps.ok()) return eps.status();
  tcp::endpoint ep((*eps)[0].address(), port);
  error_code ec;
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return UnavailableError("store server: cannot listen on " + host + ":" + std::to_string(port) +
                            ": " + ec.message());
  }
  host_ = host;
  port_ = acceptor_.local_endpoint(ec).port();
  // The process's descriptors are shared with the coordinator (or the training worker) that
  // hosts this store: strangers that never authenticate get at most an eighth of them.
  const int64_t files = OpenFileLimit();
  max_connections_ =
      std::max<int64_t>(1, std::min<int64_t>(options_.max_connections,
                                             files == INT64_MAX ? INT64_MAX : files - kFdReserve));
  unauthenticated_.set_cap(PreAuthCap(max_connections_, files));
  Accept();
  thread_ = std::thread([this] { io_.run(); });
  return Status::Ok();
}

TcpStoreServer::Impl::~Impl() {
  asio::post(io_, [this] {
    stopping_ = true;
    error_code ec;
    acceptor_.close(ec);
    accept_backoff_.cancel();
    std::vector<std::shared_ptr<Session>> sessions;
    for (const auto& [p, s] : sessions_) sessions.push_back(s);
    for (const auto& s : sessions) s->Close();
  });
  if (thread_.joinable()) thread_.join();
}

void TcpStoreServer::Impl::Accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket sock) {
    if (stopping_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      ++accept_errors_;
      const int e = ec.value();
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        // Out of descriptors: free one held by a stranger, and wait before the next try
        // instead of spinning on a listener that stays readable.
        DropOldestUnauthenticated();
        accept_backoff_.expires_after(kAcceptBackoff);
        accept_backoff_.async_wait([this](error_code ec2) {
          if (!ec2 && !stopping_) Accept();
        });
        return;
      }
      return Accept();  // e.g. the peer reset before we accepted
    }
    OnAccepted(std::move(sock));
    Accept();
  });
}

void TcpStoreServer::Impl::OnAccepted(tcp::socket sock) {
  if (static_cast<int64_t>(sessions_.size()) >= max_connections_ && !DropOldestUnauthenticated()) {
    ++refused_;
    error_code ec;
    sock.close(ec);  // at the cap and everyone authenticated: the newcomer is refused
    return;
  }
  if (unauthenticated_.full()) DropOldestUnauthenticated();
  error_code ignored;
  sock.set_option(tcp::no_delay(true), ignored);
  auto s = std::make_shared<Session>(this, std::move(sock));
  sessions_.emplace(s.get(), s);
  connections_.store(static_cast<int64_t>(sessions_.size()));
  ++unauthenticated_count_;
  s->Start(unauthenticated_.Add(s.get()));
}

bool TcpStoreServer::Impl::DropOldestUnauthenticated() {
  if (unauthenticated_.empty()) return false;
  ++refused_;
  Session* oldest = unauthenticated_.oldest();
  oldest->Close();
  return true;
}

void TcpStoreServer::Impl::Execute(Session* s, KvTable::Request request, int64_t timeout_ms) {
  size_t missing = 0;
  std::optional<KvTable::Response> r = table_->TryApply(request, &missing);
  if (!r) return s->Park(std::move(request), missing, timeout_ms);
  s->Respond(*r, false);
  if (r->status.ok()) Wake(request);
}

void TcpStoreServer::Impl::Wake(const KvTable::Request& mutation) {
  if (mutation.op == KvTable::Op::kAdvance) return WakeOlderThan(table_->min_generation());
  if (!Mutates(mutation.op) || mutation.keys.size() != 1) return;
  auto gen = waiters_.find(mutation.generation);
  if (gen == waiters_.end()) return;
  auto it = gen->second.find(mutation.keys[0]);
  if (it == gen->second.end()) return;
  std::unordered_set<Session*> woken = std::move(it->second);
  gen->second.erase(it);
  if (gen->second.empty()) waiters_.erase(gen);
  for (Session* w : woken) w->registered_ = false;
  for (Session* w : woken) w->RetryPending();  // may register again under its next key
}

void TcpStoreServer::Impl::WakeOlderThan(int64_t min_generation) {
  std::vector<Session*> woken;
  auto end = waiters_.lower_bound(min_generation);
  for (auto g = waiters_.begin(); g != end; ++g) {
    for (auto& [key, set] : g->second) {
      for (Session* w : set) {
        w->registered_ = false;
        woken.push_back(w);
      }
    }
  }
  waiters_.erase(waiters_.begin(), end);
  for (Session* w : woken) w->RetryPending();  // kAborted
}

void TcpStoreServer::Impl::Register(Session* s, int64_t generation, const std::string& key) {
  Unregister(s);
  waiters_[generation][key].insert(s);
  s->registered_ = true;
  s->wait_generation_ = generation;
  s->wait_key_ = key;
}

void TcpStoreServer::Impl::Unregister(Session* s) {
  if (!s->registered_) return;
  s->registered_ = false;
  auto gen = waiters_.find(s->wait_generation_);
  if (gen == waiters_.end()) return;
  auto it = gen->second.find(s->wait_key_);
  if (it == gen->second.end()) return;
  it->second.erase(s);
  if (it->second.empty()) gen->second.erase(it);
  if (gen->second.empty()) waiters_.erase(gen);
}

void TcpStoreServer::Impl::Remove(Session* s) {
  sessions_.erase(s);
  connections_.store(static_cast<int64_t>(sessions_.size()));
}

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const std::string& host,
                                                                uint16_t port, std::string token) {
  return Start(host, port, std::move(token), TcpStoreServerOptions{});
}

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(
    const std::string& host, uint16_t port, std::string token,
    const TcpStoreServerOptions& options) {
  if (token.empty()) {
    return InvalidArgumentError("store server: the job token is empty (set MORPH_TOKEN)");
  }
  if (token.size() + 4 > store_wire::kMaxHelloBytes) {
    return InvalidArgumentError("store server: the job token has " + std::to_string(token.size()) +
                                " bytes, more than " +
                                std::to_string(store_wire::kMaxHelloBytes - 4));
  }
  auto impl = std::make_unique<Impl>(std::move(token), options);
  MORPH_RETURN_IF_ERROR(impl->Listen(host, port));
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpStoreServer::~TcpStoreServer() = default;
uint16_t TcpStoreServer::port() const { return impl_->port_; }
std::string TcpStoreServer::address() const {
  const std::string& h = impl_->host_;
  bool v6 = h.find(':') != std::string::npos;
  return (v6 ? "[" + h + "]" : h) + ":" + std::to_string(impl_->port_);
}
const std::shared_ptr<KvTable>& TcpStoreServer::table() const { return impl_->table_; }
int TcpStoreServer::connections() const { return static_cast<int>(impl_->connections_.load()); }

TcpStoreServerStats TcpStoreServer::stats() const {
  TcpStoreServerStats s;
  s.connections = impl_->connections_.load();
  s.unauthenticated = impl_->unauthenticated_count_.load();
  s.pending_waits = impl_->pending_waits_.load();
  s.buffered_bytes = impl_->buffered_bytes_.load();
  s.waiter_checks = impl_->waiter_checks_.load();
  s.refused_connections = impl_->refused_.load();
  s.accept_errors = impl_->accept_errors_.load();
  return s;
}

void TcpStoreServer::AdvanceGeneration(int64_t generation) {
  if (generation <= impl_->table_->min_generation()) return;
  impl_->table_->TryApply(
      {.op = KvTable::Op::kAdvance, .generation = generation, .number = generation});
  Impl* impl = impl_.get();
  asio::post(impl->io_, [impl] { impl->WakeOlderThan(impl->table_->min_generation()); });
}

// ---- client ---------------------------------------------------------------------------------
class TcpStoreClient::Conn {
 public:
  // Runs the io_context until `done` or the deadline; on the deadline closes the socket.
  bool RunUntil(Deadline deadline, const bool& done) {
    io_.restart();
    while (!done) {
      size_t n = deadline.IsInfinite() ? io_.run_one() : io_.run_one_until(deadline.when());
      if (n == 0 && !done) {
        error_code ec;
        sock_.close(ec);
        io_.restart();
        io_.run();  // lets the cancelled handlers finish
        return false;
      }
    }
    return true;
  }

  Status ConnectOnce(const tcp::endpoint& ep, Deadline deadline) {
    bool done = false;
    error_code result;
    sock_.async_connect(ep, [&](error_code ec) {
      result = ec;
      done = true;
    });
    if (!RunUntil(deadline, done)) {
      return DeadlineExceededError("connecting to store server " + Describe(ep));
    }
    if (result) {
      error_code ec;
      sock_.close(ec);
      return NetError(result, "connecting to store server " + Describe(ep));
    }
    error_code ignored;
    sock_.set_option(tcp::no_delay(true), ignored);
    return Status::Ok();
  }

  Status RoundTrip(const std::string& body, KvTable::Response& response, Deadline deadline) {
    std::string frame = Frame(body);
    bool done = false;
    error_code result;
    uint8_t header[4];
    std::string reply;
    asio::async_write(sock_, asio::buffer(frame), [&](error_code ec, size_t) {
      if (ec) {
        result = ec;
        done = true;
        return;
      }
      asio::async_read(sock_, asio::buffer(header, 4), [&](error_code ec2, size_t) {
        if (ec2) {
          result = ec2;
          done = true;
          return;
        }
        uint32_t n = 0;
        for (int i = 0; i < 4; ++i) n |= uint32_t{header[i]} << (8 * i);
        if (n > kMaxResponseFrame) {
          result = asio::error::message_size;
          done = true;
          return;
        }
        reply.resize(n);
        asio::async_read(sock_, asio::buffer(reply), [&](error_code ec3, size_t) {
          result = ec3;
          done = true;
        });
      });
    });
    if (!RunUntil(deadline, done)) {
      return DeadlineExceededError("store server did not answer in time");
    }
    if (result) return NetError(result, "store server connection");
    StatusOr<KvTable::Response> decoded = DecodeResponse(reply);
    if (!decoded.ok()) return InternalError(decoded.status().message());
    response = *std::move(decoded);
    return Status::Ok();
  }

  static std::string Describe(const tcp::endpoint& ep) {
    return ep.address().to_string() + ":" + std::to_string(ep.port());
  }

  asio::io_context io_;
  tcp::socket sock_{io_};
};

struct TcpStoreClient::Resolved {
  std::vector<tcp::endpoint> endpoints;
};

namespace {

// One connection attempt per endpoint (the first that accepts) plus authentication.
StatusOr<std::unique_ptr<TcpStoreClient::Conn>> Dial(const std::vector<tcp::endpoint>& eps,
                                                     const std::string& token, Deadline deadline) {
  Status last = UnavailableError("no address to connect to");
  for (const tcp::endpoint& ep : eps) {
    auto conn = std::make_unique<TcpStoreClient::Conn>();
    last = conn->ConnectOnce(ep, deadline);
    if (last.code() == StatusCode::kUnavailable) continue;  // refused: the next address
    MORPH_RETURN_IF_ERROR(last);
    KvTable::Response r;
    MORPH_RETURN_IF_ERROR(conn->RoundTrip(store_wire::EncodeHello(token), r, deadline))
        << "authenticating";
    if (!r.status.ok()) return r.status;
    return conn;
  }
  return last;
}

}  // namespace

StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(const std::string& address,
                                                                  std::string token,
                                                                  int64_t generation,
                                                                  Deadline deadline) {
  MORPH_ASSIGN_OR_RETURN(HostPort hp, SplitHostPort("store address", address));
  MORPH_ASSIGN_OR_RETURN(std::vector<tcp::endpoint> eps,
                         Resolve(hp.host, hp.port, "store address '" + address + "'"));
  auto resolved = std::make_shared<Resolved>(Resolved{std::move(eps)});
  return ConnectTo(address, std::move(resolved), std::move(token), generation, deadline);
}

StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::ConnectTo(
    const std::string& address, std::shared_ptr<const Resolved> resolved, std::string token,
    int64_t generation, Deadline deadline) {
  auto backoff = std::chrono::milliseconds(2);
  while (true) {
    StatusOr<std::unique_ptr<Conn>> conn = Dial(resolved->endpoints, token, deadline);
    if (conn.ok()) {
      return std::unique_ptr<TcpStoreClient>(new TcpStoreClient(
          address, std::move(resolved), std::move(token), generation, *std::move(conn)));
    }
    // Refused or reset (server not up yet, listen backlog full, connection cap): retry until
    // the deadline.
    if (conn.status().code() != StatusCode::kUnavailable) return conn.status();
    if (deadline.Remaining() < backoff) {
      return conn.status().WithContext("store server " + address + " not reachable in time");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

TcpStoreClient::TcpStoreClient(std::string address, std::shared_ptr<const Resolved> resolved,
                               std::string token, int64_t generation, std::unique_ptr<Conn> conn)
    : address_(std::move(address)),
      resolved_(std::move(resolved)),
      token_(std::move(token)),
      generation_(generation),
      idle_() {
  idle_.push_back(std::move(conn));
}

TcpStoreClient::~TcpStoreClient() = default;

StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::ForGeneration(int64_t generation,
                                                                        Deadline deadline) const {
  return ConnectTo(address_, resolved_, token_, generation, deadline);
}
KvTable::Response TcpStoreClient::Execute(KvTable::Request request, Deadline deadline) {
  request.generation = generation_;
  KvTable::Response r;
  // Calls from several threads proceed concurrently, each on a connection of its own (a
  // blocked Get must not hold up another thread's Set, or ranks could wait on each other).
  std::unique_ptr<Conn> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      conn = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  if (conn == nullptr) {
    // No idle connection (a previous call broke it, or all are busy): one fresh attempt, no
    // retries, so that a dead server is reported promptly.
    StatusOr<std::unique_ptr<Conn>> dialed = Dial(resolved_->endpoints, token_, deadline);
    if (!dialed.ok()) {
      r.status = dialed.status().WithContext("store server " + address_);
      return r;
    }
    conn = *std::move(dialed);
  }
  int64_t timeout_ms = deadline.RemainingMs();
  Deadline net_deadline = deadline.IsInfinite() ? deadline : Deadline(deadline.when() + kGrace);
  Status s = conn->RoundTrip(EncodeRequest(request, timeout_ms), r, net_deadline);
  if (!s.ok()) {
    r = KvTable::Response{};
    r.status = s.WithContext("store server " + address_);
    return r;  // the connection is dropped
  }
  // The server closes the connection after a request it cannot decode or that exceeds its
  // frame limit (both kInvalidArgument); redial next time rather than reuse it.
  if (r.status.code() == StatusCode::kInvalidArgument) return r;
  std::lock_guard<std::mutex> lock(mu_);
  idle_.push_back(std::move(conn));
  return r;
}

}  // namespace morph
