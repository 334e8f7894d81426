#include "runtime/coordinator/http_api.h"

#include <array>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "collectives/store/store_protocol.h"

namespace morph {
namespace {

using json = nlohmann::json;

constexpr std::array<std::string_view, 5> kResizeFields = {"world_size", "add", "remove",
                                                           "deadline_ms", "reason"};
constexpr int kMaxDepth = 4;

// "add: ..." -> "add" when it is one of the API's fields (or "body" / "token").
std::string FieldOf(std::string_view message) {
  size_t colon = message.find(':');
  if (colon == std::string_view::npos) return "";
  std::string_view head = message.substr(0, colon);
  for (std::string_view f : kResizeFields) {
    if (head == f) return std::string(f);
  }
  if (head == "body" || head == "Authorization" || head == "request" || head == "headers") {
    return std::string(head);
  }
  return "";
}

std::string TypeName(const json& v) {
  if (v.is_number_float()) return "a non-integer number";
  if (v.is_number()) return "an integer";
  return std::string("a ") + v.type_name();
}

// An integer member within [lo, hi]; kInvalidArgument naming `field` otherwise.
StatusOr<int64_t> IntegerField(const json& v, std::string_view field, int64_t lo, int64_t hi) {
  std::string f(field);
  if (!v.is_number_integer()) {
    return InvalidArgumentError(f + ": must be an integer, got " + TypeName(v));
  }
  if (v.is_number_unsigned() &&
      v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return InvalidArgumentError(f + ": does not fit in 64 bits, got " + v.dump());
  }
  int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) {
    return InvalidArgumentError(f + ": must be in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], got " + std::to_string(x));
  }
  return x;
}

std::string Seconds(double ms) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6f", ms / 1000.0);
  return buf;
}

}  // namespace

StatusOr<ResizeCall> ParseResizeBody(std::string_view body, int max_world) {
  // nlohmann keeps the last of duplicate keys; a parser callback sees every key, so track the
  // keys of each open object and remember the first duplicate.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  bool too_deep = false;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxDepth) too_deep = true;
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() &&
            !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json doc;
  try {
    doc = json::parse(body.begin(), body.end(), callback);
  } catch (const json::exception& e) {
    // e.what(): "[json.exception.parse_error.101] parse error at line 1, column 9: ..."
    std::string what = e.what();
    size_t at = what.find("] ");
    return InvalidArgumentError("body: not valid JSON: " +
                                (at == std::string::npos ? what : what.substr(at + 2)));
  }
  if (too_deep) {
    return InvalidArgumentError("body: nested deeper than " + std::to_string(kMaxDepth));
  }
  if (!duplicate.empty()) {
    return InvalidArgumentError(
        (FieldOf(duplicate + ":").empty() ? std::string("body") : duplicate) +
        ": duplicate key \"" + duplicate + "\"");
  }
  if (!doc.is_object()) {
    return InvalidArgumentError("body: must be a JSON object, got " + TypeName(doc));
  }
  for (const auto& [key, value] : doc.items()) {
    bool known = false;
    for (std::string_view f : kResizeFields) known = known || key == f;
    if (!known) {
      return InvalidArgumentError("body: unknown field \"" + key +
                                  "\" (expected world_size, add, remove, deadline_ms, reason)");
    }
  }
  ResizeCall call;
  ResizeRequest& r = call.request;
  // Only the JSON's shape and types here; the values are ValidateResize's, as for every door.
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (auto it = doc.find("world_size"); it != doc.end()) {
    MORPH_ASSIGN_OR_RETURN(r.world_size, IntegerField(*it, "world_size", kMin, kMax));
  }
  if (auto it = doc.find("add"); it != doc.end()) {
    MORPH_ASSIGN_OR_RETURN(r.add, IntegerField(*it, "add", kMin, kMax));
  }
  if (auto it = doc.find("remove"); it != doc.end()) {
    if (!it->is_array()) {
      return InvalidArgumentError("remove: must be an array of worker ids, got " + TypeName(*it));
    }
    for (size_t i = 0; i < it->size(); ++i) {
      const json& e = (*it)[i];
      if (!e.is_number_integer() ||
          (e.is_number_unsigned() && e.get<uint64_t>() > static_cast<uint64_t>(kMax))) {
        return InvalidArgumentError("remove: element " + std::to_string(i) +
                                    " must be a non-negative integer worker id, got " + e.dump());
      }
      r.remove.push_back(e.get<int64_t>());
    }
  }
  if (auto it = doc.find("deadline_ms"); it != doc.end()) {
    MORPH_ASSIGN_OR_RETURN(
        int64_t d, IntegerField(*it, "deadline_ms", 0, std::numeric_limits<int64_t>::max()));
    call.deadline_ms = d;
  }
  if (auto it = doc.find("reason"); it != doc.end()) {
    if (!it->is_string()) {
      return InvalidArgumentError("reason: must be a string, got " + TypeName(*it));
    }
    r.reason = it->get<std::string>();
  }
  MORPH_RETURN_IF_ERROR(ValidateResize(r, max_world));
  return call;
}

