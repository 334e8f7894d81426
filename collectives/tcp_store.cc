#include "collectives/tcp_store.h"

#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "base/params.h"

namespace morph {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

constexpr uint32_t kMaxFrame = 64u << 20;
// How long a client waits past its own deadline for the server's "timed out" answer.
constexpr auto kGrace = std::chrono::seconds(2);

// ---- encoding -------------------------------------------------------------------------------
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutStr(std::string& out, std::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool U8(uint8_t& v) {
    if (data_.size() < 1) return false;
    v = static_cast<uint8_t>(data_[0]);
    data_.remove_prefix(1);
    return true;
  }
  bool U32(uint32_t& v) {
    if (data_.size() < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(data_[i])} << (8 * i);
    data_.remove_prefix(4);
    return true;
  }
  bool I64(int64_t& v) {
    if (data_.size() < 8) return false;
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u |= uint64_t{static_cast<uint8_t>(data_[i])} << (8 * i);
    v = static_cast<int64_t>(u);
    data_.remove_prefix(8);
    return true;
  }
  bool Str(std::string& s) {
    uint32_t n = 0;
    if (!U32(n) || data_.size() < n) return false;
    s.assign(data_.substr(0, n));
    data_.remove_prefix(n);
    return true;
  }
  bool done() const { return data_.empty(); }

 private:
  std::string_view data_;
};

std::string Frame(std::string_view body) {
  std::string out;
  out.reserve(body.size() + 4);
  PutU32(out, static_cast<uint32_t>(body.size()));
  out.append(body);
  return out;
}

std::string EncodeRequest(const KvTable::Request& r, int64_t timeout_ms) {
  std::string out;
  out.push_back(static_cast<char>(r.op));
  PutU64(out, static_cast<uint64_t>(r.generation));
  PutU64(out, static_cast<uint64_t>(timeout_ms));
  PutU32(out, static_cast<uint32_t>(r.keys.size()));
  for (const std::string& k : r.keys) PutStr(out, k);
  PutStr(out, r.value);
  out.push_back(r.expected.has_value() ? 1 : 0);
  PutStr(out, r.expected.value_or(""));
  PutU64(out, static_cast<uint64_t>(r.number));
  return out;
}

bool DecodeRequest(std::string_view body, KvTable::Request& r, int64_t& timeout_ms) {
  Reader in(body);
  uint8_t op = 0, has_expected = 0;
  uint32_t nkeys = 0;
  std::string expected;
  if (!in.U8(op) || op < 1 || op > static_cast<uint8_t>(KvTable::Op::kAdvance)) return false;
  r.op = static_cast<KvTable::Op>(op);
  if (!in.I64(r.generation) || !in.I64(timeout_ms) || !in.U32(nkeys)) return false;
  if (nkeys > body.size()) return false;
  r.keys.resize(nkeys);
  for (std::string& k : r.keys) {
    if (!in.Str(k)) return false;
  }
  if (!in.Str(r.value) || !in.U8(has_expected) || !in.Str(expected) || !in.I64(r.number)) {
    return false;
  }
  if (has_expected) r.expected = std::move(expected);
  return in.done();
}

std::string EncodeResponse(const KvTable::Response& r) {
  std::string out;
  out.push_back(static_cast<char>(r.status.code()));
  PutStr(out, r.status.message());
  PutStr(out, r.value);
  PutU64(out, static_cast<uint64_t>(r.number));
  return out;
}

bool DecodeResponse(std::string_view body, KvTable::Response& r) {
  Reader in(body);
  uint8_t code = 0;
  std::string message;
  if (!in.U8(code) || code > static_cast<uint8_t>(StatusCode::kUnauthenticated)) return false;
  if (!in.Str(message) || !in.Str(r.value) || !in.I64(r.number) || !in.done()) return false;
  r.status = Status(static_cast<StatusCode>(code), message);
  return true;
}

bool TokensEqual(std::string_view a, std::string_view b) {
  // Constant time in the content, so the token cannot be guessed byte by byte.
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

StatusOr<tcp::endpoint> ParseAddress(const std::string& address) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgumentError("store address '" + address + "': expected host:port");
  }
  std::string host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::string port_text = address.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port < 1 || port > 65535) {
    return InvalidArgumentError("store address '" + address + "': bad port '" + port_text + "'");
  }
  error_code ec;
  asio::ip::address ip = asio::ip::make_address(host, ec);
  if (ec) {
    return InvalidArgumentError("store address '" + address + "': host '" + host +
                                "' is not an IP address");
  }
  return tcp::endpoint(ip, static_cast<uint16_t>(port));
}

