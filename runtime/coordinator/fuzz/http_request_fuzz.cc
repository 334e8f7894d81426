// libFuzzer target for the scheduler API's request handling (runtime/coordinator/http_request.h,
// http_api.h): the bytes a client sends the coordinator's HTTP port, through the same Beast
// parser, limits and decisions as HttpServer, up to 8 pipelined requests per input; and the
// same bytes as a resize body for ParseResizeBody. Checks, beyond "no crash, no sanitizer
// report":
//   - a parsed request never has a header longer than max_header_bytes nor a body longer than
//     max_body_bytes (chunked or not);
//   - a request that cannot be read gets 400, 413 or 431, or no reply (the connection closes);
//   - a complete request's reply is a 4xx error; a resize is submitted only with exactly
//     "Authorization: Bearer <token>", a read with token_for_reads likewise;
//   - a resize body ParseResizeBody accepts keeps its values in range, and the call written
//     back as JSON parses to the same call (round trip).
// The first input byte picks the server's settings: bit 0 token_for_reads, bit 1 no token.
//
//   make fuzz                           # every target, FUZZ_SECONDS each
//   ctest -R http_fuzz                  # 60 s, from runtime/coordinator/fuzz/corpus/
#include <boost/asio/buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "runtime/coordinator/http_request.h"

namespace {

using namespace morph;
namespace http = boost::beast::http;
using json = nlohmann::json;

constexpr char kToken[] = "fuzz-token";
constexpr int kMaxWorld = 64;

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "http_request_fuzz: invariant broken: %s\n", what);
    std::abort();
  }
}

// The call as a resize body, the way a scheduler would write it.
std::string ToJson(const ResizeCall& c) {
  json j = json::object();
  if (c.request.world_size) j["world_size"] = *c.request.world_size;
  if (c.request.add != 0) j["add"] = c.request.add;
  if (!c.request.remove.empty()) j["remove"] = c.request.remove;
  if (!c.request.reason.empty()) j["reason"] = c.request.reason;
  if (c.deadline_ms) j["deadline_ms"] = *c.deadline_ms;
  try {
    return j.dump();
  } catch (const json::exception&) {
    Require(false, "an accepted reason is valid UTF-8");
  }
  return {};
}

void CheckResizeCall(const ResizeCall& c) {
  const ResizeRequest& r = c.request;
  Require(r.request_id == 0, "request id left to the server");
  Require(!r.world_size || (*r.world_size >= 1 && *r.world_size <= kMaxWorld), "world_size range");
  Require(r.add >= 0 && r.add <= kMaxWorld, "add range");
  for (WorkerId w : r.remove) Require(w >= 0, "remove: non-negative ids");
  Require(r.reason.size() <= 1024, "reason length");
  Require(!c.deadline_ms || *c.deadline_ms >= 0, "deadline_ms non-negative");
  StatusOr<ResizeCall> again = ParseResizeBody(ToJson(c), kMaxWorld);
  Require(again.ok(), "a re-encoded resize body parses");
  Require(again->request.world_size == r.world_size && again->request.add == r.add &&
              again->request.remove == r.remove && again->request.reason == r.reason &&
              again->deadline_ms == c.deadline_ms,
          "resize body round trip");
}

void CheckBody(std::string_view body) {
  StatusOr<ResizeCall> call = ParseResizeBody(body, kMaxWorld);
  if (!call.ok()) {
    Require(call.status().code() == StatusCode::kInvalidArgument, "resize body error code");
    ApiReply r = ReplyForStatus(call.status());
    Require(r.status == 400, "a bad resize body is 400");
    return;
  }
  CheckResizeCall(*call);
}

bool IsError(int status) { return status >= 400 && status < 500; }

// Parses requests from `data` as HttpServer's connection would, one after another while they
// keep the connection alive.
void CheckRequests(std::string_view data, const HttpServerOptions& o) {
  for (int i = 0; i < 8; ++i) {
    HttpRequestParser parser;
    LimitRequestParser(parser, o);
    boost::system::error_code ec;
    // http::read's loop: feed what there is; at the end of the bytes, the end of the stream.
    // The header first (not eager), to measure it; then the body.
    size_t header_bytes = 0;
    bool header_seen = false;
    while (!parser.is_done()) {
      if (data.empty()) {
        if (!parser.got_some()) return;  // nothing more: the peer closed between requests
        parser.put_eof(ec);
        if (!ec && !parser.is_done()) ec = http::error::partial_message;
        break;
      }
      size_t used = parser.put(boost::asio::buffer(data.data(), data.size()), ec);
      data.remove_prefix(used);
      if (!header_seen) header_bytes += used;
      if (!header_seen && parser.is_header_done()) {
        header_seen = true;
        if (!ec) ec = CheckHeaderSize(header_bytes, o);  // as the server does after the header
        if (ec) break;
        parser.eager(true);
      }
      if (ec == http::error::need_more) {
        ec = {};
        if (used == 0) data = {};  // Beast wants more than there is: the stream ends here
        continue;
      }
      if (ec) break;
    }
    if (ec) {
      std::optional<ApiReply> reply = ReplyForReadError(ec, o);
      Require(!reply || reply->status == 400 || reply->status == 413 || reply->status == 431,
              "read error reply is 400, 413 or 431");
      Require(
          !(header_seen && header_bytes > o.max_header_bytes) || (reply && reply->status == 431),
          "a header over max_header_bytes is 431");
      return;
    }
    const HttpRequest& req = parser.get();
    Require(header_bytes <= o.max_header_bytes, "header within max_header_bytes");
    Require(req.body().size() <= o.max_body_bytes, "body within max_body_bytes");
    RequestDecision d = DecideRequest(req, o);
    auto auth = req[http::field::authorization];
    bool authorized =
        !o.token.empty() && std::string_view(auth.data(), auth.size()) == "Bearer " + o.token;
    switch (d.action) {
      case RequestDecision::Action::kReply:
        Require(IsError(d.reply.status), "an immediate reply is a 4xx error");
        Require(d.reply.status != 405 || !d.reply.allow.empty(), "405 says what is allowed");
        break;
      case RequestDecision::Action::kStatus:
      case RequestDecision::Action::kMetrics:
        Require(!o.token_for_reads || authorized, "reads need the token when configured");
        break;
      case RequestDecision::Action::kResize:
        Require(authorized, "a resize is submitted only with the token");
        CheckResizeCall(d.resize);
        break;
    }
    if (!req.keep_alive()) return;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size == 0) return 0;
  std::string_view data(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  HttpServerOptions o;
  o.token = (bytes[0] & 2) ? "" : kToken;
  o.token_for_reads = (bytes[0] & 1) != 0;
  o.max_world = kMaxWorld;
  // Small limits, so that inputs of a few KiB reach them.
  o.max_header_bytes = 1024;
  o.max_body_bytes = 512;
  CheckBody(data);
  CheckRequests(data, o);
  return 0;
}