bool TokenMatches(std::string_view authorization, std::string_view token) {
  constexpr std::string_view kBearer = "Bearer ";
  if (token.empty()) return false;
  if (authorization.size() < kBearer.size() || authorization.substr(0, kBearer.size()) != kBearer) {
    return false;
  }
  return store_wire::TokensEqual(authorization.substr(kBearer.size()), token);
}

int HttpStatusFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return 202;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return 400;
    case StatusCode::kUnauthenticated:
      return 401;
    case StatusCode::kPermissionDenied:
      return 403;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kFailedPrecondition:
    case StatusCode::kAborted:
    case StatusCode::kAlreadyExists:
      return 409;
    case StatusCode::kResourceExhausted:
      return 413;
    case StatusCode::kUnavailable:
      return 503;
    case StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

ApiReply ReplyForStatus(const Status& status) {
  ApiReply reply;
  reply.status = HttpStatusFor(status.code());
  json j;
  j["error"] = std::string(status.message());
  j["code"] = std::string(StatusCodeName(status.code()));
  std::string field = FieldOf(status.message());
  if (!field.empty()) j["field"] = field;
  // Replace: worker-supplied text (a reason, a host) must not make dump() throw.
  reply.body = j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  return reply;
}

ApiReply AcceptedReply(int64_t request_id) {
  ApiReply reply;
  reply.status = 202;
  reply.body = json{{"request_id", request_id}, {"status", "accepted"}}.dump() + "\n";
  return reply;
}

StatusOr<Endpoint> RouteRequest(std::string_view method, std::string_view target,
                                ApiReply* error_reply) {
  std::string_view path = target.substr(0, target.find('?'));
  struct Route {
    std::string_view path, method;
    Endpoint endpoint;
  };
  static constexpr Route kRoutes[] = {{"/v1/resize", "POST", Endpoint::kResize},
                                      {"/v1/status", "GET", Endpoint::kStatus},
                                      {"/metrics", "GET", Endpoint::kMetrics}};
  for (const Route& r : kRoutes) {
    if (path != r.path) continue;
    if (method == r.method) return r.endpoint;
    Status s = InvalidArgumentError("method " + std::string(method) + " not allowed on " +
                                    std::string(path) + " (use " + std::string(r.method) + ")");
    *error_reply = ReplyForStatus(s);
    error_reply->status = 405;
    error_reply->allow = std::string(r.method);
    return s;
  }
  Status s = NotFoundError("no endpoint " + std::string(path) +
                           " (endpoints: POST /v1/resize, GET /v1/status, GET /metrics)");
  *error_reply = ReplyForStatus(s);
  return s;
}

CoordinatorSnapshot SnapshotOf(const Decider& decider) {
  CoordinatorSnapshot s;
  const Generation& g = decider.current();
  s.generation = g.id;
  s.phase = std::string(DeciderPhaseName(decider.phase()));
  s.config = g.config;
  for (size_t r = 0; r < g.ranks.size(); ++r) {
    s.members.push_back({static_cast<int>(r), g.ranks[r], ""});
  }
  s.standby = decider.standby();
  s.step = g.start_step;
  s.resize_in_progress = decider.resize_in_progress();
  if (decider.pending()) s.pending_generation = decider.pending()->id;
  return s;
}

