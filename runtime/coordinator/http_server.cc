#include "runtime/coordinator/http_server.h"

#include <glog/logging.h>

#include <array>
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "base/connection_limit.h"
#include "base/params.h"
#include "runtime/coordinator/http_request.h"

namespace morph {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

}  // namespace

class HttpSession;

struct HttpServer::Core : std::enable_shared_from_this<HttpServer::Core> {
  Core(asio::io_context& io_in, HttpServerOptions options_in, Callbacks callbacks_in)
      : io(io_in),
        options(std::move(options_in)),
        callbacks(std::move(callbacks_in)),
        acceptor(io_in),
        accept_backoff(io_in) {}

  void Accept();

  asio::io_context& io;
  HttpServerOptions options;
  Callbacks callbacks;
  tcp::acceptor acceptor;
  asio::steady_timer accept_backoff;  // after an accept error such as EMFILE
  WarningLimiter accept_warnings;     // one line per 10 s under a flood
  uint16_t port = 0;
  bool started = false;
  bool stopped = false;
  uint64_t next_session_id = 0;
  Stats stats;
  std::map<uint64_t, std::weak_ptr<HttpSession>> sessions;
};

// One connection: read a request (bounded, timed), answer it, repeat while keep-alive.
class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(std::shared_ptr<HttpServer::Core> core, tcp::socket sock, uint64_t id)
      : core_(std::move(core)), stream_(std::move(sock)), answer_timer_(core_->io), id_(id) {
    ++core_->stats.open_connections;
  }
  ~HttpSession() {
    --core_->stats.open_connections;
    core_->sessions.erase(id_);
  }

  void Read() {
    if (core_->stopped || closed_) return;
    parser_.emplace();
    LimitRequestParser(*parser_, core_->options);
    stream_.expires_after(core_->options.read_timeout);
    // The header first, to check its whole size (CheckHeaderSize), then the body.
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](error_code ec, size_t header_bytes) {
                              self->OnHeader(ec, header_bytes);
                            });
  }

  void Close() {
    closed_ = true;
    error_code ec;
    answer_timer_.cancel();
    stream_.socket().close(ec);
  }

 private:
  void OnHeader(error_code ec, size_t header_bytes) {
    if (closed_) return;
    if (!ec) ec = CheckHeaderSize(header_bytes, core_->options);
    if (ec || parser_->is_done()) return OnRead(ec);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(error_code ec) {
    if (closed_) return;
    if (ec == http::error::end_of_stream || ec == asio::error::connection_reset ||
        ec == asio::error::eof || ec == asio::error::operation_aborted) {
      return Close();
    }
    if (ec == beast::error::timeout) {
      // The stream closed the socket; an idle keep-alive connection ends the same way.
      ++core_->stats.timeouts;
      VLOG(1) << "scheduler API: connection dropped after the read timeout";
      return Close();
    }
    if (ec) {
      std::optional<ApiReply> reply = ReplyForReadError(ec, core_->options);
      if (reply) return Reply(*std::move(reply), /*keep_alive=*/false);
      return Close();
    }
    Handle(parser_->release());
  }

  void Handle(HttpRequest req) {
    keep_alive_ = req.keep_alive();
    const HttpServerOptions& o = core_->options;
    RequestDecision d = DecideRequest(req, o);
    switch (d.action) {
      case RequestDecision::Action::kReply:
        return Reply(std::move(d.reply), keep_alive_);
      case RequestDecision::Action::kStatus:
        return Reply({.status = 200, .body = RenderStatusJson(core_->callbacks.snapshot())},
                     keep_alive_);
      case RequestDecision::Action::kMetrics:
        return Reply({.status = 200,
                      .content_type = std::string(kMetricsContentType),
                      .body = RenderMetrics(core_->callbacks.snapshot())},
                     keep_alive_);
      case RequestDecision::Action::kResize:
        break;
    }
    ResizeCall call = std::move(d.resize);
    uint64_t seq = ++answer_seq_;
    awaiting_ = true;
    std::weak_ptr<HttpSession> weak = weak_from_this();
    auto once = std::make_shared<std::atomic<bool>>(false);
    asio::io_context& io = core_->io;
    // Posted: an answer given inside the callback arrives after request_id_ is set.
    HttpServer::Answer answer = [weak, seq, once, &io](Status s) {
      if (once->exchange(true)) return;
      asio::post(io, [weak, seq, s = std::move(s)]() mutable {
        if (auto self = weak.lock()) self->OnAnswer(seq, std::move(s));
      });
    };
    request_id_ = core_->callbacks.resize(std::move(call), std::move(answer));
    answer_timer_.expires_after(o.answer_timeout);
    answer_timer_.async_wait([self = shared_from_this(), seq](error_code ec) {
      if (ec) return;
      self->OnAnswer(seq, DeadlineExceededError("the coordinator did not answer resize request " +
                                                std::to_string(self->request_id_) +
                                                " in time; it may still be carried out"));
    });
  }

  void OnAnswer(uint64_t seq, Status s) {
    if (closed_ || !awaiting_ || seq != answer_seq_) return;
    awaiting_ = false;
    answer_timer_.cancel();
    Reply(s.ok() ? AcceptedReply(request_id_) : ReplyForStatus(s), keep_alive_);
  }

  void Reply(ApiReply reply, bool keep_alive) {
    if (closed_) return;
    res_ = {};
    res_.version(11);
    res_.result(static_cast<unsigned>(reply.status));
    res_.set(http::field::server, "morph");
    res_.set(http::field::content_type, reply.content_type);
    res_.set(http::field::cache_control, "no-store");
    if (!reply.allow.empty()) res_.set(http::field::allow, reply.allow);
    if (reply.status == 401) res_.set(http::field::www_authenticate, "Bearer");
    res_.keep_alive(keep_alive);
    res_.body() = std::move(reply.body);
    res_.prepare_payload();
    stream_.expires_after(core_->options.write_timeout);
    http::async_write(stream_, res_, [self = shared_from_this()](error_code ec, size_t) {
      if (ec) {
        if (ec == beast::error::timeout) ++self->core_->stats.timeouts;
        return self->Close();
      }
      if (!self->res_.keep_alive()) return self->LingeringClose();
      self->Read();
    });
  }

  // After a reply that ends the connection (413, a parse error, Connection: close): stop
  // sending, then read and discard what the client still sends, for a bounded time and
  // amount. Closing with unread bytes would make the kernel send a reset, and the client
  // could lose our reply before reading it.
  void LingeringClose() {
    error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(kLingerTime);
    Drain();
  }
  void Drain() {
    if (closed_) return;
    stream_.async_read_some(asio::buffer(drain_),
                            [self = shared_from_this()](error_code ec, size_t n) {
                              self->drained_ += n;
                              if (ec || self->drained_ > kLingerBytes) return self->Close();
                              self->Drain();
                            });
  }
  static constexpr std::chrono::milliseconds kLingerTime{1000};
  static constexpr size_t kLingerBytes = 16 << 20;

  std::shared_ptr<HttpServer::Core> core_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<HttpRequestParser> parser_;
  http::response<http::string_body> res_;
  asio::steady_timer answer_timer_;
  uint64_t id_;
  uint64_t answer_seq_ = 0;
  bool awaiting_ = false;
  int64_t request_id_ = 0;  // the coordinator's id of the resize being answered
  bool keep_alive_ = true;
  bool closed_ = false;
  std::array<char, 16 * 1024> drain_;
  size_t drained_ = 0;
};

