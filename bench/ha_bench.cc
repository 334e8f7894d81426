// Coordinator failover's etcd cost (make bench-ha): the latency of one fenced state write, as
// the leader makes after every decision (EtcdClient::FencedPut on a private 3-member etcd on
// loopback, EtcdCluster), for the saved decider state of jobs of 8 to 4,096 workers (about 60
// bytes per worker); and how long a candidate takes to lead once its leader resigned (its lease
// revoked). A leader's crash (its lease left to expire) is measured with real processes by
// coordinator_failover_test (make bench-ha runs it too). JSON lines. Skipped without etcd.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "runtime/ha/election.h"
#include "runtime/ha/etcd_testutil.h"

namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1)))];
}

}  // namespace

int main() {
  auto cluster = morph::EtcdCluster::Start(3);
  if (!cluster.ok()) {
    std::fprintf(stderr, "ha_bench: skipped: %s\n", cluster.status().ToString().c_str());
    return 0;
  }
  morph::EtcdClient etcd((*cluster)->options());
  auto lease = etcd.LeaseGrant(10);
  if (!lease.ok() || !etcd.CreateIfAbsent("/bench/leader", "me", *lease).ok()) return 1;
  morph::EtcdFence fence{.key = "/bench/leader", .value = "me", .lease = *lease};
  for (int workers : {8, 64, 512, 4096}) {
    const std::string state(static_cast<size_t>(workers) * 60, 'x');
    std::vector<double> ms;
    for (int i = 0; i < 200; ++i) {
      const auto t0 = Clock::now();
      morph::Status s = etcd.FencedPut(fence, {{"/bench/state", state}});
      ms.push_back(Ms(Clock::now() - t0));
      if (!s.ok()) {
        std::fprintf(stderr, "ha_bench: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    std::printf("{\"bench\":\"ha_fenced_write\",\"workers\":%d,\"bytes\":%zu,\"median_ms\":%.2f,"
                "\"p90_ms\":%.2f,\"max_ms\":%.2f,\"writes\":%zu}\n",
                workers, state.size(), Pct(ms, 0.5), Pct(ms, 0.9), Pct(ms, 1.0), ms.size());
  }
  (void)etcd.LeaseRevoke(*lease);
  // Succession on a resign: two candidates (TTL 2 s); the follower polls every TTL/8.
  for (int run = 0; run < 5; ++run) {
    std::atomic<int> leaders{0};
    auto make = [&](const char* v) {
      return morph::Election::Start(
          morph::ElectionOptions{.etcd = (*cluster)->options(), .prefix = "/bench/job" +
                                 std::to_string(run), .value = v, .ttl_s = 2},
          morph::Election::Callbacks{.elected = [&](const morph::EtcdFence&) { ++leaders; }});
    };
    auto a = make("a");
    while (leaders.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto b = make("b");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto t0 = Clock::now();
    (*a)->Stop();
    while (leaders.load() < 2 && Clock::now() - t0 < std::chrono::seconds(10)) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::printf("{\"bench\":\"ha_resign_to_successor\",\"run\":%d,\"ms\":%.1f}\n", run,
                Ms(Clock::now() - t0));
  }
  return 0;
}
