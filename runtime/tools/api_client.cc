#include "runtime/tools/api_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <nlohmann/json.hpp>
#include <utility>

#include "base/params.h"
#include "collectives/tcp_store.h"

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
    } else if (ec == http::error::body_limit || ec == http::error::header_limit ||
               ec.category() == http::make_error_code(http::error::bad_version).category()) {
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
  tcp::resolver resolver(io);
  asio::steady_timer resolve_timer(io);
  if (!ec) {
    std::vector<tcp::endpoint> eps{tcp::endpoint(ip, endpoint_.port)};
    stream.expires_after(timeout_);
    stream.async_connect(eps, on_connect);
  } else {
    bool resolve_timed_out = false;
    resolve_timer.expires_after(timeout_);
    resolve_timer.async_wait([&](error_code tec) {
      if (tec) return;
      resolve_timed_out = true;
      resolver.cancel();
    });
    resolver.async_resolve(endpoint_.host, std::to_string(endpoint_.port),
                           [&](error_code rec, tcp::resolver::results_type results) {
                             resolve_timer.cancel();
                             if (resolve_timed_out) {
                               return fail(beast::error::timeout, "resolving");
                             }
                             if (rec) return fail(rec, "resolving");
                             stream.expires_after(timeout_);
                             stream.async_connect(results, on_connect);
                           });
  }
  io.run();
  MORPH_RETURN_IF_ERROR(result);
  return out;
}

}  // namespace morph
