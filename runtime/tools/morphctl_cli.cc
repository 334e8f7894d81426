#include "runtime/tools/morphctl_cli.h"

#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>

#include "base/printable.h"
#include "runtime/tools/api_client.h"

namespace morph {
namespace {

using json = nlohmann::json;

struct Args {
  std::string command;
  std::vector<std::string> positional;
  std::optional<std::string> addr, token, reason;
  std::optional<int64_t> timeout_ms, deadline_ms, interval_ms, count;
  bool json = false;
  bool help = false;
};

// Flags and the commands that take them ("*": every command).
const std::map<std::string, std::set<std::string>, std::less<>>& FlagCommands() {
  static const auto* m = new std::map<std::string, std::set<std::string>, std::less<>>{
      {"--addr", {"*"}},
      {"--token", {"*"}},
      {"--timeout-ms", {"*"}},
      {"--json", {"*"}},
      {"--deadline-ms", {"resize", "add", "remove"}},
      {"--reason", {"resize", "add", "remove"}},
      {"--interval-ms", {"watch"}},
      {"--count", {"watch"}},
  };
  return *m;
}

const std::set<std::string, std::less<>>& Commands() {
  static const auto* s = new std::set<std::string, std::less<>>{"status", "resize", "add",
                                                                "remove", "watch",  "metrics"};
  return *s;
}

StatusOr<int64_t> ParseInt(std::string_view what, std::string_view text, int64_t min, int64_t max) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    return InvalidArgumentError(std::string(what) + ": \"" + std::string(text) +
                                "\" is not an integer");
  }
  if (v < min || v > max) {
    return InvalidArgumentError(std::string(what) + ": must be in [" + std::to_string(min) + ", " +
                                std::to_string(max) + "], got " + std::string(text));
  }
  return v;
}

StatusOr<Args> ParseArgs(const std::vector<std::string>& argv) {
  Args a;
  std::vector<std::pair<std::string, std::string>> flags;  // name, value ("" for --json)
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& s = argv[i];
    if (s == "-h" || s == "--help" || s == "help") {
      a.help = true;
      continue;
    }
    if (s == "--") {  // the rest are positional (a negative id, say)
      for (++i; i < argv.size(); ++i) a.positional.push_back(argv[i]);
      break;
    }
    if (s.size() > 1 && s[0] == '-' && !std::isdigit(static_cast<unsigned char>(s[1]))) {
      std::string name = s, value;
      size_t eq = s.find('=');
      bool inline_value = eq != std::string::npos;
      if (inline_value) {
        name = s.substr(0, eq);
        value = s.substr(eq + 1);
      }
      if (!FlagCommands().contains(name)) {
        return InvalidArgumentError("unknown flag " + name);
      }
      if (name == "--json") {
        if (inline_value) return InvalidArgumentError("--json takes no value");
      } else if (!inline_value) {
        if (i + 1 >= argv.size()) return InvalidArgumentError(name + ": missing value");
        value = argv[++i];
      }
      flags.emplace_back(name, value);
      continue;
    }
    if (a.command.empty()) {
      a.command = s;
    } else {
      a.positional.push_back(s);
    }
  }
  if (a.help) return a;
  if (a.command.empty()) return InvalidArgumentError("no command given");
  if (!Commands().contains(a.command)) {
    return InvalidArgumentError("unknown command \"" + a.command + "\"");
  }
  for (const auto& [name, value] : flags) {
    const auto& allowed = FlagCommands().at(name);
    if (!allowed.contains("*") && !allowed.contains(a.command)) {
      return InvalidArgumentError(name + ": not a flag of \"" + a.command + "\"");
    }
    constexpr int64_t kDay = 86400000;
    if (name == "--addr") a.addr = value;
    if (name == "--token") a.token = value;
    if (name == "--reason") a.reason = value;
    if (name == "--json") a.json = true;
    if (name == "--timeout-ms") {
      MORPH_ASSIGN_OR_RETURN(a.timeout_ms, ParseInt(name, value, 1, kDay));
    }
    if (name == "--deadline-ms") {
      MORPH_ASSIGN_OR_RETURN(a.deadline_ms, ParseInt(name, value, 0, INT64_MAX));
    }
    if (name == "--interval-ms") {
      MORPH_ASSIGN_OR_RETURN(a.interval_ms, ParseInt(name, value, 10, kDay));
    }
    if (name == "--count") {
      MORPH_ASSIGN_OR_RETURN(a.count, ParseInt(name, value, 1, INT64_MAX));
    }
  }
  size_t want_min = 0, want_max = 0;
  if (a.command == "resize" || a.command == "add") want_min = want_max = 1;
  if (a.command == "remove") want_min = 1, want_max = SIZE_MAX;
  if (a.positional.size() < want_min || a.positional.size() > want_max) {
    std::string what = a.command == "resize"   ? "one world size"
                       : a.command == "add"    ? "one worker count"
                       : a.command == "remove" ? "at least one worker id"
                                               : "no arguments";
    return InvalidArgumentError("\"" + a.command + "\" takes " + what + ", got " +
                                std::to_string(a.positional.size()));
  }
  return a;
}

