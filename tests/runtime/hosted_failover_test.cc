// Coordinator candidates hosted by workers (issue 26; docs/operations.md "Coordinator
// failover"): `morphrun --etcd` on a private 3-member etcd cluster (EtcdCluster) starts four
// elastic_worker processes (hybrid ZeRO: every piece has a replica; each worker checks its state
// bitwise at every step); the first three host coordinator candidates, morphrun hosts none.
// The worker process that hosts the leader is SIGKILLed mid-training: the job loses a worker and
// its coordinator at once. Checked: no other worker stops; another candidate leads within two
// lease TTLs; the killed worker is counted lost after MORPH_ETCD_REJOIN_MS and the survivors
// recover and train on; a grow asked of the successor's scheduler API afterwards is carried out
// (the successor asks morphrun for a worker through etcd); the worker that hosts the successor is
// removed by a resize: its candidate resigns on the way out and the third candidate leads; the
// job completes, morphrun exits 0,
// and the samples of every step are the fixed global order (a step retrained after the
// recovery counts once). The same under `mpirun --enable-recovery` (rank 0 killed; skipped
// where mpirun cannot recover), SIGTERM to morphrun, and a job without failures on a prefix
// morphrun made up (deleted at its end). MORPH_HOSTED_TRIALS (default 1) repeats the whole case;
// MORPH_TEST_KEEP keeps the job's directory (logs, samples).
//
// Skipped (saying why) where no etcd binary is installed. Every wait is bounded; TearDown stops
// morphrun (which stops its workers) and the etcd cluster, and removes the job's directory.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "morph/generation.h"
#include "runtime/ha/election.h"
#include "runtime/ha/etcd_testutil.h"
#include "tests/runtime/elastic_testutil.h"
#include "tests/runtime/mpirun_testutil.h"

