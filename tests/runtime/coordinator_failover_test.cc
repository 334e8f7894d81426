// Coordinator failover on etcd (issue 26; docs/operations.md "Coordinator failover"): a private
// 3-member etcd cluster (EtcdCluster), two morphd candidates with MORPH_ETCD, three
// elastic_worker processes (which check their state bitwise at every step) training.
//   - kill -9 of the leading morphd in steady training: no worker stops, every step is trained
//     exactly once (no step lost, none twice), the other candidate leads within two lease TTLs,
//     and a resize asked of it right after works;
//   - one etcd member killed: nothing changes (the same leader, training on, a resize works).
// Skipped (saying why) where no etcd binary is installed. Every wait is bounded; TearDown stops
// every process it started and the etcd cluster, and removes the job's directory.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/ha/election.h"
#include "runtime/ha/etcd_testutil.h"
#include "runtime/tools/api_client.h"
#include "tests/runtime/elastic_testutil.h"

namespace morph {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using testing::ReadFile;
using testing::SpawnProcess;
using testing::WaitExit;

constexpr char kToken[] = "coordinator-failover-token";
constexpr char kPrefix[] = "/morph/failover-test";
constexpr int kWorkers = 3;
constexpr int64_t kTtlS = 2;

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

class CoordinatorFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StatusOr<std::unique_ptr<EtcdCluster>> c = EtcdCluster::Start(3);
    if (!c.ok() && c.status().code() == StatusCode::kNotFound) GTEST_SKIP() << c.status();
    ASSERT_TRUE(c.ok()) << c.status();
    etcd_ = *std::move(c);
    dir_ = fs::temp_directory_path() /
           ("morph-failover-" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "-" +
            std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    for (pid_t p : launched_) testing::Stop(p);
    etcd_.reset();
    if (!HasFailure()) fs::remove_all(dir_);
  }