// Every network failure (refused, reset, closed by the server) means "not reachable now".
Status NetError(const error_code& ec, std::string_view what) {
  return UnavailableError(std::string(what) + ": " + ec.message());
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

// ---- server ---------------------------------------------------------------------------------
class TcpStoreServer::Impl {
 public:
  class Session;

  Impl(std::string token) : token_(std::move(token)) {}
  ~Impl();

  Status Listen(const std::string& host, uint16_t port) {
    error_code ec;
    asio::ip::address ip = asio::ip::make_address(host, ec);
    if (ec) return InvalidArgumentError("store server host '" + host + "' is not an IP address");
    tcp::endpoint ep(ip, port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return UnavailableError("store server: cannot listen on " + host + ":" +
                              std::to_string(port) + ": " + ec.message());
    }
    host_ = host;
    port_ = acceptor_.local_endpoint(ec).port();
    Accept();
    thread_ = std::thread([this] { io_.run(); });
    return Status::Ok();
  }

  void Accept();

  // After a mutation: answers the blocked requests that can now proceed.
  void RetryPending();

  void Remove(const std::shared_ptr<Session>& s) {
    sessions_.erase(s);
    connections_.store(static_cast<int>(sessions_.size()));
  }

  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  std::string token_;
  std::string host_;
  uint16_t port_ = 0;
  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
  std::set<std::shared_ptr<Session>> sessions_;  // io thread only
  std::atomic<int> connections_{0};
  bool stopping_ = false;  // io thread only
  std::thread thread_;
};

class TcpStoreServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Impl* server, tcp::socket sock)
      : server_(server), sock_(std::move(sock)), timer_(server->io_) {}

  void ReadHeader() {
    asio::async_read(sock_, asio::buffer(header_, 4),
                     [self = shared_from_this()](error_code ec, size_t) {
                       if (ec) return self->Close();
                       uint32_t n = 0;
                       for (int i = 0; i < 4; ++i) n |= uint32_t{self->header_[i]} << (8 * i);
                       if (n > kMaxFrame) return self->Close();
                       self->body_.resize(n);
                       self->ReadBody();
                     });
  }

  void ReadBody() {
    asio::async_read(sock_, asio::buffer(body_),
                     [self = shared_from_this()](error_code ec, size_t) {
                       if (ec) return self->Close();
                       self->Handle();
                     });
  }

  void Handle() {
    if (!authenticated_) {
      Reader in(body_);
      std::string token;
      KvTable::Response r;
      if (!in.Str(token) || !in.done() || !TokensEqual(token, server_->token_)) {
        r.status = UnauthenticatedError("store: the job token was refused");
        return Respond(r, /*close_after=*/true);
      }
      authenticated_ = true;
      return Respond(r, false);
    }
    KvTable::Request request;
    int64_t timeout_ms = 0;
    if (!DecodeRequest(body_, request, timeout_ms)) {
      KvTable::Response r;
      r.status = InvalidArgumentError("store: malformed request of " +
                                      std::to_string(body_.size()) + " bytes");
      return Respond(r, true);
    }
    std::optional<KvTable::Response> r = server_->table_->TryApply(request);
    if (r) {
      Respond(*r, false);
      server_->RetryPending();
      return;
    }
    pending_ = std::move(request);
    uint64_t seq = ++pending_seq_;
    timer_.expires_after(std::chrono::milliseconds(std::max<int64_t>(0, timeout_ms)));
    timer_.async_wait([self = shared_from_this(), seq](error_code ec) {
      if (ec || !self->pending_ || self->pending_seq_ != seq) return;
      KvTable::Response timed_out = self->server_->table_->TimedOut(*self->pending_);
      self->pending_.reset();
      self->Respond(timed_out, false);
    });
  }

  void RetryPending() {
    if (!pending_) return;
    std::optional<KvTable::Response> r = server_->table_->TryApply(*pending_);
    if (!r) return;
    pending_.reset();
    ++pending_seq_;
    timer_.cancel();
    Respond(*r, false);
  }

  void Respond(const KvTable::Response& r, bool close_after) {
    out_ = Frame(EncodeResponse(r));
    asio::async_write(sock_, asio::buffer(out_),
                      [self = shared_from_this(), close_after](error_code ec, size_t) {
                        if (ec || close_after) return self->Close();
                        self->ReadHeader();
                      });
  }

  void Close() {
    error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
    timer_.cancel();
    pending_.reset();
    server_->Remove(shared_from_this());
  }

 private:
  Impl* server_;
  tcp::socket sock_;
  asio::steady_timer timer_;
  uint8_t header_[4] = {};
  std::string body_;
  std::string out_;
  bool authenticated_ = false;
  std::optional<KvTable::Request> pending_;
  uint64_t pending_seq_ = 0;
};

