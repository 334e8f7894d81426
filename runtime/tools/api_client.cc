#include "runtime/tools/api_client.h"

#include <netdb.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>
#include <vector>

#include "base/params.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

constexpr size_t kMaxReplyBytes = 16 << 20;

std::string Trim(std::string_view s) {
  size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string_view::npos ? "" : std::string(s.substr(b, e - b + 1));
}

// The system resolver on a thread of its own, waited for at most `timeout`: getaddrinfo cannot
// be cancelled, so on a timeout the thread is left to finish by itself (its result dropped).
StatusOr<std::vector<tcp::endpoint>> ResolveWithin(const std::string& host, uint16_t port,
                                                   std::chrono::milliseconds timeout) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    int rc = 0;
    std::vector<tcp::endpoint> endpoints;
  };
  auto shared = std::make_shared<Shared>();
  const std::string where = host + ":" + std::to_string(port);
  std::thread([shared, host, port] {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    std::vector<tcp::endpoint> eps;
    for (addrinfo* a = res; rc == 0 && a != nullptr; a = a->ai_next) {
      if (a->ai_family == AF_INET || a->ai_family == AF_INET6) {
        tcp::endpoint ep;
        std::memcpy(ep.data(), a->ai_addr, a->ai_addrlen);
        ep.resize(a->ai_addrlen);
        eps.push_back(ep);
      }
    }
    if (res != nullptr) freeaddrinfo(res);
    std::lock_guard<std::mutex> lock(shared->mu);
    shared->done = true;
    shared->rc = rc;
    shared->endpoints = std::move(eps);
    shared->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mu);
  if (!shared->cv.wait_for(lock, timeout, [&] { return shared->done; })) {
    return DeadlineExceededError("resolving " + where + ": no answer within " +
                                 std::to_string(timeout.count()) + " ms");
  }
  if (shared->rc != 0) {
    return UnavailableError("resolving " + where + ": " + gai_strerror(shared->rc));
  }
  if (shared->endpoints.empty()) return UnavailableError("resolving " + where + ": no address");
  return shared->endpoints;
}

}  // namespace

StatusOr<ApiEndpoint> ApiEndpoint::ParseAddress(std::string_view address, std::string_view what) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(std::string(what) + ": \"" + std::string(address) + "\" " +
                                std::string(why) + " (expected host:port)");
  };
  size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) return bad("has no port");
  std::string_view host = address.substr(0, colon), port_text = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string_view::npos) {
    return bad("is an IPv6 address without brackets");
  }
  if (host.empty()) return bad("has no host");
  int port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port < 1 || port > 65535) {
    return bad("has no port in [1, 65535]");
  }
  ApiEndpoint ep;
  ep.host = std::string(host);
  ep.port = static_cast<uint16_t>(port);
  return ep;
}

StatusOr<ApiEndpoint> ApiEndpoint::Resolve(std::optional<std::string> addr,
                                           std::optional<std::string> token) {
  ApiEndpoint ep;
  if (addr) {
    MORPH_ASSIGN_OR_RETURN(ep, ParseAddress(*addr, "--addr"));
  } else {
    MORPH_ASSIGN_OR_RETURN(ep.host, params::ApiAddr());
    MORPH_ASSIGN_OR_RETURN(int64_t port, params::ApiPort());
    if (port == 0) {
      return InvalidArgumentError(
          "no scheduler API address: pass --addr host:port or set MORPH_API_PORT (and "
          "MORPH_API_ADDR unless it is 127.0.0.1)");
    }
    // A coordinator listening on every address is reached on loopback.
    if (ep.host == "0.0.0.0") ep.host = "127.0.0.1";
    if (ep.host == "::") ep.host = "::1";
    ep.port = static_cast<uint16_t>(port);
  }
  if (token) {
    if (token->empty()) return InvalidArgumentError("--token: empty");
    ep.token = *std::move(token);
  } else {
    StatusOr<std::string> env_token = JobTokenFromEnv();
    if (env_token.ok()) {
      ep.token = *std::move(env_token);
    } else if (env_token.status().code() != StatusCode::kFailedPrecondition) {  // not "none set"
      return env_token.status();
    }
  }
  return ep;
}

