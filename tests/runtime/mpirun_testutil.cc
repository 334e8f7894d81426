#include "tests/runtime/mpirun_testutil.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "tests/runtime/elastic_testutil.h"

namespace morph::testing {

namespace fs = std::filesystem;
using nlohmann::json;

std::vector<std::string> MpirunArgv(const std::string& mpirun, int np, bool enable_recovery,
                                    const std::vector<std::string>& program,
                                    const std::map<std::string, std::string>& env) {
  std::vector<std::string> argv = {mpirun, "--allow-run-as-root", "--oversubscribe"};
  if (enable_recovery) argv.push_back("--enable-recovery");
  argv.insert(argv.end(), {"-np", std::to_string(np)});
  for (const auto& [k, v] : env) {
    if (!v.empty()) argv.insert(argv.end(), {"-x", k + "=" + v});
  }
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

std::map<int, pid_t> MpiRanks(pid_t mpirun) {
  std::map<int, pid_t> ranks;
  const std::string children =
      ReadFile("/proc/" + std::to_string(mpirun) + "/task/" + std::to_string(mpirun) + "/children");
  for (const std::string& c : NumbersAfter(" " + children, " ")) {
    const std::string env = ReadFile("/proc/" + c + "/environ");
    const std::string key = std::string(1, '\0') + "OMPI_COMM_WORLD_RANK=";
    std::vector<std::string> rank = NumbersAfter(std::string(1, '\0') + env, key);
    if (!rank.empty()) ranks[std::stoi(rank[0])] = std::stoi(c);
  }
  return ranks;
}

std::string MpirunWithRecoveryUnusable(const std::string& mpirun) {
  if (access(mpirun.c_str(), X_OK) != 0) return "no mpirun at " + mpirun;
  const fs::path log =
      fs::temp_directory_path() / ("morph-mpirun-probe-" + std::to_string(getpid()) + ".log");
  pid_t p = SpawnProcess(MpirunArgv(mpirun, 1, true, {"/bin/true"}, {}), {}, log.string());
  std::optional<int> code = p > 0 ? WaitExit(p, 30000) : std::nullopt;
  if (p > 0 && !code) Stop(p);
  std::string why;
  if (code != 0) why = "mpirun --enable-recovery does not run here: " + ReadFile(log);
  fs::remove(log);
  return why;
}

namespace {

// Each rank runs the worker under this shell ($1: the job's directory, then the worker's argv),
// which records the worker's pid and exit status (128 + signal when killed). The files appear
// whole (written aside, then renamed).
constexpr char kRankShell[] =
    "d=$1; shift; f=\"$d/rank-$OMPI_COMM_WORLD_RANK\"; \"$@\" & w=$!; "
    "echo $w > \"$f.pid.tmp\"; mv \"$f.pid.tmp\" \"$f.pid\"; wait $w; c=$?; "
    "echo $c > \"$f.exit.tmp\"; mv \"$f.exit.tmp\" \"$f.exit\"; exit $c";

// GET /v1/status's document as the snapshot it renders (runtime/coordinator/http_api.cc).
CoordinatorSnapshot SnapshotOf(const json& j) {
  CoordinatorSnapshot s;
  s.generation = j.value("generation", int64_t{0});
  s.phase = j.value("phase", "");
  if (j.contains("config") && j["config"].is_object()) {
    const json& c = j["config"];
    s.config.dp = c.value("dp", 0);
    s.config.tp = c.value("tp", 0);
    s.config.pp = c.value("pp", 0);
    s.config.zero_stage = c.value("zero", 0);
    s.config.micro_batches = c.value("micro_batches", 0);
  }
  for (const json& m : j.value("members", json::array())) {
    s.members.push_back({.rank = m.value("rank", -1),
                         .worker = m.value("worker", WorkerId{0}),
                         .host = m.value("host", "")});
  }
  for (const json& w : j.value("standby", json::array())) s.standby.push_back(w.get<WorkerId>());
  s.step = j.value("step", int64_t{0});
  s.resize_in_progress = j.value("resize_in_progress", false);
  if (j.contains("pending_generation") && j["pending_generation"].is_number()) {
    s.pending_generation = j["pending_generation"].get<int64_t>();
  }
  s.reconfigurations = j.value("reconfigurations", int64_t{0});
  if (j.contains("last_reconfiguration") && j["last_reconfiguration"].is_object()) {
    const json& r = j["last_reconfiguration"];
    const json phases = r.value("phases_ms", json::object());
    s.last_reconfiguration =
        ReconfigurationRecord{.from_generation = r.value("from_generation", int64_t{0}),
                              .to_generation = r.value("to_generation", int64_t{0}),
                              .from_world = r.value("from_world", 0),
                              .to_world = r.value("to_world", 0),
                              .agree_ms = phases.value("agree", 0.0),
                              .communicators_ms = phases.value("communicators", 0.0),
                              .plan_ms = phases.value("plan", 0.0),
                              .transfer_ms = phases.value("transfer", 0.0),
                              .resume_ms = phases.value("resume", 0.0),
                              .total_ms = r.value("total_ms", 0.0),
                              .stall_ms = r.value("stall_ms", 0.0),
                              .explanation = r.value("explanation", "")};
  }
  return s;
}

// "4:2x2x1,8:8x1x1" (elastic_worker --configs).
std::string ConfigsFlag(const std::map<int, ParallelConfig>& configs) {
  std::string out;
  for (const auto& [world, c] : configs) {
    if (!out.empty()) out += ",";
    out += std::to_string(world) + ":" + std::to_string(c.dp) + "x" + std::to_string(c.tp) + "x" +
           std::to_string(c.pp);
  }
  return out;
}

class MpirunJob : public ElasticJob {
 public:
  explicit MpirunJob(MpirunJobOptions o) : o_(std::move(o)) {
    dir_ = fs::temp_directory_path() / ("morph-mpi-" + o_.name + "-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  ~MpirunJob() override {
    // mpirun first (it signals its ranks' shells), then every worker it or this test started.
    if (!mpirun_exit_) Stop(mpirun_);
    for (int r = 0; r < o_.np; ++r) {
      const fs::path rank = dir_ / ("rank-" + std::to_string(r));
      pid_t p = std::atoi(ReadFile(fs::path(rank).concat(".pid")).c_str());
      // Not recorded as exited, and still the worker (not a pid used again since).
      if (p > 0 && !RankExit(r) &&
          ReadFile("/proc/" + std::to_string(p) + "/cmdline").find(o_.worker) == 0) {
        kill(p, SIGKILL);
      }
    }
    for (pid_t p : joiners_) {
      if (!joiner_exit_.count(p)) Stop(p, 1000);
    }
    if (std::getenv("MORPH_TEST_KEEP") == nullptr) fs::remove_all(dir_);
  }

  // Starts mpirun; false (after a gtest failure) when its coordinator does not show up.
  bool Start() {
    std::map<std::string, std::string> env = Env();
    env["MORPH_COORDINATOR_FILE"] = (dir_ / "coordinator").string();
    std::vector<std::string> program = {"/bin/sh", "-c", kRankShell, "sh", dir_.string()};
    std::vector<std::string> worker = Worker();
    program.insert(program.end(), worker.begin(), worker.end());
    mpirun_ = SpawnProcess(MpirunArgv(o_.mpirun, o_.np, /*enable_recovery=*/true, program, env),
                           env, (dir_ / "mpirun.log").string());
    EXPECT_GT(mpirun_, 0);
    if (mpirun_ <= 0) return false;
    if (!ReadCoordinatorFile(dir_ / "coordinator", address_, token_, 60000)) {
      ADD_FAILURE() << "no coordinator file from mpirun rank 0\n" << Logs();
      return false;
    }
    // Rank 0's coordinator logs the scheduler API's (ephemeral) port.
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (api_port_ == 0 && std::chrono::steady_clock::now() < until) {
      std::vector<std::string> port =
          NumbersAfter(ReadFile(dir_ / "mpirun.log"), "scheduler API on port ");
      if (!port.empty()) api_port_ = static_cast<uint16_t>(std::stoi(port[0]));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_NE(api_port_, 0) << "rank 0 logged no scheduler API port\n" << Logs();
    return api_port_ != 0;
  }

  CoordinatorSnapshot Observe() override {
    json j = ApiStatus(api_port_);
    if (!j.is_object()) return CoordinatorSnapshot{};
    last_ = SnapshotOf(j);
    return last_;
  }

  Status Resize(std::optional<int> world, int add, std::vector<WorkerId> remove) override {
    CoordinatorSnapshot before = Observe();
    if (before.generation == 0) return UnavailableError("GET /v1/status: no answer");
    const int have = static_cast<int>(before.members.size() + before.standby.size());
    json body = {{"reason", "test"}};
    if (world) {
      body["world_size"] = *world;
    } else {
      body["add"] = add;
      body["remove"] = remove;
    }
    HttpReply r = Http(api_port_, "POST", "/v1/resize", body.dump(), token_);
    if (r.code == 409) return FailedPreconditionError("HTTP 409: " + r.body);
    if (r.code != 202) {
      return UnknownError("POST /v1/resize " + body.dump() + ": HTTP " + std::to_string(r.code) +
                          " " + r.body);
    }
    // The scheduler's part: nothing launches workers for an mpirun job.
    const int missing = world ? *world - have : add;
    if (missing > 0 && AddWorkers(missing) != missing) {
      return InternalError("could not start " + std::to_string(missing) + " joiner(s)");
    }
    return Status::Ok();
  }

  int AddWorkers(int count) override {
    std::map<std::string, std::string> env = Env();
    env["MORPH_COORDINATOR"] = address_;
    env["MORPH_TOKEN"] = token_;
    int started = 0;
    for (int i = 0; i < count; ++i) {
      const std::string log = "joiner-" + std::to_string(joiners_.size()) + ".log";
      pid_t p = SpawnProcess(Worker(), env, (dir_ / log).string());
      if (p <= 0) break;
      joiners_.push_back(p);
      ++started;
    }
    return started;
  }

  std::optional<int> Preempt(int index, int64_t timeout_ms) override {
    if (index <= 0 || index >= o_.np) {
      ADD_FAILURE() << "Preempt(" << index << "): rank 0 hosts the coordinator; ranks 1.."
                    << o_.np - 1 << " can be preempted";
      return std::nullopt;
    }
    const fs::path rank = dir_ / ("rank-" + std::to_string(index));
    const pid_t pid = std::atoi(ReadFile(fs::path(rank).concat(".pid")).c_str());
    if (pid <= 0 || kill(pid, SIGTERM) != 0) return std::nullopt;
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      if (std::optional<int> code = RankExit(index)) return code;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::nullopt;
  }

  End WaitForEnd(int64_t timeout_ms) override {
    End end;
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (true) {
      // The coordinator goes with rank 0 at the end: keep its last view.
      (void)Observe();
      if (!mpirun_exit_) mpirun_exit_ = WaitExit(mpirun_, 0);
      for (pid_t p : joiners_) {
        if (joiner_exit_.count(p)) continue;
        if (std::optional<int> code = WaitExit(p, 0)) joiner_exit_[p] = *code;
      }
      end.ended = mpirun_exit_ && joiner_exit_.size() == joiners_.size();
      if (end.ended || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!end.ended)
      end.why = "mpirun or a joiner still ran after " + std::to_string(timeout_ms) + " ms";
    end.last = last_;
    end.exits.emplace_back("mpirun", mpirun_exit_.value_or(-1));
    for (int r = 0; r < o_.np; ++r) {
      end.exits.emplace_back("mpirun rank " + std::to_string(r), RankExit(r).value_or(-1));
    }
    for (size_t i = 0; i < joiners_.size(); ++i) {
      auto it = joiner_exit_.find(joiners_[i]);
      end.exits.emplace_back(
          "joiner " + std::to_string(i) + " (pid " + std::to_string(joiners_[i]) + ")",
          it == joiner_exit_.end() ? -1 : it->second);
    }
    return end;
  }

  const fs::path& dir() const override { return dir_; }
  std::string Logs() const override { return WorkerLogs(dir_); }

 private:
  // What every worker of the job gets (fast heartbeats, bounded waits), as the Launcher's.
  static std::map<std::string, std::string> Env() {
    return {{"MORPH_HEARTBEAT_MS", "50"},
            {"MORPH_HEARTBEAT_TIMEOUT_MS", "20000"},
            {"MORPH_CHANGE_TIMEOUT_MS", "60000"},
            {"MORPH_START_TIMEOUT_MS", "60000"},
            {"MORPH_RESHARD_SHM", "1"},
            {"MORPH_COORDINATOR", ""},
            {"MORPH_TOKEN", ""},
            {"MORPH_TOKEN_FILE", ""},
            {"MORPH_COORDINATOR_FILE", ""},
            {"MORPH_API_PORT", ""}};
  }
  std::vector<std::string> Worker() const {
    std::vector<std::string> argv = {o_.worker,     "--steps",   std::to_string(o_.steps),  "--out",
                                     dir_.string(), "--step-ms", std::to_string(o_.step_ms)};
    if (!o_.configs.empty()) argv.insert(argv.end(), {"--configs", ConfigsFlag(o_.configs)});
    return argv;
  }
  // The exit status rank `r`'s shell recorded, if it did.
  std::optional<int> RankExit(int r) const {
    std::string text = ReadFile(dir_ / ("rank-" + std::to_string(r) + ".exit"));
    if (text.empty()) return std::nullopt;
    return std::atoi(text.c_str());
  }

  MpirunJobOptions o_;
  fs::path dir_;
  pid_t mpirun_ = -1;
  std::optional<int> mpirun_exit_;
  std::vector<pid_t> joiners_;
  std::map<pid_t, int> joiner_exit_;
  std::string address_, token_;
  uint16_t api_port_ = 0;
  CoordinatorSnapshot last_;
};

}  // namespace

std::unique_ptr<ElasticJob> StartMpirunJob(const MpirunJobOptions& options) {
  auto job = std::make_unique<MpirunJob>(options);
  if (!job->Start()) return nullptr;
  return job;
}

}  // namespace morph::testing
