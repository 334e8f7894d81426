// The coordinator's own death (issue 10; docs/operations.md "Failures"): when the process that
// hosts the coordinator dies with SIGKILL — `morphd` on its own, or `morphrun` (the Launcher) —
// every worker's collectives are aborted, no worker trains on alone with half a generation, its
// BeginStep / AbortStep returns UNAVAILABLE ("connection to the coordinator lost") and the
// program exits non-zero (elastic_worker: 4) within a bounded time. Real processes: the
// coordinator and three elastic_worker processes (which check their state bitwise at every
// step), the coordinator killed mid-training.
//
// Bounded: every wait has a timeout; TearDown stops every process it started (and the workers
// morphrun started, from its log), and removes the job's directory.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/runtime/elastic_testutil.h"

namespace morph {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using testing::ReadFile;
using testing::SpawnProcess;
using testing::WaitExit;

constexpr char kToken[] = "coordinator-death-token";
constexpr int kWorkers = 3;
// A worker must be gone this long after the coordinator's death. On one host the control
// connection closes at once (measured: well under a second); the rest is room for a loaded
// machine (the abort, the program's exit).
constexpr int64_t kExitBoundMs = 10000;

std::map<std::string, std::string> WorkerEnv(const std::string& coordinator) {
  return {{"MORPH_HEARTBEAT_MS", "50"},      {"MORPH_CHANGE_TIMEOUT_MS", "15000"},
          {"MORPH_START_TIMEOUT_MS", "60000"}, {"MORPH_COORDINATOR", coordinator},
          {"MORPH_TOKEN", kToken},            {"MORPH_TOKEN_FILE", ""},
          {"MORPH_COORDINATOR_FILE", ""}};
}

// The decimal numbers that follow each occurrence of `before` in `text`.
std::vector<int64_t> NumbersAfter(const std::string& text, const std::string& before) {
  std::vector<int64_t> out;
  for (size_t at = text.find(before); at != std::string::npos; at = text.find(before, at + 1)) {
    const char* p = text.c_str() + at + before.size();
    if (*p >= '0' && *p <= '9') out.push_back(std::strtoll(p, nullptr, 10));
  }
  return out;
}

class CoordinatorDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("morph-coordinator-death-" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "-" +
            std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    for (pid_t p : launched_) testing::Stop(p);
    for (pid_t p : workers_) {
      if (kill(p, 0) == 0) kill(p, SIGKILL);
    }
    if (!HasFailure()) fs::remove_all(dir_);
  }

  pid_t Spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
              const std::string& log_name) {
    pid_t p = SpawnProcess(argv, env, (dir_ / log_name).string());
    EXPECT_GT(p, 0);
    launched_.push_back(p);
    return p;
  }
  std::vector<std::string> Worker() const {
    // Far more steps than the test lets them train: only the coordinator's death ends them.
    return {MORPH_ELASTIC_WORKER, "--steps", "1000000", "--out", dir_.string(), "--step-ms", "20"};
  }
  std::string Logs() const { return testing::WorkerLogs(dir_); }

  // The newest step each DP rank's samples file shows (by file name).
  std::map<std::string, int64_t> LastSteps() const {
    std::map<std::string, int64_t> last;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() != ".samples") continue;
      std::istringstream in(ReadFile(e.path()));
      int64_t newest = -1;
      for (std::string line; std::getline(in, line);) {
        newest = std::max<int64_t>(newest, std::strtoll(line.c_str(), nullptr, 10));
      }
      last[e.path().filename().string()] = newest;
    }
    return last;
  }
  // Until every one of the kWorkers DP ranks trained `steps` steps.
  bool WaitTrained(int64_t steps, int64_t timeout_ms = 60000) const {
    auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      std::map<std::string, int64_t> last = LastSteps();
      if (last.size() == kWorkers &&
          std::all_of(last.begin(), last.end(), [&](const auto& l) { return l.second >= steps; })) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // Kills `coordinator` with SIGKILL mid-training; then every worker exits with 4 within
  // kExitBoundMs, saying the coordinator is gone (UNAVAILABLE), and they stopped together (none
  // trained a step alone).
  void KillCoordinatorAndCheckWorkers(pid_t coordinator, const std::string& what) {
    ASSERT_TRUE(WaitTrained(10)) << what << ": the workers did not train\n" << Logs();
    const std::map<std::string, int64_t> before = LastSteps();
    const Clock::time_point killed = Clock::now();
    ASSERT_EQ(kill(coordinator, SIGKILL), 0) << what;
    EXPECT_EQ(WaitExit(coordinator, 10000), 128 + SIGKILL) << what;
    launched_.erase(std::remove(launched_.begin(), launched_.end(), coordinator), launched_.end());
    double slowest = 0;
    for (pid_t w : workers_) {
      const int64_t left =
          kExitBoundMs -
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killed).count();
      std::optional<int> code = WaitExit(w, std::max<int64_t>(left, 0));
      ASSERT_TRUE(code.has_value())
          << what << ": worker pid " << w << " still runs " << kExitBoundMs
          << " ms after the coordinator's death\n"
          << Logs();
      slowest = std::max(slowest, std::chrono::duration<double>(Clock::now() - killed).count());
      EXPECT_EQ(*code, 4) << what << ": worker pid " << w << "\n" << Logs();
    }
    std::printf("%s: every worker exited %.3f s after the coordinator's death\n", what.c_str(),
                slowest);
    // No worker went on alone: every step's first collective (after which a step is logged)
    // needs the whole generation, so the workers stopped together, their last logged steps at
    // most one apart (the step in flight). The generation may finish a few steps together
    // before it sees the death: the kernel closes a dying process's sockets only after freeing
    // its memory (morphrun under ASan closed them two 20 ms steps after the SIGKILL).
    const std::map<std::string, int64_t> after = LastSteps();
    int64_t lo = INT64_MAX, hi = -1;
    for (const auto& [file, step] : after) {
      ASSERT_TRUE(before.count(file)) << file;
      lo = std::min(lo, step);
      hi = std::max(hi, step);
      std::printf("%s: %s trained steps %lld..%lld after the coordinator's death\n", what.c_str(),
                  file.c_str(), static_cast<long long>(before.at(file) + 1),
                  static_cast<long long>(step));
    }
    EXPECT_LE(hi - lo, 1) << what << ": the workers' last steps " << lo << ".." << hi << "\n"
                          << Logs();
    // Each says why it stopped: the coordinator is gone, with the status code.
    for (int i = 0; i < kWorkers; ++i) {
      const std::string log = ReadFile(dir_ / ("worker-" + std::to_string(i) + ".log"));
      // From whichever call of the training loop came first after the death.
      EXPECT_EQ(testing::CoordinatorLostLines(log), 1) << what << ": worker " << i << "\n" << log;
    }
  }

  fs::path dir_;
  std::vector<pid_t> launched_;
  std::vector<pid_t> workers_;
};