void HttpServer::Core::Accept() {
  acceptor.async_accept([self = shared_from_this()](error_code ec, tcp::socket sock) {
    if (self->stopped) return;
    if (ec) {
      if (ec == asio::error::operation_aborted) return;
      if (int64_t folded = 0; self->accept_warnings.Allow(&folded)) {
        LOG(WARNING) << "scheduler API: accept failed: " << ec.message()
                     << "; retrying every 100 ms" << Folded(folded);
      }
      self->accept_backoff.expires_after(std::chrono::milliseconds(100));
      self->accept_backoff.async_wait([self](error_code ec2) {
        if (!ec2 && !self->stopped) self->Accept();
      });
      return;
    }
    if (self->stats.open_connections >= self->options.max_connections) {
      ++self->stats.connections_rejected;
      error_code ignored;
      sock.close(ignored);
    } else {
      ++self->stats.connections_accepted;
      uint64_t id = ++self->next_session_id;
      auto session = std::make_shared<HttpSession>(self, std::move(sock), id);
      self->sessions[id] = session;
      session->Read();
    }
    self->Accept();
  });
}

StatusOr<HttpServerOptions> HttpServerOptions::FromEnv() {
  HttpServerOptions o;
  MORPH_ASSIGN_OR_RETURN(o.address, params::ApiAddr());
  MORPH_ASSIGN_OR_RETURN(int64_t port, params::ApiPort());
  o.port = static_cast<uint16_t>(port);
  MORPH_ASSIGN_OR_RETURN(o.token_for_reads, params::ApiTokenForReads());
  return o;
}

HttpServer::HttpServer(asio::io_context& io, HttpServerOptions options, Callbacks callbacks)
    : core_(std::make_shared<Core>(io, std::move(options), std::move(callbacks))) {}

HttpServer::~HttpServer() { Stop(); }

Status HttpServer::Start() {
  Core& c = *core_;
  if (c.started) return FailedPreconditionError("scheduler API: already started");
  if (!c.callbacks.resize || !c.callbacks.snapshot) {
    return InvalidArgumentError("scheduler API: both callbacks (resize, snapshot) are required");
  }
  error_code ec;
  asio::ip::address addr = asio::ip::make_address(c.options.address, ec);
  if (ec) {
    return InvalidArgumentError("MORPH_API_ADDR: \"" + c.options.address +
                                "\" is not an IP address: " + ec.message());
  }
  tcp::endpoint ep(addr, c.options.port);
  auto fail = [&](std::string_view what) {
    error_code ignored;
    c.acceptor.close(ignored);
    return UnavailableError("scheduler API: " + std::string(what) + " " + c.options.address + ":" +
                            std::to_string(c.options.port) + ": " + ec.message());
  };
  if (c.acceptor.open(ep.protocol(), ec)) return fail("open");
  if (c.acceptor.set_option(tcp::acceptor::reuse_address(true), ec)) return fail("reuse_address");
  if (c.acceptor.bind(ep, ec)) return fail("bind");
  if (c.acceptor.listen(asio::socket_base::max_listen_connections, ec)) return fail("listen");
  c.port = c.acceptor.local_endpoint(ec).port();
  if (ec) return fail("local_endpoint");
  c.started = true;
  c.Accept();
  return Status::Ok();
}

void HttpServer::Stop() {
  Core& c = *core_;
  if (c.stopped) return;
  c.stopped = true;
  error_code ignored;
  c.acceptor.close(ignored);
  c.accept_backoff.cancel();
  auto sessions = c.sessions;  // Close may end a session and erase it
  for (auto& [id, weak] : sessions) {
    if (auto s = weak.lock()) s->Close();
  }
}

uint16_t HttpServer::port() const { return core_->port; }

HttpServer::Stats HttpServer::stats() const { return core_->stats; }

}  // namespace morph