  std::map<std::string, std::string> HaEnv() const {
    return {{"MORPH_ETCD", etcd_->endpoints()}, {"MORPH_ETCD_PREFIX", kPrefix},
            {"MORPH_ETCD_TTL_S", std::to_string(kTtlS)}, {"MORPH_ETCD_REJOIN_MS", "10000"},
            {"MORPH_TOKEN", kToken},           {"MORPH_TOKEN_FILE", ""},
            {"MORPH_COORDINATOR_FILE", ""}};
  }
  pid_t Spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
              const std::string& log_name) {
    pid_t p = SpawnProcess(argv, env, (dir_ / log_name).string());
    EXPECT_GT(p, 0);
    launched_.push_back(p);
    return p;
  }
  // A morphd candidate; its scheduler API port (from its first stdout line).
  std::pair<pid_t, uint16_t> Candidate(const std::string& name) {
    pid_t p = Spawn({MORPHD, "--initial-world", std::to_string(kWorkers), "--heartbeat-timeout-ms",
                     "5000", "--api-port", "0"},
                    HaEnv(), name + ".out");
    const auto until = Clock::now() + std::chrono::seconds(20);
    while (Clock::now() < until) {
      std::istringstream in(ReadFile(dir_ / (name + ".out")));
      for (std::string line; std::getline(in, line);) {
        if (line.rfind("{\"control\":", 0) != 0) continue;
        nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object()) return {p, static_cast<uint16_t>(j.value("http_port", 0))};
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << name << " printed no addresses\n" << ReadFile(dir_ / (name + ".out"));
    return {p, 0};
  }
  // The leader's control address, once there is one (or "" after `timeout_ms`); with `not_`
  // set, a leader other than that one.
  std::string Leader(int64_t timeout_ms, const std::string& not_ = "") {
    EtcdOptions o = etcd_->options();
    o.timeout = std::chrono::milliseconds(500);
    EtcdClient etcd(o);
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      StatusOr<std::optional<std::string>> v = LookupLeader(etcd, kPrefix);
      if (v.ok() && v->has_value()) {
        StatusOr<std::string> control = LeaderControlAddress(**v);
        if (control.ok() && *control != not_) return *control;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return "";
  }
  std::vector<std::string> Worker() const {
    return {MORPH_ELASTIC_WORKER, "--steps", "1000000", "--out", dir_.string(), "--step-ms", "20"};
  }
  std::string Logs() const { return testing::WorkerLogs(dir_); }

  // Every DP rank's samples file: its steps in order.
  std::map<std::string, std::vector<int64_t>> Steps() const {
    std::map<std::string, std::vector<int64_t>> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() != ".samples") continue;
      std::istringstream in(ReadFile(e.path()));
      auto& v = out[e.path().filename().string()];
      for (std::string line; std::getline(in, line);) {
        if (!line.empty()) v.push_back(std::strtoll(line.c_str(), nullptr, 10));
      }
    }
    return out;
  }
  int64_t MinLastStep(size_t ranks) const {
    auto s = Steps();
    if (s.size() < ranks) return -1;
    int64_t lo = INT64_MAX;
    for (const auto& [f, v] : s) lo = std::min<int64_t>(lo, v.empty() ? -1 : v.back());
    return lo;
  }
  // The newest step any DP rank trained (a rank that left stops its file; the others go on).
  int64_t MaxLastStep() const {
    int64_t hi = -1;
    for (const auto& [f, v] : Steps()) hi = std::max<int64_t>(hi, v.empty() ? -1 : v.back());
    return hi;
  }
  bool WaitTrained(int64_t step, size_t ranks = kWorkers, int64_t timeout_ms = 60000) const {
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      if (MinLastStep(ranks) >= step) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  // Every worker still runs.
  void ExpectWorkersRun(const std::string& when) {
    for (pid_t w : workers_) {
      EXPECT_FALSE(WaitExit(w, 0).has_value()) << "worker pid " << w << " exited " << when << "\n"
                                               << Logs();
    }
  }
  // Each DP rank trained each step once, consecutively: no step lost, none trained twice.
  void ExpectNoStepLost() {
    for (const auto& [file, v] : Steps()) {
      for (size_t i = 1; i < v.size(); ++i) {
        if (v[i] != v[i - 1] + 1) {
          ADD_FAILURE() << file << ": step " << v[i] << " follows step " << v[i - 1];
          break;
        }
      }
    }
  }
  // POST /v1/resize {"world_size": n} to the scheduler API on `port`, then waits until every
  // remaining worker trained in the new world; the request's latency to the first step of it.
  double Resize(uint16_t port, int n) {
    ApiClient api(ApiEndpoint{.host = "127.0.0.1", .port = port, .token = kToken},
                  std::chrono::seconds(10));
    const auto t0 = Clock::now();
    StatusOr<ApiResponse> r =
        api.Post("/v1/resize", nlohmann::json{{"world_size", n}, {"reason", "test"}}.dump());
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return -1;
    EXPECT_EQ(r->status, 202) << r->body;
    // Trained in a world of n: the samples line's third field is the config's dp.
    const auto until = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < until) {
      for (const auto& e : fs::directory_iterator(dir_)) {
        if (e.path().extension() != ".samples") continue;
        std::string text = ReadFile(e.path());
        size_t last = text.rfind('\n', text.size() >= 2 ? text.size() - 2 : 0);
        std::istringstream line(text.substr(last == std::string::npos ? 0 : last + 1));
        int64_t step = 0, gen = 0, dp = 0;
        if (line >> step >> gen >> dp && dp == n) return MsSince(t0);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ADD_FAILURE() << "no step trained in a world of " << n << "\n" << Logs();
    return -1;
  }

  std::unique_ptr<EtcdCluster> etcd_;
  fs::path dir_;
  std::vector<pid_t> launched_;
  std::vector<pid_t> workers_;
};

TEST_F(CoordinatorFailoverTest, LeaderKilledMidTrainingSuccessorLeadsAndTrainingGoesOn) {
  auto [a, a_port] = Candidate("morphd-a");
  const std::string first = Leader(20000);
  ASSERT_FALSE(first.empty()) << ReadFile(dir_ / "morphd-a.out");
  auto [b, b_port] = Candidate("morphd-b");
  std::map<std::string, std::string> env = HaEnv();
  env["MORPH_COORDINATOR"] = first;
  env["MORPH_HEARTBEAT_MS"] = "50";
  env["MORPH_CHANGE_TIMEOUT_MS"] = "15000";
  for (int i = 0; i < kWorkers; ++i) {
    workers_.push_back(Spawn(Worker(), env, "worker-" + std::to_string(i) + ".log"));
  }
  ASSERT_TRUE(WaitTrained(10)) << Logs();
  const int64_t before = MinLastStep(kWorkers);

  // The survivors' stall: the longest time the slowest rank's step did not advance, sampled
  // every 2 ms from the kill until 20 steps after the successor leads.
  std::atomic<bool> sampling{true};
  std::atomic<double> stall_ms{0};
  const auto killed = Clock::now();
  std::thread sampler([&] {
    int64_t seen = MinLastStep(kWorkers);
    auto last_change = killed;
    while (sampling.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const int64_t now_step = MinLastStep(kWorkers);
      if (now_step != seen) {
        stall_ms = std::max(stall_ms.load(), MsSince(last_change));
        last_change = Clock::now();
        seen = now_step;
      }
    }
  });
  struct Join {
    std::atomic<bool>& flag;
    std::thread& t;
    ~Join() {
      flag = false;
      if (t.joinable()) t.join();
    }
  } join{sampling, sampler};
  ASSERT_EQ(kill(a, SIGKILL), 0);
  EXPECT_EQ(WaitExit(a, 10000), 128 + SIGKILL);
  launched_.erase(std::remove(launched_.begin(), launched_.end(), a), launched_.end());
  const std::string second = Leader(4 * kTtlS * 1000, first);
  const double succession_ms = MsSince(killed);
  ASSERT_FALSE(second.empty()) << ReadFile(dir_ / "morphd-b.out");
  EXPECT_LT(succession_ms, 2 * kTtlS * 1000.0) << "a successor leads only after two TTLs";
  // Training goes on through the succession: every worker trains 20 more steps after it.
  ASSERT_TRUE(WaitTrained(MinLastStep(kWorkers) + 20)) << Logs() << ReadFile(dir_ / "morphd-b.out");
  EXPECT_GT(MinLastStep(kWorkers), before);
  sampling = false;
  sampler.join();
  ExpectWorkersRun("after the leader's death");
  const double resize_ms = Resize(b_port, 2);
  ASSERT_GE(resize_ms, 0) << ReadFile(dir_ / "morphd-b.out");
  {
    const int64_t target = MaxLastStep() + 10;
    const auto until = Clock::now() + std::chrono::seconds(60);
    while (MaxLastStep() < target && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_GE(MaxLastStep(), target) << "no training after the resize\n" << Logs();
  }
  ExpectNoStepLost();
  std::printf("{\"bench\":\"ha_leader_kill\",\"ttl_s\":%ld,\"succession_ms\":%.1f,"
              "\"survivor_stall_ms\":%.1f,\"step_ms\":20,\"resize_after_succession_ms\":%.1f}\n",
              static_cast<long>(kTtlS), succession_ms, stall_ms.load(), resize_ms);
  EXPECT_NE(ReadFile(dir_ / "morphd-b.out").find("leading"), std::string::npos);
}

TEST_F(CoordinatorFailoverTest, OneEtcdMemberKilledChangesNothing) {
  auto [a, a_port] = Candidate("morphd-a");
  const std::string first = Leader(20000);
  ASSERT_FALSE(first.empty()) << ReadFile(dir_ / "morphd-a.out");
  auto [b, b_port] = Candidate("morphd-b");
  (void)b;
  (void)b_port;
  std::map<std::string, std::string> env = HaEnv();
  env["MORPH_COORDINATOR"] = first;
  env["MORPH_HEARTBEAT_MS"] = "50";
  for (int i = 0; i < kWorkers; ++i) {
    workers_.push_back(Spawn(Worker(), env, "worker-" + std::to_string(i) + ".log"));
  }
  ASSERT_TRUE(WaitTrained(10)) << Logs();
  const int64_t before = MinLastStep(kWorkers);
  etcd_->Kill(0);
  ASSERT_TRUE(WaitTrained(before + 3 * kTtlS * 1000 / 20 / 2)) << Logs();
  EXPECT_EQ(Leader(2000), first) << "the leader changed";
  ExpectWorkersRun("after an etcd member's death");
  EXPECT_GE(Resize(a_port, 2), 0) << ReadFile(dir_ / "morphd-a.out");
  ExpectNoStepLost();
  EXPECT_EQ(ReadFile(dir_ / "morphd-a.out").find("no longer leading"), std::string::npos);
}

}  // namespace
}  // namespace morph