// The exit code for a failed call to the server.
int ExitFor(const Status& s) {
  switch (s.code()) {
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
      return kExitUnreachable;
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kPermissionDenied:
    case StatusCode::kFailedPrecondition:
      return kExitUsage;
    default:
      return kExitError;
  }
}

// A JSON document a server sent, as one line of printable ASCII: control and non-ASCII
// characters \u-escaped (DEL too, which dump() leaves as it is).
std::string JsonLine(const json& j) {
  std::string text = j.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\x7f') {
      out += "\\u007f";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Ms(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// The members of a status document we show, checked for type.
struct StatusView {
  int64_t generation = 0, step = 0, world = 0, reconfigurations = 0;
  std::string phase;
  int64_t dp = 0, tp = 0, pp = 0, zero = 0, micro_batches = 0;
  bool resize_in_progress = false;
  std::optional<int64_t> pending_generation;
  const json* members = nullptr;
  const json* standby = nullptr;
  const json* last = nullptr;  // null when there was no reconfiguration
};

StatusOr<int64_t> IntAt(const json& j, const char* key, std::string_view where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) {
    return DataLossError("status document: " + std::string(where) + key +
                         " missing or not an integer");
  }
  return it->get<int64_t>();
}

StatusOr<double> NumberAt(const json& j, const char* key, std::string_view where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) {
    return DataLossError("status document: " + std::string(where) + key +
                         " missing or not a number");
  }
  return it->get<double>();
}

StatusOr<StatusView> ViewOf(const json& j) {
  if (!j.is_object()) return DataLossError("status document: not a JSON object");
  StatusView v;
  MORPH_ASSIGN_OR_RETURN(v.generation, IntAt(j, "generation", ""));
  MORPH_ASSIGN_OR_RETURN(v.step, IntAt(j, "step", ""));
  MORPH_ASSIGN_OR_RETURN(v.world, IntAt(j, "world_size", ""));
  MORPH_ASSIGN_OR_RETURN(v.reconfigurations, IntAt(j, "reconfigurations", ""));
  if (!j.contains("phase") || !j["phase"].is_string()) {
    return DataLossError("status document: phase missing or not a string");
  }
  v.phase = j["phase"].get<std::string>();
  if (!j.contains("config") || !j["config"].is_object()) {
    return DataLossError("status document: config missing or not an object");
  }
  const json& c = j["config"];
  MORPH_ASSIGN_OR_RETURN(v.dp, IntAt(c, "dp", "config."));
  MORPH_ASSIGN_OR_RETURN(v.tp, IntAt(c, "tp", "config."));
  MORPH_ASSIGN_OR_RETURN(v.pp, IntAt(c, "pp", "config."));
  MORPH_ASSIGN_OR_RETURN(v.zero, IntAt(c, "zero", "config."));
  MORPH_ASSIGN_OR_RETURN(v.micro_batches, IntAt(c, "micro_batches", "config."));
  if (!j.contains("resize_in_progress") || !j["resize_in_progress"].is_boolean()) {
    return DataLossError("status document: resize_in_progress missing or not a boolean");
  }
  v.resize_in_progress = j["resize_in_progress"].get<bool>();
  if (j.contains("pending_generation") && j["pending_generation"].is_number_integer()) {
    v.pending_generation = j["pending_generation"].get<int64_t>();
  }
  if (!j.contains("members") || !j["members"].is_array()) {
    return DataLossError("status document: members missing or not an array");
  }
  v.members = &j["members"];
  if (j.contains("standby") && j["standby"].is_array()) v.standby = &j["standby"];
  if (j.contains("last_reconfiguration") && j["last_reconfiguration"].is_object()) {
    v.last = &j["last_reconfiguration"];
  }
  return v;
}

