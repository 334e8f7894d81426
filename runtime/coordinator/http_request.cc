#include "runtime/coordinator/http_request.h"

#include <boost/beast/http/error.hpp>
#include <string>
#include <string_view>

namespace morph {

namespace http = boost::beast::http;

void LimitRequestParser(HttpRequestParser& parser, const HttpServerOptions& options) {
  parser.header_limit(static_cast<uint32_t>(options.max_header_bytes));
  parser.body_limit(options.max_body_bytes);
}

boost::system::error_code CheckHeaderSize(size_t header_bytes, const HttpServerOptions& options) {
  if (header_bytes > options.max_header_bytes) return http::error::header_limit;
  return {};
}

std::optional<ApiReply> ReplyForReadError(const boost::system::error_code& ec,
                                          const HttpServerOptions& options) {
  if (!ec || ec == http::error::end_of_stream) return std::nullopt;
  if (ec == http::error::body_limit) {
    return ReplyForStatus(ResourceExhaustedError(
        "body: larger than " + std::to_string(options.max_body_bytes) + " bytes"));
  }
  if (ec == http::error::header_limit) {
    ApiReply r = ReplyForStatus(InvalidArgumentError(
        "headers: larger than " + std::to_string(options.max_header_bytes) + " bytes"));
    r.status = 431;
    return r;
  }
  // A request Beast cannot parse (bad method, target, version, header, chunk): 400.
  if (ec.category() == http::make_error_code(http::error::bad_target).category()) {
    return ReplyForStatus(InvalidArgumentError("request: " + ec.message()));
  }
  return std::nullopt;
}

RequestDecision DecideRequest(const HttpRequest& req, const HttpServerOptions& o) {
  RequestDecision d;
  auto reply = [&](ApiReply r) {
    d.action = RequestDecision::Action::kReply;
    d.reply = std::move(r);
    return d;
  };
  ApiReply error;
  StatusOr<Endpoint> endpoint =
      RouteRequest(std::string_view(req.method_string().data(), req.method_string().size()),
                   std::string_view(req.target().data(), req.target().size()), &error);
  if (!endpoint.ok()) return reply(std::move(error));
  auto authorization = req[http::field::authorization];
  std::string_view auth(authorization.data(), authorization.size());
  bool needs_token = *endpoint == Endpoint::kResize || o.token_for_reads;
  if (needs_token) {
    if (o.token.empty()) {
      return reply(ReplyForStatus(
          PermissionDeniedError("Authorization: the coordinator has no job token (MORPH_TOKEN or "
                                "MORPH_TOKEN_FILE), so this call is disabled")));
    }
    if (auth.empty()) {
      return reply(ReplyForStatus(UnauthenticatedError(
          "Authorization: missing; send \"Authorization: Bearer <job token>\"")));
    }
    if (!TokenMatches(auth, o.token)) {
      return reply(ReplyForStatus(
          UnauthenticatedError("Authorization: not \"Bearer <job token>\" with this job's token")));
    }
  }
  switch (*endpoint) {
    case Endpoint::kStatus:
      d.action = RequestDecision::Action::kStatus;
      return d;
    case Endpoint::kMetrics:
      d.action = RequestDecision::Action::kMetrics;
      return d;
    case Endpoint::kResize:
      break;
  }
  StatusOr<ResizeCall> call = ParseResizeBody(req.body(), o.max_world);
  if (!call.ok()) return reply(ReplyForStatus(call.status()));
  d.action = RequestDecision::Action::kResize;
  d.resize = *std::move(call);
  return d;
}

}  // namespace morph