std::string ApiEndpoint::ToString() const {
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::string ServerMessage(const ApiResponse& response) {
  nlohmann::json j = nlohmann::json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error") && j["error"].is_string()) {
    return j["error"].get<std::string>();
  }
  std::string body = Trim(response.body);
  if (!body.empty()) return body.size() > 2000 ? body.substr(0, 2000) + "..." : body;
  return std::string(http::obsolete_reason(static_cast<http::status>(response.status)));
}

StatusOr<ApiResponse> ApiClient::Get(std::string_view target) const {
  return Request(false, target, "");
}

StatusOr<ApiResponse> ApiClient::Post(std::string_view target, std::string_view body) const {
  return Request(true, target, body);
}

StatusOr<ApiResponse> ApiClient::Request(bool post, std::string_view target,
                                         std::string_view body) const {
  const std::string where = endpoint_.ToString();
  asio::io_context io;
  beast::tcp_stream stream(io);
  http::request<http::string_body> req{post ? http::verb::post : http::verb::get,
                                       std::string(target), 11};
  req.set(http::field::host, endpoint_.host);
  req.set(http::field::user_agent, "morphctl");
  req.set(http::field::connection, "close");
  if (!endpoint_.token.empty()) {
    req.set(http::field::authorization, "Bearer " + endpoint_.token);
  }
  if (post) {
    req.set(http::field::content_type, "application/json");
    req.body() = std::string(body);
  }
  req.prepare_payload();
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(kMaxReplyBytes);

  Status result = InternalError("scheduler API request did not complete");
  ApiResponse out;
  auto fail = [&](error_code ec, std::string_view step) {
    std::string what = std::string(step) + " " + where + ": ";
    if (ec == beast::error::timeout || ec == asio::error::timed_out) {
      result = DeadlineExceededError(what + "no answer within " + std::to_string(timeout_.count()) +
                                     " ms");
    } else if (ec.category() == http::make_error_code(http::error::bad_version).category() &&
               ec.value() != static_cast<int>(http::error::end_of_stream) &&
               ec.value() != static_cast<int>(http::error::partial_message)) {
      // Beast's parse errors (body or header limit, bad version, ...): the peer is no HTTP
      // server we understand. A connection closed before or during the reply is Unavailable.
      result = DataLossError(what + "not a valid HTTP reply: " + ec.message());
    } else {
      result = UnavailableError(what + ec.message());
    }
  };
  auto on_read = [&](error_code ec, size_t) {
    if (ec) return fail(ec, "reading the reply from");
    auto& res = parser.get();
    out.status = static_cast<int>(res.result_int());
    out.content_type = std::string(res[http::field::content_type]);
    out.body = std::move(res.body());
    result = Status::Ok();
    error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  };
  auto on_write = [&](error_code ec, size_t) {
    if (ec) return fail(ec, "sending the request to");
    stream.expires_after(timeout_);
    http::async_read(stream, buffer, parser, on_read);
  };
  auto on_connect = [&](error_code ec, const tcp::endpoint&) {
    if (ec) return fail(ec, "connecting to");
    stream.expires_after(timeout_);
    http::async_write(stream, req, on_write);
  };

  error_code ec;
  asio::ip::address ip = asio::ip::make_address(endpoint_.host, ec);
  std::vector<tcp::endpoint> eps;
  if (!ec) {
    eps.emplace_back(ip, endpoint_.port);
  } else {
    MORPH_ASSIGN_OR_RETURN(eps, ResolveWithin(endpoint_.host, endpoint_.port, timeout_));
  }
  stream.expires_after(timeout_);
  stream.async_connect(eps, on_connect);
  io.run();
  MORPH_RETURN_IF_ERROR(result);
  return out;
}

}  // namespace morph