std::string ConfigText(const StatusView& v) {
  return "dp=" + std::to_string(v.dp) + " tp=" + std::to_string(v.tp) +
         " pp=" + std::to_string(v.pp);
}

// "generation 2 -> 3, world 6 -> 4 in 760.0 ms (stall 450.0 ms): agree 12.5 ms, ..."
StatusOr<std::string> ReconfigurationText(const json& r) {
  std::string out;
  MORPH_ASSIGN_OR_RETURN(int64_t from_g, IntAt(r, "from_generation", "last_reconfiguration."));
  MORPH_ASSIGN_OR_RETURN(int64_t to_g, IntAt(r, "to_generation", "last_reconfiguration."));
  MORPH_ASSIGN_OR_RETURN(int64_t from_w, IntAt(r, "from_world", "last_reconfiguration."));
  MORPH_ASSIGN_OR_RETURN(int64_t to_w, IntAt(r, "to_world", "last_reconfiguration."));
  MORPH_ASSIGN_OR_RETURN(double total, NumberAt(r, "total_ms", "last_reconfiguration."));
  MORPH_ASSIGN_OR_RETURN(double stall, NumberAt(r, "stall_ms", "last_reconfiguration."));
  out = "generation " + std::to_string(from_g) + " -> " + std::to_string(to_g) + ", world " +
        std::to_string(from_w) + " -> " + std::to_string(to_w) + " in " + Ms(total) +
        " ms (stall " + Ms(stall) + " ms)";
  if (!r.contains("phases_ms") || !r["phases_ms"].is_object()) {
    return DataLossError("status document: last_reconfiguration.phases_ms missing");
  }
  const json& p = r["phases_ms"];
  const char* sep = ": ";
  for (const char* phase : {"agree", "communicators", "plan", "transfer", "resume"}) {
    MORPH_ASSIGN_OR_RETURN(double ms, NumberAt(p, phase, "last_reconfiguration.phases_ms."));
    out += sep;
    out += phase;
    out += " " + Ms(ms) + " ms";
    sep = ", ";
  }
  if (r.contains("explanation") && r["explanation"].is_string() &&
      !r["explanation"].get<std::string>().empty()) {
    out += "; " + Printable(r["explanation"].get<std::string>());
  }
  return out;
}

std::string StatusLine(const StatusView& v) {
  std::string line = "step " + std::to_string(v.step) + "  world " + std::to_string(v.world) +
                     "  " + ConfigText(v) + "  generation " + std::to_string(v.generation) + " " +
                     Printable(v.phase);
  if (v.resize_in_progress) {
    line += "  (resize in progress";
    if (v.pending_generation) line += ": generation " + std::to_string(*v.pending_generation);
    line += ")";
  }
  return line;
}

std::string Timestamp() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

