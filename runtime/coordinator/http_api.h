// The scheduler API's request layer (docs/design.md §4, docs/operations.md "Scheduler API"):
// everything about the coordinator's HTTP endpoints that needs no socket. It parses and
// validates resize bodies into a ResizeRequest, checks the job token, maps a Status to an HTTP
// reply, and renders /v1/status (JSON) and /metrics (Prometheus text) from a snapshot of the
// coordinator. The I/O shell (http_server.h) calls these; tests call them directly.
//
//   StatusOr<ResizeCall> call = ParseResizeBody(R"({"world_size": 8})", /*max_world=*/64);
//   if (!call.ok()) return ReplyForStatus(call.status());   // 400 {"error":..., "field":...}
//   std::string metrics = RenderMetrics(snapshot);
//
// Errors follow the decider's convention: a Status whose message starts with "<field>: " names
// the field; ReplyForStatus puts it into the reply's "field" member.
//
// Pure functions on values; any thread.
#ifndef MORPH_RUNTIME_COORDINATOR_HTTP_API_H_
#define MORPH_RUNTIME_COORDINATOR_HTTP_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "morph/parallel_config.h"
#include "morph/status.h"
#include "runtime/coordinator/decider.h"
#include "runtime/protocol/messages.h"

namespace morph {

// A validated POST /v1/resize body.
struct ResizeCall {
  ResizeRequest request;  // request_id is left 0: the server numbers requests
  // How long the scheduler is willing to wait for the change (ms), if it said.
  std::optional<int64_t> deadline_ms;
};

// Parses a resize body: a JSON object with either "world_size" (integer in [1, max_world]) or
// "add" (integer in [0, max_world]) and/or "remove" (array of distinct non-negative worker
// ids), plus optional "deadline_ms" (non-negative integer) and "reason" (string, at most
// 1,024 bytes). kInvalidArgument "<field>: ..." for malformed JSON ("body: ..."), a body that
// is not an object, a duplicate key, an unknown field, a wrong type or a value out of range.
StatusOr<ResizeCall> ParseResizeBody(std::string_view body, int max_world);

// True when `authorization` is "Bearer <token>" with exactly `token`. The comparison takes
// the same time whatever the position of the first difference (the store's TokensEqual). Always
// false for an empty `token` (no token configured: nothing is authorized).
bool TokenMatches(std::string_view authorization, std::string_view token);

// An HTTP reply, before framing.
struct ApiReply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::string allow;  // the Allow header of a 405
};

// The HTTP status for a Status code: OK 202 (a resize is accepted, the change runs on),
// kInvalidArgument 400, kUnauthenticated 401, kPermissionDenied 403, kNotFound 404,
// kFailedPrecondition and kAborted 409, kResourceExhausted 413, kUnavailable 503,
// kDeadlineExceeded 504, anything else 500.
int HttpStatusFor(StatusCode code);
// {"error": "<message>", "code": "INVALID_ARGUMENT", "field": "<field>"} ("field" only when
// the message names one of the API's fields) with HttpStatusFor(status.code()).
ApiReply ReplyForStatus(const Status& status);
// 202 {"request_id": N, "status": "accepted"}.
ApiReply AcceptedReply(int64_t request_id);

enum class Endpoint { kResize, kStatus, kMetrics };
// Which endpoint a request line names (the query string is ignored). 404 for an unknown path,
// 405 (with Allow) for a known path with another method.
StatusOr<Endpoint> RouteRequest(std::string_view method, std::string_view target,
                                ApiReply* error_reply);

// What the coordinator shows of itself; built on the I/O thread from the decider and the
// coordinator's own bookkeeping.
struct ReconfigurationRecord {
  int64_t from_generation = 0;
  int64_t to_generation = 0;
  int from_world = 0;
  int to_world = 0;
  // Phase durations in milliseconds (docs/design.md §3): agreeing on the change, building
  // communicators, planning the reshard, moving state, resuming; total wall time; and how
  // long training stalled (steps not running).
  double agree_ms = 0, communicators_ms = 0, plan_ms = 0, transfer_ms = 0, resume_ms = 0,
         total_ms = 0, stall_ms = 0;
  std::string explanation;  // the config planner's reason for the new configuration
};
struct CoordinatorSnapshot {
  struct Member {
    int rank = 0;
    WorkerId worker = 0;
    std::string host;
  };
  int64_t generation = 0;  // id of the current generation; 0 before the first
  std::string phase;       // DeciderPhaseName
  ParallelConfig config;
  std::vector<Member> members;  // rank order
  std::vector<WorkerId> standby;
  int64_t step = 0;  // the current generation's step (Coordinator: its members' least heartbeat)
  bool resize_in_progress = false;
  std::optional<int64_t> pending_generation;
  int64_t reconfigurations = 0;  // completed changes since the coordinator started
  std::optional<ReconfigurationRecord> last_reconfiguration;
};

// The part of a snapshot the decider knows (generation, phase, config, members without hosts,
// standby, resize state, explanation of the current config); the caller adds the rest.
CoordinatorSnapshot SnapshotOf(const Decider& decider);

// GET /v1/status: the snapshot as a JSON object (docs/operations.md lists the members).
std::string RenderStatusJson(const CoordinatorSnapshot& snapshot);
// GET /metrics: Prometheus text exposition format 0.0.4, one HELP and TYPE line per family.
std::string RenderMetrics(const CoordinatorSnapshot& snapshot);
inline constexpr std::string_view kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_HTTP_API_H_
