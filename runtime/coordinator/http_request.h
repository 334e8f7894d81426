// The scheduler API's request handling without a socket (docs/operations.md "Scheduler API"):
// the Beast parser with the server's limits, the reply for a request that cannot be read, and
// what a complete request asks for (route, authorization, body validation). HttpServer
// (http_server.h) runs these on its connections; the fuzz target
// (runtime/coordinator/fuzz/http_request_fuzz.cc) runs them on raw bytes.
//
//   HttpRequestParser parser;
//   LimitRequestParser(parser, options);
//   ... read the header (http::async_read_header: n bytes), then the body ...
//   if (!ec) ec = CheckHeaderSize(n, options);
//   if (ec) { if (auto reply = ReplyForReadError(ec, options)) Send(*reply); Close(); }
//   RequestDecision d = DecideRequest(parser.get(), options);
//   switch (d.action) { case RequestDecision::Action::kResize: Submit(d.resize); ... }
//
// Pure functions; any thread.
#ifndef MORPH_RUNTIME_COORDINATOR_HTTP_REQUEST_H_
#define MORPH_RUNTIME_COORDINATOR_HTTP_REQUEST_H_

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/system/error_code.hpp>
#include <optional>

#include "runtime/coordinator/http_api.h"
#include "runtime/coordinator/http_server.h"

namespace morph {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpRequestParser = boost::beast::http::request_parser<boost::beast::http::string_body>;

// Applies `options`' header and body limits to a parser that has not parsed anything yet.
void LimitRequestParser(HttpRequestParser& parser, const HttpServerOptions& options);

// http::error::header_limit when a request's header (request line and fields, as the parser
// consumed them) is larger than options.max_header_bytes, else success. Beast 1.74's
// header_limit bounds the request line and the fields each on its own when the whole header
// is in the buffer at the first parse, so the server checks the total it read here.
boost::system::error_code CheckHeaderSize(size_t header_bytes, const HttpServerOptions& options);

// The reply for a request whose reading failed with `ec`: 413 for a body over
// max_body_bytes, 431 for headers over max_header_bytes, 400 naming Beast's reason for a
// request it cannot parse (bad method, target, version, header, chunk). std::nullopt when there
// is nobody to answer (end of stream, reset, timeout, any error outside HTTP parsing): close.
std::optional<ApiReply> ReplyForReadError(const boost::system::error_code& ec,
                                          const HttpServerOptions& options);

// What a complete request asks for: a reply to send at once (404/405 for an unknown target or
// method; 403 when a call needs the token and the server has none; 401 without "Authorization:
// Bearer <token>" or with another token; ParseResizeBody's 400 for a bad resize body), the
// status or metrics page (after the token check when options.token_for_reads), or a validated
// and authorized resize to submit (its request_id is left 0).
struct RequestDecision {
  enum class Action { kReply, kStatus, kMetrics, kResize };
  Action action = Action::kReply;
  ApiReply reply;     // kReply
  ResizeCall resize;  // kResize
};
RequestDecision DecideRequest(const HttpRequest& request, const HttpServerOptions& options);

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_HTTP_REQUEST_H_