std::string RenderStatusJson(const CoordinatorSnapshot& s) {
  json j;
  j["generation"] = s.generation;
  j["phase"] = s.phase;
  j["world_size"] = s.members.size();
  j["config"] = {{"dp", s.config.dp},
                 {"tp", s.config.tp},
                 {"pp", s.config.pp},
                 {"zero", s.config.zero_stage},
                 {"micro_batches", s.config.micro_batches}};
  json members = json::array();
  for (const auto& m : s.members) {
    members.push_back({{"rank", m.rank}, {"worker", m.worker}, {"host", m.host}});
  }
  j["members"] = std::move(members);
  j["standby"] = s.standby;
  j["step"] = s.step;
  j["resize_in_progress"] = s.resize_in_progress;
  j["pending_generation"] = s.pending_generation ? json(*s.pending_generation) : json(nullptr);
  j["reconfigurations"] = s.reconfigurations;
  if (s.last_reconfiguration) {
    const ReconfigurationRecord& r = *s.last_reconfiguration;
    j["last_reconfiguration"] = {{"from_generation", r.from_generation},
                                 {"to_generation", r.to_generation},
                                 {"from_world", r.from_world},
                                 {"to_world", r.to_world},
                                 {"phases_ms",
                                  {{"agree", r.agree_ms},
                                   {"communicators", r.communicators_ms},
                                   {"plan", r.plan_ms},
                                   {"transfer", r.transfer_ms},
                                   {"resume", r.resume_ms}}},
                                 {"total_ms", r.total_ms},
                                 {"stall_ms", r.stall_ms},
                                 {"explanation", r.explanation}};
  } else {
    j["last_reconfiguration"] = nullptr;
  }
  return j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string RenderMetrics(const CoordinatorSnapshot& s) {
  std::string out;
  auto family = [&](std::string_view name, std::string_view type, std::string_view help) {
    out += "# HELP ";
    out += name;
    out += ' ';
    out += help;
    out += "\n# TYPE ";
    out += name;
    out += ' ';
    out += type;
    out += '\n';
  };
  auto sample = [&](std::string_view name, std::string_view labels, const std::string& value) {
    out += name;
    out += labels;
    out += ' ';
    out += value;
    out += '\n';
  };
  auto gauge = [&](std::string_view name, std::string_view help, int64_t value) {
    family(name, "gauge", help);
    sample(name, "", std::to_string(value));
  };
  gauge("morph_generation", "Id of the job's current generation (0 before the first).",
        s.generation);
  gauge("morph_world_size", "Ranks in the current generation.",
        static_cast<int64_t>(s.members.size()));
  gauge("morph_dp", "Data-parallel degree of the current configuration.", s.config.dp);
  gauge("morph_tp", "Tensor-parallel degree of the current configuration.", s.config.tp);
  gauge("morph_pp", "Pipeline-parallel degree of the current configuration.", s.config.pp);
  gauge("morph_zero_stage", "ZeRO stage of the current configuration.", s.config.zero_stage);
  gauge("morph_step", "Latest training step reported.", s.step);
  gauge("morph_standby_workers", "Connected workers that hold no rank.",
        static_cast<int64_t>(s.standby.size()));
  gauge("morph_resize_in_progress", "1 while an accepted resize has not completed.",
        s.resize_in_progress ? 1 : 0);
  family("morph_reconfigurations_total", "counter",
         "Reconfigurations completed since the coordinator started.");
  sample("morph_reconfigurations_total", "", std::to_string(s.reconfigurations));
  family("morph_last_reconfiguration_seconds", "gauge",
         "Duration of the last reconfiguration by phase (total: wall time, stall: training "
         "stopped).");
  if (s.last_reconfiguration) {
    const ReconfigurationRecord& r = *s.last_reconfiguration;
    const std::pair<std::string_view, double> phases[] = {
        {"agree", r.agree_ms},   {"communicators", r.communicators_ms},
        {"plan", r.plan_ms},     {"transfer", r.transfer_ms},
        {"resume", r.resume_ms}, {"total", r.total_ms},
        {"stall", r.stall_ms}};
    for (const auto& [phase, ms] : phases) {
      sample("morph_last_reconfiguration_seconds", "{phase=\"" + std::string(phase) + "\"}",
             Seconds(ms));
    }
  }
  return out;
}

}  // namespace morph
