// Hosts as network namespaces (issue 10, label netns): four "hosts", each a network namespace
// with its own address on a veth pair to a bridge in this namespace, one elastic_worker in
// each, morphd here on the bridge's address. One host is cut off with `ip link set down`: no
// connection closes, so only the coordinator's heartbeat timeout can notice; the coordinator
// aborts the generation, the three others recover in place (hybrid ZeRO: every piece has a
// replica), check their state bitwise at every step and complete the job.
//
// Needs root and iproute2 (`ip netns`, veth, bridge): skipped, saying why, where a namespace
// cannot be created. Bounded: every wait has a timeout; TearDown kills every process it
// started and deletes the namespaces, links and the job's directory.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
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
using testing::Sh;
using testing::SpawnProcess;
using testing::WaitExit;

constexpr char kToken[] = "netns-token";
constexpr int kHosts = 4;
constexpr int64_t kHeartbeatTimeoutMs = 2000;
constexpr int64_t kSteps = 150;


class NetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int id = static_cast<int>(getpid() % 200) + 20;
    tag_ = "m" + std::to_string(getpid() % 100000);
    subnet_ = "10.213." + std::to_string(id) + ".";
    bridge_ = tag_ + "br";
    dir_ = fs::temp_directory_path() / ("morph-netns-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    for (pid_t p : launched_) {
      if (kill(p, 0) == 0) kill(p, SIGKILL);
      WaitExit(p, 5000);
    }
    for (const std::string& ns : namespaces_) Sh("ip netns del " + ns);
    if (bridge_up_) Sh("ip link del " + bridge_);
    if (!HasFailure()) fs::remove_all(dir_);
  }

  std::string Ns(int i) const { return tag_ + "h" + std::to_string(i); }
  std::string HostVeth(int i) const { return tag_ + "v" + std::to_string(i); }  // in the ns
  std::string BridgeVeth(int i) const { return tag_ + "b" + std::to_string(i); }
  std::string Address(int i) const { return subnet_ + std::to_string(10 + i); }

  // The bridge here (subnet .1) and kHosts namespaces on it. Empty, or why it failed.
  std::string BuildHosts() {
    std::string out;
    if (Sh("ip link add " + bridge_ + " type bridge", &out) != 0) return "bridge: " + out;
    bridge_up_ = true;
    if (Sh("ip addr add " + subnet_ + "1/24 dev " + bridge_ + " && ip link set " + bridge_ +
               " up",
           &out) != 0) {
      return "bridge address: " + out;
    }
    for (int i = 0; i < kHosts; ++i) {
      if (Sh("ip netns add " + Ns(i), &out) != 0) return "ip netns add: " + out;
      namespaces_.push_back(Ns(i));
      const std::string in_ns = "ip netns exec " + Ns(i) + " ";
      const std::string cmd =
          "ip link add " + BridgeVeth(i) + " type veth peer name " + HostVeth(i) +
          " && ip link set " + HostVeth(i) + " netns " + Ns(i) + " && ip link set " +
          BridgeVeth(i) + " master " + bridge_ + " && ip link set " + BridgeVeth(i) + " up && " +
          in_ns + "ip addr add " + Address(i) + "/24 dev " + HostVeth(i) + " && " + in_ns +
          "ip link set " + HostVeth(i) + " up && " + in_ns + "ip link set lo up";
      if (Sh(cmd, &out) != 0) return "veth for " + Ns(i) + ": " + out;
    }
    return "";
  }

  pid_t Spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
              const std::string& log) {
    pid_t p = SpawnProcess(argv, env, (dir_ / log).string());
    EXPECT_GT(p, 0);
    launched_.push_back(p);
    return p;
  }

  std::string Logs() const { return testing::WorkerLogs(dir_); }

  std::string tag_, subnet_, bridge_;
  bool bridge_up_ = false;
  std::vector<std::string> namespaces_;
  fs::path dir_;
  std::vector<pid_t> launched_;
};