bool Interrupted(const std::atomic<bool>* flag) {
  return flag != nullptr && flag->load(std::memory_order_relaxed);
}

class Cli {
 public:
  Cli(Args args, ApiClient client, std::ostream& out, std::ostream& err,
      const std::atomic<bool>* interrupted)
      : a_(std::move(args)),
        client_(std::move(client)),
        out_(out),
        err_(err),
        interrupted_(interrupted) {}

  int Run() {
    if (a_.command == "status") return ShowStatus();
    if (a_.command == "metrics") return ShowMetrics();
    if (a_.command == "watch") return Watch();
    return Resize();
  }

 private:
  // The reply, or the exit code after printing why there is none / why it is an error.
  std::optional<ApiResponse> Call(bool post, const std::string& target, const std::string& body,
                                  int* rc) {
    StatusOr<ApiResponse> r = post ? client_.Post(target, body) : client_.Get(target);
    if (!r.ok()) {
      *rc = ExitFor(r.status());
      err_ << "morphctl: " << a_.command << ": "
           << (*rc == kExitUnreachable ? "coordinator unreachable: " : "")
           << Printable(r.status().message()) << "\n";
      return std::nullopt;
    }
    if (r->status < 200 || r->status >= 300) {
      *rc = kExitRefused;
      err_ << "morphctl: " << a_.command << ": refused by the coordinator (HTTP " << r->status
           << "): " << Printable(ServerMessage(*r)) << "\n";
      return std::nullopt;
    }
    return *std::move(r);
  }