namespace morph {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using testing::MsSince;
using testing::ReadFile;
using testing::SpawnProcess;
using testing::WaitExit;

constexpr char kToken[] = "hosted-failover-token";
constexpr int kWorkers = 4;
constexpr int64_t kTtlS = 2;
constexpr int64_t kRejoinMs = 3000;
constexpr int64_t kSteps = 700;

using Leader = LeaderSeen;

class HostedFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StatusOr<std::unique_ptr<EtcdCluster>> c = EtcdCluster::Start(3);
    if (!c.ok() && c.status().code() == StatusCode::kNotFound) GTEST_SKIP() << c.status();
    ASSERT_TRUE(c.ok()) << c.status();
    etcd_ = *std::move(c);
  }
  void TearDown() override {
    if (morphrun_ > 0) testing::Stop(morphrun_, 15000);
    etcd_.reset();
    if (!HasFailure() && !dir_.empty() && std::getenv("MORPH_TEST_KEEP") == nullptr) {
      fs::remove_all(dir_);
    }
  }

  // The current leader (its control address other than `not_`), or an empty control after
  // `timeout_ms`.
  Leader WaitLeader(int64_t timeout_ms, const std::string& not_ = "") {
    return WaitForLeader(etcd_->options(), prefix_, timeout_ms, not_);
  }

  // Per worker-<id>.samples file: its lines' steps and dp, in order.
  struct Line {
    int64_t step, gen, dp;
  };
  std::map<std::string, std::vector<Line>> Samples() const {
    std::map<std::string, std::vector<Line>> out;
    for (const auto& [file, lines] : testing::ReadSampleFiles(dir_)) {
      auto& v = out[file];
      for (const testing::SampleLine& l : lines) v.push_back(Line{l.step, l.generation, l.dp});
    }
    return out;
  }
  int64_t MaxStep() const {
    int64_t hi = -1;
    for (const auto& [f, v] : Samples()) hi = std::max<int64_t>(hi, v.empty() ? -1 : v.back().step);
    return hi;
  }
  bool WaitStep(int64_t step, int64_t timeout_ms) const {
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      if (MaxStep() >= step) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  // Some DP rank trained a step after `after` in a world of dp = n (the samples line's third
  // field).
  bool WaitDp(int n, int64_t after, int64_t timeout_ms) const {
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      for (const auto& [f, v] : Samples()) {
        if (!v.empty() && v.back().dp == n && v.back().step > after) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  std::string Logs() const { return testing::WorkerLogs(dir_) + ReadFile(dir_ / "morphrun.log"); }

  // morphrun's pid of worker `index` ("morphrun: worker 2 started (pid 1234)"), 0 if none.
  pid_t WorkerPid(int index) const {
    std::istringstream in(ReadFile(dir_ / "morphrun.log"));
    const std::string key = "morphrun: worker " + std::to_string(index) + " started (pid ";
    for (std::string line; std::getline(in, line);) {
      size_t at = line.find(key);
      if (at != std::string::npos) return std::atoi(line.c_str() + at + key.size());
    }
    return 0;
  }
  // Worker `index`'s exit code as morphrun logged it ("morphrun: worker 2 (pid 1234) exited
  // with 0"), once logged; nullopt after `timeout_ms`. (The workers are morphrun's children.)
  std::optional<int> ExitOf(int index, int64_t timeout_ms) const {
    const std::string key = "morphrun: worker " + std::to_string(index) + " (pid ";
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    do {
      std::istringstream in(ReadFile(dir_ / "morphrun.log"));
      for (std::string line; std::getline(in, line);) {
        size_t at = line.find(key);
        size_t with = line.find(") exited with ", at);
        if (at != std::string::npos && with != std::string::npos) {
          return std::atoi(line.c_str() + with + 14);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (Clock::now() < until);
    return std::nullopt;
  }
  // The launch index of the worker whose log says it hosts the candidate at `control`; -1.
  int CandidateIndex(const std::string& control) const {
    for (int i = 0; i < kWorkers; ++i) {
      std::string log = ReadFile(dir_ / ("worker-" + std::to_string(i) + ".log"));
      if (log.find("hosting coordinator candidate " + std::to_string(i) + " of 3 at " + control +
                   " ") != std::string::npos) {
        return i;
      }
    }
    return -1;
  }

  // The worker id of the worker at launch `index` (its log's "[g… worker N] registered with").
  WorkerId WorkerIdOf(int index) const {
    std::istringstream in(ReadFile(dir_ / ("worker-" + std::to_string(index) + ".log")));
    for (std::string line; std::getline(in, line);) {
      size_t end = line.find("] registered with ");
      size_t at = line.rfind(" worker ", end);
      if (end != std::string::npos && at != std::string::npos) {
        return std::strtoll(line.c_str() + at + 8, nullptr, 10);
      }
    }
    return 0;
  }

  void RunOnce(int trial);

  std::unique_ptr<EtcdCluster> etcd_;
  fs::path dir_;
  std::string prefix_;
  pid_t morphrun_ = -1;
};

void HostedFailoverTest::RunOnce(int trial) {
  dir_ = fs::temp_directory_path() /
         ("morph-hosted-" + std::to_string(getpid()) + "-" + std::to_string(trial));
  prefix_ = "/morph/hosted-test-" + std::to_string(getpid()) + "-" + std::to_string(trial);
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  std::map<std::string, std::string> env = {
      {"MORPH_ETCD_PREFIX", prefix_},
      {"MORPH_ETCD_TTL_S", std::to_string(kTtlS)},
      {"MORPH_ETCD_REJOIN_MS", std::to_string(kRejoinMs)},
      {"MORPH_ETCD_CANDIDATES", "3"},
      {"MORPH_TOKEN", kToken},
      {"MORPH_TOKEN_FILE", ""},
      {"MORPH_COORDINATOR", ""},
      {"MORPH_COORDINATOR_FILE", ""},
      {"MORPH_HEARTBEAT_MS", "50"},
      {"MORPH_CHANGE_TIMEOUT_MS", "30000"},
      {"MORPH_RESHARD_KEEP_OLD", "1"}};
  morphrun_ = SpawnProcess({MORPHRUN, "-n", std::to_string(kWorkers), "--max", "8", "--etcd",
                            etcd_->endpoints(), "--log-dir", dir_.string(), "--",
                            MORPH_ELASTIC_WORKER, "--steps", std::to_string(kSteps), "--out",
                            dir_.string(), "--step-ms", "20", "--variant", "hybrid2"},
                           env, (dir_ / "morphrun.log").string());
  ASSERT_GT(morphrun_, 0);

  const Leader first = WaitLeader(30000);
  ASSERT_FALSE(first.control.empty()) << "no candidate leads\n" << Logs();
  ASSERT_TRUE(WaitStep(40, 60000)) << Logs();
  const int leader_index = CandidateIndex(first.control);
  ASSERT_GE(leader_index, 0) << "no worker log says it hosts " << first.control << "\n" << Logs();
  const pid_t victim = WorkerPid(leader_index);
  ASSERT_GT(victim, 0) << Logs();
  // Candidate 0 (morphrun's first worker, mpirun's rank 0) leads a new job.
  EXPECT_EQ(leader_index, 0) << "candidate " << leader_index << " leads, not candidate 0";
  const int64_t at_kill = MaxStep();

  const auto killed = Clock::now();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  const Leader second = WaitLeader(4 * kTtlS * 1000, first.control);
  const double succession_ms = MsSince(killed);
  ASSERT_FALSE(second.control.empty()) << "no successor leads\n" << Logs();
  EXPECT_LT(succession_ms, 2 * kTtlS * 1000.0) << "a successor leads only after two TTLs";
  // The survivors recover without the killed worker (lost after the rejoin window) and train on.
  ASSERT_TRUE(WaitStep(at_kill + 30, 2 * kTtlS * 1000 + kRejoinMs + 30000))
      << "no training after the leader's worker died\n" << Logs();
  const double recovered_ms = MsSince(killed);
  for (int i = 0; i < kWorkers; ++i) {
    if (i == leader_index) continue;
    EXPECT_FALSE(ExitOf(i, 0).has_value())
        << "worker " << i << " stopped after the leader's worker died\n" << Logs();
  }
  // A grow asked of the successor: it asks morphrun (through etcd) for the worker.
  const auto grow_at = Clock::now();
  const int64_t grow_step = MaxStep();
  // A scheduler retries a resize refused while the previous change completes: workers train
  // in the new generation a moment before the coordinator counted every SwitchDone.
  const auto resize = [&](int port, const std::string& body) {
    const auto until = Clock::now() + std::chrono::seconds(10);
    testing::HttpReply reply = testing::Http(port, "POST", "/v1/resize", body, kToken);
    while (reply.body.find("a resize is in progress") != std::string::npos &&
           Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      reply = testing::Http(port, "POST", "/v1/resize", body, kToken);
    }
    return reply;
  };
  testing::HttpReply r = resize(second.http_port, R"({"world_size":4,"reason":"test"})");
  EXPECT_EQ(r.code, 202) << r.body << "\n" << Logs();
  EXPECT_TRUE(WaitDp(4, grow_step, 60000)) << "no step trained in a world of 4 after the grow\n" << Logs();
  const double grow_ms = MsSince(grow_at);

  // The worker that hosts the successor leaves the job (removed by a resize): its candidate
  // resigns the lead on the way out, the third candidate takes it, and the job goes on.
  const int second_index = CandidateIndex(second.control);
  ASSERT_GE(second_index, 0) << Logs();
  const WorkerId second_worker = WorkerIdOf(second_index);
  ASSERT_GT(second_worker, 0) << Logs();
  r = resize(second.http_port,
             "{\"remove\":[" + std::to_string(second_worker) + "],\"reason\":\"test\"}");
  EXPECT_EQ(r.code, 202) << r.body << "\n" << Logs();
  const auto removed = Clock::now();
  const Leader third = WaitLeader(30000, second.control);
  ASSERT_FALSE(third.control.empty()) << "nobody leads after the leader's worker left\n" << Logs();
  const double handover_ms = MsSince(removed);
  EXPECT_EQ(ExitOf(second_index, 30000), 0)
      << "the worker that left did not exit 0\n" << Logs();
  const int64_t after_handover = MaxStep();
  ASSERT_TRUE(WaitStep(after_handover + 20, 2 * kTtlS * 1000 + kRejoinMs + 30000))
      << "no training after the leader's worker left\n" << Logs();

  std::optional<int> code = WaitExit(morphrun_, 120000);
  ASSERT_TRUE(code.has_value()) << "the job did not end\n" << Logs();
  morphrun_ = -1;
  EXPECT_EQ(*code, 0) << Logs();
  testing::CheckSamples(dir_, kSteps, /*retrained=*/true);
  const std::string run_log = ReadFile(dir_ / "morphrun.log");
  EXPECT_NE(run_log.find("morphrun: worker 4 started"), std::string::npos)
      << "morphrun started no joiner for the grow\n" << run_log;
  std::printf("{\"bench\":\"ha_hosted_leader_kill\",\"trial\":%d,\"leader_index\":%d,"
              "\"killed_at_step\":%ld,\"succession_ms\":%.1f,\"recovered_ms\":%.1f,"
              "\"grow_ms\":%.1f,\"handover_ms\":%.1f}\n",
              trial, leader_index, static_cast<long>(at_kill), succession_ms, recovered_ms,
              grow_ms, handover_ms);
  if (!HasFailure() && std::getenv("MORPH_TEST_KEEP") == nullptr) fs::remove_all(dir_);
}

TEST_F(HostedFailoverTest, LeadingWorkerKilledSuccessorTakesOverAndTheJobCompletes) {
  int trials = 1;
  if (const char* t = std::getenv("MORPH_HOSTED_TRIALS")) trials = std::max(1, std::atoi(t));
  for (int i = 0; i < trials && !HasFailure(); ++i) RunOnce(i);
}

// SIGTERM to morphrun: every worker, the leader's too, is asked to leave; the job stops as
// asked (no worker lost, no candidate left waiting for a successor): morphrun learns it from
// etcd and ends, and every worker exits by itself (none is killed after morphrun's grace
// period) with 0, also one inside a step when the coordinator closed its connection with the
// stop (its step aborts and BeginStep returns done()): morphrun exits 0.
TEST_F(HostedFailoverTest, SigtermStopsEveryWorkerTheLeadersToo) {
  dir_ = fs::temp_directory_path() / ("morph-hosted-" + std::to_string(getpid()) + "-term");
  prefix_ = "/morph/hosted-test-" + std::to_string(getpid()) + "-term";
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  std::map<std::string, std::string> env = {
      {"MORPH_ETCD_PREFIX", prefix_},       {"MORPH_ETCD_TTL_S", std::to_string(kTtlS)},
      {"MORPH_ETCD_REJOIN_MS", "3000"},     {"MORPH_TOKEN", kToken},
      {"MORPH_TOKEN_FILE", ""},             {"MORPH_COORDINATOR", ""},
      {"MORPH_COORDINATOR_FILE", ""},       {"MORPH_HEARTBEAT_MS", "50"},
      {"MORPH_CHANGE_TIMEOUT_MS", "30000"}, {"MORPH_ETCD_CANDIDATES", "2"}};
  morphrun_ = SpawnProcess({MORPHRUN, "-n", "3", "--etcd", etcd_->endpoints(), "--log-dir",
                            dir_.string(), "--", MORPH_ELASTIC_WORKER, "--steps", "1000000",
                            "--out", dir_.string(), "--step-ms", "20"},
                           env, (dir_ / "morphrun.log").string());
  ASSERT_GT(morphrun_, 0);
  ASSERT_FALSE(WaitLeader(30000).control.empty()) << Logs();
  ASSERT_TRUE(WaitStep(20, 60000)) << Logs();
  ASSERT_EQ(kill(morphrun_, SIGTERM), 0);
  // Well within morphrun's 10 s grace before it SIGKILLs what still runs.
  std::optional<int> code = WaitExit(morphrun_, 8000);
  ASSERT_TRUE(code.has_value()) << "morphrun did not end after SIGTERM\n" << Logs();
  morphrun_ = -1;
  EXPECT_EQ(*code, 0) << Logs();
  for (int i = 0; i < 3; ++i) {
    std::optional<int> worker = ExitOf(i, 0);
    EXPECT_EQ(worker, 0) << "worker " << i << "\n" << Logs();
  }
  EXPECT_NE(ReadFile(dir_ / "morphrun.log").find("every worker was asked to leave"),
            std::string::npos)
      << Logs();
}

// morphrun --etcd without MORPH_ETCD_PREFIX: a fresh prefix for this launch; a job without
// failures completes (the leader's worker hosts it to the end, the followers stop), morphrun exits
// 0 and deletes the job's keys.
TEST_F(HostedFailoverTest, AJobCompletesAndItsFreshPrefixIsDeleted) {
  dir_ = fs::temp_directory_path() / ("morph-hosted-" + std::to_string(getpid()) + "-fresh");
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  std::map<std::string, std::string> env = {
      {"MORPH_ETCD_PREFIX", ""},  {"MORPH_TOKEN", kToken},          {"MORPH_TOKEN_FILE", ""},
      {"MORPH_COORDINATOR", ""},  {"MORPH_COORDINATOR_FILE", ""},   {"MORPH_HEARTBEAT_MS", "50"},
      {"MORPH_ETCD_TTL_S", "2"}};
  morphrun_ = SpawnProcess({MORPHRUN, "-n", "3", "--etcd", etcd_->endpoints(), "--log-dir",
                            dir_.string(), "--", MORPH_ELASTIC_WORKER, "--steps", "40", "--out",
                            dir_.string(), "--step-ms", "10"},
                           env, (dir_ / "morphrun.log").string());
  ASSERT_GT(morphrun_, 0);
  std::optional<int> code = WaitExit(morphrun_, 60000);
  ASSERT_TRUE(code.has_value()) << "the job did not end\n" << Logs();
  morphrun_ = -1;
  EXPECT_EQ(*code, 0) << Logs();
  testing::CheckSamples(dir_, 40);
  EXPECT_NE(ReadFile(dir_ / "morphrun.log").find("prefix /morph/morphrun-"), std::string::npos)
      << Logs();
  EtcdClient etcd(etcd_->options());
  StatusOr<std::vector<EtcdKv>> left = etcd.GetPrefix("/morph/morphrun-");
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty()) << left->size() << " key(s) left, e.g. " << left->front().key;
}

// A job owns exactly its keys (issue 35, item 5: morphrun treated a second job's keys under
// <prefix>/launch/ as launch requests and deleted them, 4 times in 100 ms). Keys under this job's
// launch prefix that are not a leader's launch request, and keys of a job nested under its
// prefix, stay through the job and after it; a prefix inside another job's keys ("launch",
// "leader", "state" segments) is refused where it is given.
TEST_F(HostedFailoverTest, MorphrunTouchesOnlyItsOwnKeys) {
  dir_ = fs::temp_directory_path() / ("morph-hosted-" + std::to_string(getpid()) + "-keys");
  prefix_ = "/morph/hosted-test-" + std::to_string(getpid()) + "-keys";
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  EtcdClient etcd(etcd_->options());
  const std::vector<std::string> strangers = {prefix_ + "/launch/j2/leader",
                                              prefix_ + "/launch/j2/state",
                                              prefix_ + "/launch/not-a-request",
                                              prefix_ + "/sub/state"};
  for (const std::string& k : strangers) ASSERT_TRUE(etcd.Put(k, "another job's").ok());
  std::map<std::string, std::string> env = {
      {"MORPH_ETCD_PREFIX", prefix_}, {"MORPH_TOKEN", kToken},        {"MORPH_TOKEN_FILE", ""},
      {"MORPH_COORDINATOR", ""},      {"MORPH_COORDINATOR_FILE", ""}, {"MORPH_HEARTBEAT_MS", "50"},
      {"MORPH_ETCD_TTL_S", "2"}};
  morphrun_ = SpawnProcess({MORPHRUN, "-n", "2", "--etcd", etcd_->endpoints(), "--log-dir",
                            dir_.string(), "--", MORPH_ELASTIC_WORKER, "--steps", "60", "--out",
                            dir_.string(), "--step-ms", "20"},
                           env, (dir_ / "morphrun.log").string());
  ASSERT_GT(morphrun_, 0);
  std::optional<int> code = WaitExit(morphrun_, 60000);
  ASSERT_TRUE(code.has_value()) << "the job did not end\n" << Logs();
  morphrun_ = -1;
  EXPECT_EQ(*code, 0) << Logs();
  for (const std::string& k : strangers) {
    StatusOr<std::optional<EtcdKv>> got = etcd.Get(k);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->has_value()) << k << " was deleted";
  }
  // A prefix among another job's keys is refused, naming the segment.
  env["MORPH_ETCD_PREFIX"] = prefix_ + "/launch/j2";
  pid_t p = SpawnProcess({MORPHRUN, "-n", "1", "--etcd", etcd_->endpoints(), "--", "/bin/true"},
                         env, (dir_ / "nested.log").string());
  EXPECT_EQ(WaitExit(p, 20000), 2);
  EXPECT_NE(ReadFile(dir_ / "nested.log").find("segment 'launch'"), std::string::npos)
      << ReadFile(dir_ / "nested.log");
}

#ifdef MORPH_MPIEXEC
// Under `mpirun --enable-recovery` with MORPH_ETCD: ranks 0, 1, 2 host candidates and rank 0
// leads; rank 0's process SIGKILLed (without failover every rank stops: launch_test's
// MpirunRankZeroKilledStopsEveryRank): a successor in rank 1 or 2 leads, the three others recover
// and complete the job, every step's samples in order, no rank stops for the coordinator.
TEST_F(HostedFailoverTest, MpirunRankZeroKilledTheJobGoesOn) {
  if (std::string why = testing::MpirunWithRecoveryUnusable(MORPH_MPIEXEC); !why.empty()) {
    GTEST_SKIP() << why;
  }
  dir_ = fs::temp_directory_path() / ("morph-hosted-" + std::to_string(getpid()) + "-mpi");
  prefix_ = "/morph/hosted-test-" + std::to_string(getpid()) + "-mpi";
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  constexpr int64_t kMpiSteps = 400;
  std::map<std::string, std::string> env = {
      {"MORPH_ETCD", etcd_->endpoints()},   {"MORPH_ETCD_PREFIX", prefix_},
      {"MORPH_ETCD_TTL_S", std::to_string(kTtlS)},
      {"MORPH_ETCD_REJOIN_MS", std::to_string(kRejoinMs)},
      {"MORPH_TOKEN", kToken},              {"MORPH_TOKEN_FILE", ""},
      {"MORPH_COORDINATOR", ""},            {"MORPH_COORDINATOR_FILE", ""},
      {"MORPH_HEARTBEAT_MS", "50"},         {"MORPH_CHANGE_TIMEOUT_MS", "30000"},
      {"MORPH_RESHARD_KEEP_OLD", "1"}};
  const pid_t mpirun = SpawnProcess(
      testing::MpirunArgv(MORPH_MPIEXEC, kWorkers, /*enable_recovery=*/true,
                          {MORPH_ELASTIC_WORKER, "--steps", std::to_string(kMpiSteps), "--out",
                           dir_.string(), "--step-ms", "20", "--variant", "hybrid2"},
                          env),
      env, (dir_ / "mpirun.log").string());
  ASSERT_GT(mpirun, 0);
  morphrun_ = mpirun;  // TearDown stops it
  const Leader first = WaitLeader(30000);
  ASSERT_FALSE(first.control.empty()) << ReadFile(dir_ / "mpirun.log");
  ASSERT_TRUE(WaitStep(40, 60000)) << ReadFile(dir_ / "mpirun.log");
  std::map<int, pid_t> ranks = testing::MpiRanks(mpirun);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kWorkers)) << ReadFile(dir_ / "mpirun.log");
  EXPECT_NE(ReadFile(dir_ / "mpirun.log")
                .find("hosting coordinator candidate 0 of 3 at " + first.control + " "),
            std::string::npos)
      << "rank 0 does not lead\n" << ReadFile(dir_ / "mpirun.log");
  const int64_t at_kill = MaxStep();
  const auto killed = Clock::now();
  ASSERT_EQ(kill(ranks[0], SIGKILL), 0);
  const Leader second = WaitLeader(4 * kTtlS * 1000, first.control);
  const double succession_ms = MsSince(killed);
  ASSERT_FALSE(second.control.empty()) << ReadFile(dir_ / "mpirun.log");
  EXPECT_LT(succession_ms, 2 * kTtlS * 1000.0);
  ASSERT_TRUE(WaitStep(at_kill + 30, 2 * kTtlS * 1000 + kRejoinMs + 30000))
      << "no training after rank 0 died\n" << ReadFile(dir_ / "mpirun.log");
  EXPECT_EQ(testing::MpiRanks(mpirun).size(), static_cast<size_t>(kWorkers - 1))
      << ReadFile(dir_ / "mpirun.log");
  std::optional<int> code = WaitExit(mpirun, 120000);
  ASSERT_TRUE(code.has_value()) << "the job did not end\n" << ReadFile(dir_ / "mpirun.log");
  morphrun_ = -1;
  const std::string log = ReadFile(dir_ / "mpirun.log");
  EXPECT_EQ(testing::CoordinatorLostLines(log), 0) << log;
  testing::CheckSamples(dir_, kMpiSteps, /*retrained=*/true);
  std::printf("{\"bench\":\"ha_mpirun_rank0_kill\",\"succession_ms\":%.1f}\n", succession_ms);
}
#endif  // MORPH_MPIEXEC

}  // namespace
}  // namespace morph