TcpStoreServer::Impl::~Impl() {
  asio::post(io_, [this] {
    stopping_ = true;
    error_code ec;
    acceptor_.close(ec);
    auto sessions = sessions_;
    for (const auto& s : sessions) s->Close();
  });
  if (thread_.joinable()) thread_.join();
}

void TcpStoreServer::Impl::Accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket sock) {
    if (stopping_) return;
    if (!ec) {
      error_code ignored;
      sock.set_option(tcp::no_delay(true), ignored);
      auto s = std::make_shared<Session>(this, std::move(sock));
      sessions_.insert(s);
      connections_.store(static_cast<int>(sessions_.size()));
      s->ReadHeader();
    }
    Accept();
  });
}

void TcpStoreServer::Impl::RetryPending() {
  auto sessions = sessions_;
  for (const auto& s : sessions) s->RetryPending();
}

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const std::string& host,
                                                                uint16_t port, std::string token) {
  if (token.empty()) {
    return InvalidArgumentError("store server: the job token is empty (set MORPH_TOKEN)");
  }
  auto impl = std::make_unique<Impl>(std::move(token));
  MORPH_RETURN_IF_ERROR(impl->Listen(host, port));
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpStoreServer::~TcpStoreServer() = default;
uint16_t TcpStoreServer::port() const { return impl_->port_; }
std::string TcpStoreServer::address() const {
  return impl_->host_ + ":" + std::to_string(impl_->port_);
}
const std::shared_ptr<KvTable>& TcpStoreServer::table() const { return impl_->table_; }
int TcpStoreServer::connections() const { return impl_->connections_.load(); }

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
        if (n > kMaxFrame) {
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
    if (!DecodeResponse(reply, response)) {
      return InternalError("store: malformed response of " + std::to_string(reply.size()) +
                           " bytes");
    }
    return Status::Ok();
  }

  static std::string Describe(const tcp::endpoint& ep) {
    return ep.address().to_string() + ":" + std::to_string(ep.port());
  }

  asio::io_context io_;
  tcp::socket sock_{io_};
};

namespace {

// One connection attempt plus authentication.
StatusOr<std::unique_ptr<TcpStoreClient::Conn>> Dial(const tcp::endpoint& ep,
                                                     const std::string& token, Deadline deadline) {
  auto conn = std::make_unique<TcpStoreClient::Conn>();
  MORPH_RETURN_IF_ERROR(conn->ConnectOnce(ep, deadline));
  std::string hello;
  PutStr(hello, token);
  KvTable::Response r;
  MORPH_RETURN_IF_ERROR(conn->RoundTrip(hello, r, deadline)) << "authenticating";
  if (!r.status.ok()) return r.status;
  return conn;
}

}  // namespace

StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(const std::string& address,
                                                                  std::string token,
                                                                  int64_t generation,
                                                                  Deadline deadline) {
  MORPH_ASSIGN_OR_RETURN(tcp::endpoint ep, ParseAddress(address));
  auto backoff = std::chrono::milliseconds(2);
  while (true) {
    StatusOr<std::unique_ptr<Conn>> conn = Dial(ep, token, deadline);
    if (conn.ok()) {
      return std::unique_ptr<TcpStoreClient>(
          new TcpStoreClient(address, std::move(token), generation, *std::move(conn)));
    }
    // Refused or reset (server not up yet, listen backlog full): retry until the deadline.
    if (conn.status().code() != StatusCode::kUnavailable) return conn.status();
    if (deadline.Remaining() < backoff) {
      return conn.status().WithContext("store server " + address + " not reachable in time");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

TcpStoreClient::TcpStoreClient(std::string address, std::string token, int64_t generation,
                               std::unique_ptr<Conn> conn)
    : address_(std::move(address)), token_(std::move(token)), generation_(generation), idle_() {
  idle_.push_back(std::move(conn));
}

TcpStoreClient::~TcpStoreClient() = default;

StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::ForGeneration(int64_t generation,
                                                                        Deadline deadline) const {
  return Connect(address_, token_, generation, deadline);
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
    StatusOr<tcp::endpoint> ep = ParseAddress(address_);
    if (!ep.ok()) {
      r.status = ep.status();
      return r;
    }
    StatusOr<std::unique_ptr<Conn>> dialed = Dial(*ep, token_, deadline);
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
  std::lock_guard<std::mutex> lock(mu_);
  idle_.push_back(std::move(conn));
  return r;
}


}  // namespace morph