  // A --json reply printed as one line, or kExitError after saying it is not JSON.
  int PrintJson(const ApiResponse& r) {
    json j = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      err_ << "morphctl: " << a_.command << ": the reply is not JSON: \""
           << Printable(r.body.substr(0, 200)) << (r.body.size() > 200 ? "...\"" : "\"") << "\n";
      return kExitError;
    }
    out_ << JsonLine(j) << "\n";
    return kExitOk;
  }

  int ShowStatus() {
    int rc = kExitOk;
    auto r = Call(false, "/v1/status", "", &rc);
    if (!r) return rc;
    if (a_.json) return PrintJson(*r);
    json j = json::parse(r->body, nullptr, false);
    StatusOr<std::string> text = FormatStatus(j);
    if (!text.ok()) {
      err_ << "morphctl: status: " << Printable(text.status().message()) << "\n";
      return kExitError;
    }
    out_ << *text;
    return kExitOk;
  }

  int ShowMetrics() {
    int rc = kExitOk;
    auto r = Call(false, "/metrics", "", &rc);
    if (!r) return rc;
    out_ << PrintableLines(r->body);
    return kExitOk;
  }

  int Resize() {
    if (client_.endpoint().token.empty()) {
      err_ << "morphctl: " << a_.command
           << ": no job token: pass --token or set MORPH_TOKEN or MORPH_TOKEN_FILE\n";
      return kExitUsage;
    }
    json body = json::object();
    std::string what;
    if (a_.command == "resize" || a_.command == "add") {
      const char* field = a_.command == "resize" ? "world_size" : "add";
      // The server checks the range (it knows the maximum world); here only the syntax.
      StatusOr<int64_t> n = ParseInt(field, a_.positional[0], INT64_MIN, INT64_MAX);
      if (!n.ok()) return Usage(n.status());
      body[field] = *n;
      what = a_.command == "resize" ? "world size -> " + std::to_string(*n)
                                    : "add " + std::to_string(*n) + " worker(s)";
    } else {
      json ids = json::array();
      what = "remove worker(s)";
      for (const std::string& id : a_.positional) {
        StatusOr<int64_t> n = ParseInt("remove", id, INT64_MIN, INT64_MAX);
        if (!n.ok()) return Usage(n.status());
        ids.push_back(*n);
        what += " " + id;
      }
      body["remove"] = std::move(ids);
    }
    if (a_.deadline_ms) body["deadline_ms"] = *a_.deadline_ms;
    if (a_.reason) body["reason"] = *a_.reason;
    int rc = kExitOk;
    auto r = Call(true, "/v1/resize", body.dump(), &rc);
    if (!r) return rc;
    if (a_.json) return PrintJson(*r);
    json j = json::parse(r->body, nullptr, false);
    out_ << "accepted";
    if (j.is_object() && j.contains("request_id") && j["request_id"].is_number_integer()) {
      out_ << ": request " << j["request_id"].get<int64_t>();
    }
    out_ << " (" << what << "); follow it with: morphctl watch\n";
    return kExitOk;
  }

  int Watch() {
    const auto interval = std::chrono::milliseconds(a_.interval_ms.value_or(1000));
    WatchView view;
    bool ever_reached = false, reachable = true;
    for (int64_t polls = 0; !a_.count || polls < *a_.count; ++polls) {
      if (polls > 0) {
        auto until = std::chrono::steady_clock::now() + interval;
        while (std::chrono::steady_clock::now() < until && !Interrupted(interrupted_)) {
          std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
              std::chrono::milliseconds(20), until - std::chrono::steady_clock::now()));
        }
      }
      if (Interrupted(interrupted_)) break;
      StatusOr<ApiResponse> r = client_.Get("/v1/status");
      if (!r.ok()) {
        int rc = ExitFor(r.status());
        // Before the first answer this is most likely a wrong address: say so and stop. Once
        // the coordinator was seen, an outage is reported once and polling goes on.
        if (!ever_reached || rc != kExitUnreachable) {
          err_ << "morphctl: watch: " << (rc == kExitUnreachable ? "coordinator unreachable: " : "")
               << Printable(r.status().message()) << "\n";
          return rc;
        }
        if (reachable) {
          out_ << Timestamp() << "  coordinator unreachable: " << Printable(r.status().message())
               << " (retrying)" << std::endl;
        }
        reachable = false;
        continue;
      }
      if (r->status < 200 || r->status >= 300) {
        err_ << "morphctl: watch: refused by the coordinator (HTTP " << r->status
             << "): " << Printable(ServerMessage(*r)) << "\n";
        return kExitRefused;
      }
      if (!reachable) out_ << Timestamp() << "  coordinator reachable again" << std::endl;
      ever_reached = reachable = true;
      if (a_.json) {
        if (int rc = PrintJson(*r); rc != kExitOk) return rc;
        out_.flush();
        continue;
      }
      json j = json::parse(r->body, nullptr, false);
      StatusOr<std::vector<std::string>> lines = view.Update(j);
      if (!lines.ok()) {
        err_ << "morphctl: watch: " << Printable(lines.status().message()) << "\n";
        return kExitError;
      }
      for (const std::string& line : *lines) out_ << Timestamp() << "  " << line << std::endl;
    }
    return kExitOk;
  }

  int Usage(const Status& s) {
    err_ << "morphctl: " << a_.command << ": " << s.message() << "\n";
    return kExitUsage;
  }

  Args a_;
  ApiClient client_;
  std::ostream& out_;
  std::ostream& err_;
  const std::atomic<bool>* interrupted_;
};

}  // namespace

std::string MorphctlUsage() {
  return R"(usage: morphctl [--addr host:port] [--token T] [--timeout-ms MS] [--json] COMMAND ...
commands:
  status                        the job: generation, step, config, members, last change
  resize N                      ask for a world of N workers
  add K                         ask for K more workers
  remove ID...                  ask for these workers (ids from status) to leave
      resize/add/remove take --deadline-ms D and --reason TEXT
  watch [--interval-ms MS] [--count N]
                                live view: step, world, config, each reconfiguration
  metrics                       the Prometheus metrics
address: --addr, else MORPH_API_ADDR (default 127.0.0.1) and MORPH_API_PORT
token:   --token, else MORPH_TOKEN, else the file MORPH_TOKEN_FILE names
exit codes: 0 ok, 1 unexpected reply, 2 usage or configuration, 3 refused by the
  coordinator (its message is printed), 4 coordinator unreachable
)";
}

