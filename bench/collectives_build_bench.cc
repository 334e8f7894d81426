// Rebuild costs, one JSON object per line:
//  - "build_generation": time for every rank (forked processes, TCP store, Gloo on loopback)
//    to build all communicators of a generation (world + DP/TP/PP via GroupBuilder) for
//    worlds 2, 4, 8; compared with building the world communicator alone in the same run
//    (ratio_vs_world_only) and with the 100 ms target at 8 ranks (ratio_vs_target).
//  - "abort_latency": time from Abort() (another thread) to the blocked call returning,
//    against the same blocked call left to its timeout (ratio_vs_timeout).
//   build/bench/collectives_build_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "collectives/gloo/gloo_communicator.h"
#include "collectives/groups.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

constexpr char kToken[] = "bench-token";
constexpr int kReps = 10;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

ParallelConfig ConfigFor(int world) {
  ParallelConfig c;
  c.tp = world >= 4 ? 2 : 1;
  c.pp = world >= 8 ? 2 : 1;
  c.dp = world / (c.tp * c.pp);
  if (c.pp > 1) c.stage_of_layer = {0, 1};
  return c;
}

// Child: for each repetition and mode, barrier then build; rank 0 reports the time until
// everyone built (second barrier).
Status Child(const std::string& address, int rank, int world) {
  MORPH_ASSIGN_OR_RETURN(auto base,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(30000)));
  MORPH_ASSIGN_OR_RETURN(auto device, GlooDevice::Create(GlooOptions{}));
  GroupBuilder builder(GlooFactory(device));
  const ParallelConfig config = ConfigFor(world);
  std::vector<double> all_groups, world_only;
  // Each repetition advances the store, which drops the previous generation's keys.
  int64_t generation = 1;
  for (int rep = 0; rep < kReps; ++rep) {
    for (int mode = 0; mode < 2; ++mode, ++generation) {
      MORPH_ASSIGN_OR_RETURN(auto store, base->ForGeneration(generation, Deadline::AfterMs(30000)));
      Deadline d = Deadline::AfterMs(30000);
      MORPH_RETURN_IF_ERROR(StoreBarrier(*store, "start", world, d));
      // Everyone has left the previous generation: drop its keys.
      if (rank == 0) {
        MORPH_RETURN_IF_ERROR(store->AdvanceGeneration(generation, d));
      }
      double t0 = Now();
      if (mode == 0) {
        MORPH_ASSIGN_OR_RETURN(auto set, builder.Build(*store, config, rank, world, d));
        MORPH_RETURN_IF_ERROR(StoreBarrier(*store, "built", world, d));
        all_groups.push_back(Now() - t0);
      } else {
        MORPH_ASSIGN_OR_RETURN(auto comm,
                               GlooCommunicator::Create(*store, "world", rank, world, device, d));
        MORPH_RETURN_IF_ERROR(StoreBarrier(*store, "built", world, d));
        world_only.push_back(Now() - t0);
      }
      MORPH_RETURN_IF_ERROR(StoreBarrier(*store, "released", world, d));
    }
  }
  if (rank == 0) {
    std::sort(all_groups.begin(), all_groups.end());
    std::sort(world_only.begin(), world_only.end());
    double a = all_groups[kReps / 2], w = world_only[kReps / 2];
    std::printf(
        "{\"name\":\"build_generation\",\"backend\":\"gloo\",\"ranks\":%d,\"config\":\"%s\","
        "\"bytes\":0,\"seconds\":%.6f,\"world_only_seconds\":%.6f,\"ratio_vs_world_only\":%.3f,"
        "\"target_seconds\":0.1,\"ratio_vs_target\":%.3f,\"reps\":%d}\n",
        world, config.ToString().c_str(), a, w, a / w, a / 0.1, kReps);
  }
  return Status::Ok();
}

// Forks the ranks before the store server's thread exists (see ForkedRanks::Fork).
void BuildBench(int world) {
  ForkedRanks ranks = ForkedRanks::Fork(world, [&](int rank, const std::string& address) {
    return ExitCode(rank, Child(address, rank, world));
  });
  auto server = TcpStoreServer::Start("127.0.0.1", 0, kToken);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return;
  }
  ranks.Release((*server)->address());
  std::vector<int> codes = ranks.Wait(Deadline::AfterMs(120000));
  for (int r = 0; r < world; ++r) {
    if (codes[r] != 0)
      std::fprintf(stderr, "build bench: world %d rank %d exit %d\n", world, r, codes[r]);
  }
}

// A barrier rank 1 never joins: once aborted from another thread, once left to time out.
void AbortBench() {
  auto table = std::make_shared<KvTable>();
  auto device = *GlooDevice::Create(GlooOptions{});
  std::vector<double> abort_s;
  double timeout_s = 0;
  const auto kTimeout = std::chrono::milliseconds(2000);
  for (int rep = 0; rep <= kReps; ++rep) {
    std::vector<std::unique_ptr<GlooCommunicator>> comms(2);
    RunRankThreads(2, [&](int rank) -> Status {
      MemoryStore store(table, rep);
      MORPH_ASSIGN_OR_RETURN(comms[rank], GlooCommunicator::Create(store, "abort", rank, 2, device,
                                                                   Deadline::AfterMs(10000)));
      return Status::Ok();
    });
    if (comms[0] == nullptr || comms[1] == nullptr) return;
    if (rep == kReps) {  // the baseline: nobody aborts
      double t0 = Now();
      (void)comms[0]->Barrier(kTimeout);
      timeout_s = Now() - t0;
      break;
    }
    double aborted_at = 0;
    std::thread t([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      aborted_at = Now();
      comms[0]->Abort();
    });
    (void)comms[0]->Barrier(kTimeout);
    double returned = Now();
    t.join();
    abort_s.push_back(returned - aborted_at);
  }
  std::sort(abort_s.begin(), abort_s.end());
  double a = abort_s[abort_s.size() / 2];
  std::printf(
      "{\"name\":\"abort_latency\",\"backend\":\"gloo\",\"ranks\":2,\"bytes\":0,\"seconds\":%.6f,"
      "\"max_seconds\":%.6f,\"timeout_seconds\":%.6f,\"ratio_vs_timeout\":%.4f,\"reps\":%d}\n",
      a, abort_s.back(), timeout_s, a / timeout_s, kReps);
}

}  // namespace
}  // namespace morph

int main() {
  for (int world : {2, 4, 8}) morph::BuildBench(world);
  morph::AbortBench();
  return 0;
}