TEST_F(CoordinatorDeathTest, MorphdKilledStopsEveryWorker) {
  pid_t morphd = Spawn({MORPHD, "--initial-world", std::to_string(kWorkers), "--no-http",
                        "--heartbeat-timeout-ms", "5000"},
                       {{"MORPH_TOKEN", kToken}, {"MORPH_TOKEN_FILE", ""}}, "morphd.out");
  // Its first stdout line: {"control":"127.0.0.1:P","store":"...","http_port":0}.
  std::string control;
  auto until = Clock::now() + std::chrono::seconds(20);
  while (control.empty() && Clock::now() < until) {
    std::istringstream in(ReadFile(dir_ / "morphd.out"));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("{\"control\":", 0) != 0) continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) control = j.value("control", "");
    }
    if (control.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(control.empty()) << ReadFile(dir_ / "morphd.out");
  for (int i = 0; i < kWorkers; ++i) {
    workers_.push_back(
        Spawn(Worker(), WorkerEnv(control), "worker-" + std::to_string(i) + ".log"));
  }
  KillCoordinatorAndCheckWorkers(morphd, "morphd");
  EXPECT_EQ(ReadFile(dir_ / "morphd.out").find("the job completed"), std::string::npos);
}

TEST_F(CoordinatorDeathTest, MorphrunKilledStopsEveryWorker) {
  std::vector<std::string> argv = {MORPHRUN, "-n", std::to_string(kWorkers), "--log-dir",
                                   dir_.string(), "--"};
  for (const std::string& a : Worker()) argv.push_back(a);
  std::map<std::string, std::string> env = WorkerEnv("");
  // morphrun's workers become ours once it dies, so that their exit codes can be read.
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  pid_t run = Spawn(argv, env, "morphrun.out");
  // morphrun logs "worker N started (pid P)" for each; each worker is in its own process group,
  // so morphrun's SIGKILL does not reach them: they must stop on their own.
  auto until = Clock::now() + std::chrono::seconds(20);
  std::vector<int64_t> pids;
  while (pids.size() < kWorkers && Clock::now() < until) {
    pids = NumbersAfter(ReadFile(dir_ / "morphrun.out"), "started (pid ");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(pids.size(), static_cast<size_t>(kWorkers)) << ReadFile(dir_ / "morphrun.out");
  // morphrun names its workers' logs worker-<index>.log in --log-dir.
  for (int64_t p : pids) workers_.push_back(static_cast<pid_t>(p));
  KillCoordinatorAndCheckWorkers(run, "morphrun");
}

}  // namespace
}  // namespace morph
