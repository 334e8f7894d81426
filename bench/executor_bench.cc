// Reshard executor throughput: 4 ranks as threads over the in-process transport, three
// reconfigurations of one model state planned by the real planner (plan.h), each next to plain
// memcpy of the same bytes by the same number of threads, in the same run. One JSON object per
// line:
//   {"name":"executor/tp4to2","bytes":<bytes landing in new shards>,"seconds":...,
//    "memcpy_seconds":...,"ratio":<memcpy_seconds/seconds>, ...}
// Usage: executor_bench [--mb=2048] [--reps=2] [--verify]
//   --mb      total model state in MiB (f32 matrices of 2048 x 2048 = 16 MiB each)
//   --verify  fill old shards from reference tensors and check every new shard bitwise (slow;
//             not timed)
// BENCH_ONLY=<substring> runs only the matching scenarios; BENCH_DEBUG=1 prints per-rank stats;
// BENCH_NO_STRIDED=1 turns ExecutorOptions::strided_messages off (pack/unpack through staging).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "reshard/executor.h"
#include "reshard/inproc_transport.h"
#include "reshard/plan.h"
#include "reshard/reshard_testutil.h"
#include "reshard/strided_copy.h"

namespace morph {
namespace {

using namespace testutil;  // NOLINT
using Clock = std::chrono::steady_clock;

// A reconfiguration planned by the real planner (plan.h).
struct Scenario {
  std::string name;
  PlanInput in;
};

ParallelConfig Config(int dp, int tp, int pp, int layers) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(layers, pp);
  return c;
}

Scenario Make(std::string name, int64_t mb, bool zero, ParallelConfig from, ParallelConfig to,
              std::vector<int32_t> available) {
  Scenario s{std::move(name), {}};
  s.in.tensors = testutil::MatrixModel(mb, zero);
  s.in.old_config = from;
  s.in.new_config = to;
  s.in.old_participant_of_rank = {0, 1, 2, 3};
  s.in.available = std::move(available);
  s.in.num_participants = 4;
  return s;
}

std::vector<Scenario> Scenarios(int64_t mb) {
  const int layers = static_cast<int>(std::max<int64_t>(4, mb / 16) / 4);
  return {
      // TP 4 -> 2: participants 2 and 3 leave.
      Make("executor/tp4to2", mb, false, Config(1, 4, 1, layers), Config(1, 2, 1, layers), {0, 1}),
      // DP 4 -> 3 with ZeRO-sharded state (replicated state would not move): 3 leaves.
      Make("executor/dp4to3_zero", mb, true, Config(4, 1, 1, layers), Config(3, 1, 1, layers),
           {0, 1, 2}),
      // PP 2 -> 1 at TP 2: stage 1's participants 2, 3 leave, stage 0's take every layer.
      Make("executor/pp2to1_tp2", mb, false, Config(1, 2, 2, layers), Config(1, 2, 1, layers),
           {0, 1}),
  };
}

struct Rank {
  std::vector<std::vector<char>> olds, news;
  std::vector<OldShardData> old_views;
  std::vector<NewShardData> new_views;
};

void Run(const Scenario& s, int reps, bool verify) {
  const int n = 4;
  auto planner = Planner::Create(s.in);
  if (!planner.ok()) {
    std::fprintf(stderr, "%s: %s\n", s.name.c_str(), planner.status().ToString().c_str());
    std::exit(1);
  }
  auto plans_or = planner->PlanAll();
  if (!plans_or.ok()) {
    std::fprintf(stderr, "%s: %s\n", s.name.c_str(), plans_or.status().ToString().c_str());
    std::exit(1);
  }
  const std::vector<LocalPlan> plans = std::move(plans_or).value();
  std::vector<Rank> ranks(n);
  std::unique_ptr<std::vector<std::vector<char>>> reference;
  if (verify) {
    reference = std::make_unique<std::vector<std::vector<char>>>();
    for (size_t t = 0; t < plans[0].tensors.size(); ++t) {
      reference->push_back(ReferenceTensor(plans[0].tensors[t], static_cast<int>(t)));
    }
  }
  int64_t state_bytes = 0, moved = 0;
  for (int p = 0; p < n; ++p) {
    const LocalPlan& plan = plans[static_cast<size_t>(p)];
    Rank& r = ranks[static_cast<size_t>(p)];
    r.olds.resize(plan.tensors.size());
    r.news.resize(plan.tensors.size());
    for (size_t t = 0; t < plan.tensors.size(); ++t) {
      const TensorInfo& info = plan.tensors[t];
      if (plan.old_shards[t]) {
        if (reference) {
          r.olds[t] = ExtractShard(info, *plan.old_shards[t], (*reference)[t]);
        } else {
          r.olds[t].assign(static_cast<size_t>(plan.old_shards[t]->NumElements() * 4),
                           static_cast<char>(p + t));
        }
        r.old_views.push_back(
            {info.name, info.dtype,
             ConstBufferView(r.olds[t].data(), r.olds[t].size(), MemoryKind::kHost)});
        state_bytes += static_cast<int64_t>(r.olds[t].size());
      }
      if (plan.new_shards[t]) {
        r.news[t].assign(static_cast<size_t>(plan.new_shards[t]->NumElements() * 4), 0);  // touched
        r.new_views.push_back({info.name, info.dtype,
                               BufferView{r.news[t].data(), r.news[t].size(), MemoryKind::kHost}});
      }
    }
  }
  ExecutorOptions opts = *ExecutorOptions::FromEnv();  // MORPH_RESHARD_* or defaults
  if (std::getenv("BENCH_NO_STRIDED")) opts.strided_messages = false;  // staged path
  double best = 1e30;
  std::vector<ExecutorStats> stats(n);
  for (int rep = 0; rep < reps; ++rep) {
    auto hub = std::make_shared<InProcHub>(n);
    std::vector<std::thread> th;
    const auto t0 = Clock::now();
    for (int p = 0; p < n; ++p) {
      th.emplace_back([&, p] {
        InProcTransport tr(hub, p);
        auto r = ExecutePlan(plans[static_cast<size_t>(p)], ranks[static_cast<size_t>(p)].old_views,
                             ranks[static_cast<size_t>(p)].new_views, tr, opts,
                             Deadline::AfterMs(600000));
        if (!r.ok()) {
          std::fprintf(stderr, "%s rank %d: %s\n", s.name.c_str(), p,
                       r.status().ToString().c_str());
          std::exit(1);
        }
        stats[static_cast<size_t>(p)] = *r;
        if (std::getenv("BENCH_DEBUG"))
          std::fprintf(stderr, "%s rank %d: %s\n", s.name.c_str(), p, r->ToString().c_str());
      });
    }
    for (auto& t : th) t.join();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  int64_t received = 0, copied = 0, zero_copy = 0, strided = 0, messages = 0, staging_peak = 0;
  for (const auto& st : stats) {
    received += st.bytes_received;
    copied += st.bytes_copied;
    zero_copy += st.messages_zero_copy;
    strided += st.messages_strided;
    messages += st.messages_received + st.messages_sent;
    staging_peak = std::max(staging_peak, st.staging_peak_bytes);
  }
  moved = received + copied;
  // Baseline: each rank's thread memcpys the bytes that land in its new shards, concurrently.
  // Baseline buffers are kept across scenarios (first-touching them again would dominate the
  // benchmark's run time, not its measurements).
  static std::vector<std::vector<char>> src(n), dst(n);
  std::vector<size_t> want(n);
  for (int p = 0; p < n; ++p) {
    const size_t i = static_cast<size_t>(p);
    want[i] = static_cast<size_t>(stats[i].bytes_received + stats[i].bytes_copied);
    if (src[i].size() < want[i]) {
      src[i].assign(want[i], 1);
      dst[i].assign(want[i], 0);
    }
  }
  double best_memcpy = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<std::thread> th;
    const auto t0 = Clock::now();
    for (int p = 0; p < n; ++p) {
      th.emplace_back([&, p] {
        const size_t i = static_cast<size_t>(p);
        if (want[i] > 0) std::memcpy(dst[i].data(), src[i].data(), want[i]);
      });
    }
    for (auto& t : th) t.join();
    best_memcpy = std::min(best_memcpy, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::printf(
      "{\"name\":\"%s\",\"bytes\":%lld,\"seconds\":%.6f,\"gbps\":%.3f,"
      "\"memcpy_seconds\":%.6f,\"memcpy_gbps\":%.3f,\"ratio\":%.3f,\"state_bytes\":%lld,"
      "\"bytes_received\":%lld,\"bytes_copied\":%lld,\"messages\":%lld,"
      "\"zero_copy_messages\":%lld,\"strided_messages\":%lld,\"staging_peak_bytes\":%lld,"
      "\"ranks\":%d}\n",
      s.name.c_str(), static_cast<long long>(moved), best, moved / best / 1e9, best_memcpy,
      moved / best_memcpy / 1e9, best_memcpy / best, static_cast<long long>(state_bytes),
      static_cast<long long>(received), static_cast<long long>(copied),
      static_cast<long long>(messages), static_cast<long long>(zero_copy),
      static_cast<long long>(strided), static_cast<long long>(staging_peak), n);
  std::fflush(stdout);
  if (verify) {
    // Old shards were filled from the reference tensors; every new shard must match them.
    for (int p = 0; p < n; ++p) {
      const LocalPlan& plan = plans[static_cast<size_t>(p)];
      for (size_t t = 0; t < plan.tensors.size(); ++t) {
        if (!plan.new_shards[t]) continue;
        if (ranks[static_cast<size_t>(p)].news[t] !=
            ExtractShard(plan.tensors[t], *plan.new_shards[t], (*reference)[t])) {
          std::fprintf(stderr, "%s: verify failed at participant %d tensor %zu\n", s.name.c_str(),
                       p, t);
          std::exit(1);
        }
      }
    }
    std::fprintf(stderr, "%s: verified\n", s.name.c_str());
  }
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  int64_t mb = 2048;
  int reps = 2;
  bool verify = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--mb=", 5) == 0)
      mb = std::atoll(argv[i] + 5);
    else if (std::strncmp(argv[i], "--reps=", 7) == 0)
      reps = std::atoi(argv[i] + 7);
    else if (std::strcmp(argv[i], "--verify") == 0)
      verify = true;
    else {
      std::fprintf(stderr, "usage: %s [--mb=2048] [--reps=2] [--verify]\n", argv[0]);
      return 2;
    }
  }
  const char* only = std::getenv("BENCH_ONLY");
  for (const auto& s : morph::Scenarios(mb)) {
    if (only == nullptr || s.name.find(only) != std::string::npos) morph::Run(s, reps, verify);
  }
  return 0;
}