StatusOr<std::string> FormatStatus(const json& status) {
  MORPH_ASSIGN_OR_RETURN(StatusView v, ViewOf(status));
  std::ostringstream o;
  o << "generation " << v.generation << " (" << Printable(v.phase) << "), step " << v.step << "\n";
  o << "world " << v.world << ": " << ConfigText(v) << " zero=" << v.zero
    << " micro_batches=" << v.micro_batches << "\n";
  o << "members (rank worker host):\n";
  for (const json& m : *v.members) {
    if (!m.is_object()) return DataLossError("status document: a member is not an object");
    MORPH_ASSIGN_OR_RETURN(int64_t rank, IntAt(m, "rank", "members[]."));
    MORPH_ASSIGN_OR_RETURN(int64_t worker, IntAt(m, "worker", "members[]."));
    std::string host =
        m.contains("host") && m["host"].is_string() ? m["host"].get<std::string>() : "";
    o << "  " << rank << "  " << worker << "  " << (host.empty() ? "-" : Printable(host)) << "\n";
  }
  o << "standby:";
  if (v.standby == nullptr || v.standby->empty()) o << " none";
  if (v.standby != nullptr) {
    for (const json& id : *v.standby) o << " " << JsonLine(id);
  }
  o << "\n";
  o << "resize: ";
  if (v.resize_in_progress) {
    o << "in progress";
    if (v.pending_generation) o << " (generation " << *v.pending_generation << " pending)";
  } else {
    o << "none in progress";
  }
  o << "\nreconfigurations: " << v.reconfigurations << "\n";
  if (v.last != nullptr) {
    MORPH_ASSIGN_OR_RETURN(std::string last, ReconfigurationText(*v.last));
    o << "last reconfiguration: " << last << "\n";
  }
  return o.str();
}

StatusOr<std::vector<std::string>> WatchView::Update(const json& status) {
  MORPH_ASSIGN_OR_RETURN(StatusView v, ViewOf(status));
  std::vector<std::string> lines;
  std::string line = StatusLine(v);
  if (line != last_line_) lines.push_back(line);
  last_line_ = line;
  int64_t to_g = -1;
  if (v.last != nullptr && (*v.last).contains("to_generation") &&
      (*v.last)["to_generation"].is_number_integer()) {
    to_g = (*v.last)["to_generation"].get<int64_t>();
  }
  bool changed = v.reconfigurations != last_reconfigurations_ || to_g != last_to_generation_;
  if (v.last != nullptr && (first_ || changed)) {
    MORPH_ASSIGN_OR_RETURN(std::string text, ReconfigurationText(*v.last));
    lines.push_back((first_ ? "last reconfiguration: " : "reconfiguration: ") + text);
  }
  last_reconfigurations_ = v.reconfigurations;
  last_to_generation_ = to_g;
  first_ = false;
  return lines;
}

int RunMorphctl(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err,
                const std::atomic<bool>* interrupted) {
  StatusOr<Args> args = ParseArgs(argv);
  if (!args.ok()) {
    err << "morphctl: " << args.status().message() << "\n" << MorphctlUsage();
    return kExitUsage;
  }
  if (args->help) {
    out << MorphctlUsage();
    return kExitOk;
  }
  StatusOr<ApiEndpoint> ep = ApiEndpoint::Resolve(args->addr, args->token);
  if (!ep.ok()) {
    err << "morphctl: " << args->command << ": " << ep.status().message() << "\n";
    return kExitUsage;
  }
  ApiClient client(*std::move(ep), std::chrono::milliseconds(args->timeout_ms.value_or(10000)));
  return Cli(*std::move(args), std::move(client), out, err, interrupted).Run();
}

}  // namespace morph