TEST_F(NetnsTest, AHostCutOffIsDetectedByHeartbeatAndTheJobGoesOn) {
  if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root (euid " << geteuid() << ")";
  std::string out;
  if (Sh("command -v ip", &out) != 0) GTEST_SKIP() << "no `ip` (iproute2) on this machine";
  const std::string probe = tag_ + "probe";
  if (Sh("ip netns add " + probe, &out) != 0) {
    GTEST_SKIP() << "cannot create a network namespace here: " << out;
  }
  Sh("ip netns del " + probe);
  const std::string why = BuildHosts();
  ASSERT_EQ(why, "");

  pid_t morphd = Spawn({MORPHD, "--address", subnet_ + "1", "--initial-world",
                        std::to_string(kHosts), "--no-http", "--heartbeat-timeout-ms",
                        std::to_string(kHeartbeatTimeoutMs)},
                       {{"MORPH_TOKEN", kToken}, {"MORPH_TOKEN_FILE", ""}}, "morphd.out");
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

  std::vector<pid_t> workers;
  for (int i = 0; i < kHosts; ++i) {
    // `ip netns exec` execs the worker in the namespace (same pid).
    workers.push_back(Spawn({"/usr/sbin/ip", "netns", "exec", Ns(i), MORPH_ELASTIC_WORKER,
                             "--steps", std::to_string(kSteps), "--out", dir_.string(),
                             "--step-ms", "40", "--variant", "hybrid2"},
                            {{"MORPH_COORDINATOR", control},
                             {"MORPH_TOKEN", kToken},
                             {"MORPH_TOKEN_FILE", ""},
                             {"MORPH_COORDINATOR_FILE", ""},
                             {"MORPH_HEARTBEAT_MS", "50"},
                             {"MORPH_HEARTBEAT_TIMEOUT_MS", std::to_string(kHeartbeatTimeoutMs)},
                             {"MORPH_CHANGE_TIMEOUT_MS", "15000"},
                             {"MORPH_START_TIMEOUT_MS", "60000"},
                             {"MORPH_GLOO_HOSTNAME", Address(i)}},
                            "worker-" + std::to_string(i) + ".log"));
  }
  // Every worker trains a few steps.
  auto trained = [&] {
    int files = 0;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() == ".samples" && ReadFile(e.path()).size() > 0) ++files;
    }
    return files;
  };
  until = Clock::now() + std::chrono::seconds(60);
  while (trained() < kHosts && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(trained(), kHosts) << ReadFile(dir_ / "morphd.out") << Logs();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));

  // Host 2 goes silent: its link down, from inside its namespace. No connection closes.
  constexpr int kCut = 2;
  const Clock::time_point cut = Clock::now();
  ASSERT_EQ(Sh("ip netns exec " + Ns(kCut) + " ip link set " + HostVeth(kCut) + " down", &out), 0)
      << out;
  // The job completes without it: morphd exits 0, the three others exit 0.
  std::optional<int> code = WaitExit(morphd, 120000);
  ASSERT_TRUE(code.has_value()) << "morphd still runs 120 s after the cut\n"
                                << ReadFile(dir_ / "morphd.out") << Logs();
  const double seconds = std::chrono::duration<double>(Clock::now() - cut).count();
  EXPECT_EQ(*code, 0) << ReadFile(dir_ / "morphd.out");
  for (int i = 0; i < kHosts; ++i) {
    if (i == kCut) continue;
    std::optional<int> c = WaitExit(workers[static_cast<size_t>(i)], 30000);
    ASSERT_TRUE(c.has_value()) << "worker " << i << " still runs\n" << Logs();
    EXPECT_EQ(*c, 0) << "worker " << i << "\n" << Logs();
  }
  const std::string coord = ReadFile(dir_ / "morphd.out");
  // Found by the heartbeat timeout (not a closed connection), then a recovery from replicas.
  EXPECT_NE(coord.find("no heartbeat for more than " + std::to_string(kHeartbeatTimeoutMs) +
                      " ms"),
            std::string::npos)
      << coord;
  const std::string logs = Logs();
  EXPECT_NE(logs.find("from replicas (newest "), std::string::npos) << logs;
  std::printf("netns: host %d cut off; the job completed %.1f s later (heartbeat timeout %.1f s)\n",
              kCut, seconds, kHeartbeatTimeoutMs / 1e3);
  // The cut-off worker cannot reach anyone: its heartbeats go unacknowledged, so after the
  // heartbeat timeout it takes the coordinator as gone, aborts its collectives and stops
  // (exit 4, UNAVAILABLE) instead of waiting alone.
  const int64_t bound_ms = kHeartbeatTimeoutMs + 8000;
  const int64_t left = bound_ms - std::chrono::duration_cast<std::chrono::milliseconds>(
                                      Clock::now() - cut).count();
  std::optional<int> cut_code = WaitExit(workers[kCut], std::max<int64_t>(left, 0));
  EXPECT_TRUE(cut_code.has_value()) << "the cut-off worker still runs " << bound_ms
                                    << " ms after the cut\n"
                                    << ReadFile(dir_ / ("worker-" + std::to_string(kCut) + ".log"));
  if (cut_code) {
    EXPECT_EQ(*cut_code, 4);
    const std::string cut_log = ReadFile(dir_ / ("worker-" + std::to_string(kCut) + ".log"));
    EXPECT_EQ(testing::CoordinatorLostLines(cut_log), 1) << cut_log;
  }
  std::printf("netns: the cut-off worker stopped %.1f s after the cut\n",
              std::chrono::duration<double>(Clock::now() - cut).count());
  // Its samples stop at the cut, which the check allows (a step trained again later counts
  // from its latest generation).
  testing::CheckSamples(dir_, kSteps, /*retrained=*/true);
}

}  // namespace
}  // namespace morph
