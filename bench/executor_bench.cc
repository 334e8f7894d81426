// Reshard executor throughput: 4 ranks as threads over the in-process transport, three
// reconfigurations of one model state, each next to plain memcpy of the same bytes by the same
// number of threads, in the same run. One JSON object per line:
//   {"name":"executor/tp4to2","bytes":<bytes landing in new shards>,"seconds":...,
//    "memcpy_seconds":...,"ratio":<memcpy_seconds/seconds>, ...}
// Usage: executor_bench [--mb=2048] [--reps=2] [--verify]
//   --mb      total model state in MiB (f32 matrices of 2048 x 2048 = 16 MiB each)
//   --verify  check every new shard bitwise against the reference (slow; not timed)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "reshard/executor.h"
#include "reshard/inproc_transport.h"
#include "reshard/reshard_testutil.h"
#include "reshard/strided_copy.h"

namespace morph {
namespace {

using namespace testutil;  // NOLINT
using Clock = std::chrono::steady_clock;

struct Scenario {
  std::string name;
  std::vector<TensorInfo> tensors;
  std::vector<RegionLayout> old_l, new_l;
};

std::vector<TensorInfo> Model(int64_t mb) {
  std::vector<TensorInfo> t;
  const int64_t n = std::max<int64_t>(4, mb / 16);
  for (int64_t i = 0; i < n; ++i) t.push_back({"layers." + std::to_string(i / 4) + ".w" + std::to_string(i % 4), DType::kF32, {2048, 2048}});
  return t;
}

Scenario Tp4To2(int64_t mb) {
  Scenario s{"executor/tp4to2", Model(mb), {}, {}};
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const int dim = static_cast<int>(i % 2);  // column- and row-parallel layers alternate
    s.old_l.push_back(TpLayout(s.tensors[i], dim, {0, 1, 2, 3}));
    s.new_l.push_back(TpLayout(s.tensors[i], dim, {0, 1}));
  }
  return s;
}

Scenario Dp4To3(int64_t mb) {
  Scenario s{"executor/dp4to3_zero", Model(mb), {}, {}};
  for (const TensorInfo& t : s.tensors) {
    s.old_l.push_back(FlatLayout(t, {0, 1, 2, 3}));
    s.new_l.push_back(FlatLayout(t, {0, 1, 2}));
  }
  return s;
}

Scenario Pp2To1(int64_t mb) {
  Scenario s{"executor/pp2to1_tp2", Model(mb), {}, {}};
  const size_t half = s.tensors.size() / 2;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const int dim = static_cast<int>(i % 2);
    // Stage 0 on ranks {0,1}, stage 1 on ranks {2,3}; afterwards one stage on ranks {0,1}.
    s.old_l.push_back(TpLayout(s.tensors[i], dim, i < half ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    s.new_l.push_back(TpLayout(s.tensors[i], dim, {0, 1}));
  }
  return s;
}

struct Rank {
  std::vector<std::vector<char>> olds, news;
  std::vector<OldShardData> old_views;
  std::vector<NewShardData> new_views;
};

void Run(const Scenario& s, int reps, bool verify) {
  const int n = 4;
  auto plans = BuildPlans(s.tensors, s.old_l, s.new_l, n);
  std::vector<Rank> ranks(n);
  int64_t state_bytes = 0, moved = 0;
  for (int p = 0; p < n; ++p) {
    const LocalPlan& plan = plans[static_cast<size_t>(p)];
    Rank& r = ranks[static_cast<size_t>(p)];
    r.olds.resize(plan.tensors.size());
    r.news.resize(plan.tensors.size());
    for (size_t t = 0; t < plan.tensors.size(); ++t) {
      const TensorInfo& info = plan.tensors[t];
      if (plan.old_shards[t]) {
        r.olds[t].assign(static_cast<size_t>(plan.old_shards[t]->NumElements() * 4), static_cast<char>(p + t));
        r.old_views.push_back({info.name, info.dtype, ConstBufferView(r.olds[t].data(), r.olds[t].size(), MemoryKind::kHost)});
        state_bytes += static_cast<int64_t>(r.olds[t].size());
      }
      if (plan.new_shards[t]) {
        r.news[t].assign(static_cast<size_t>(plan.new_shards[t]->NumElements() * 4), 0);  // touched
        r.new_views.push_back({info.name, info.dtype, BufferView{r.news[t].data(), r.news[t].size(), MemoryKind::kHost}});
      }
    }
  }
  ExecutorOptions opts = *ExecutorOptions::FromEnv();  // MORPH_RESHARD_* or defaults
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
                             ranks[static_cast<size_t>(p)].new_views, tr, opts, Deadline::AfterMs(600000));
        if (!r.ok()) {
          std::fprintf(stderr, "%s rank %d: %s\n", s.name.c_str(), p, r.status().ToString().c_str());
          std::exit(1);
        }
        stats[static_cast<size_t>(p)] = *r;
        if (std::getenv("BENCH_DEBUG")) std::fprintf(stderr, "%s rank %d: %s\n", s.name.c_str(), p, r->ToString().c_str());
      });
    }
    for (auto& t : th) t.join();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  int64_t received = 0, copied = 0, zero_copy = 0, messages = 0, staging_peak = 0;
  for (const auto& st : stats) {
    received += st.bytes_received;
    copied += st.bytes_copied;
    zero_copy += st.messages_zero_copy;
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
  std::printf("{\"name\":\"%s\",\"bytes\":%lld,\"seconds\":%.6f,\"gbps\":%.3f,"
              "\"memcpy_seconds\":%.6f,\"memcpy_gbps\":%.3f,\"ratio\":%.3f,\"state_bytes\":%lld,"
              "\"bytes_received\":%lld,\"bytes_copied\":%lld,\"messages\":%lld,"
              "\"zero_copy_messages\":%lld,\"staging_peak_bytes\":%lld,\"ranks\":%d}\n",
              s.name.c_str(), static_cast<long long>(moved), best, moved / best / 1e9, best_memcpy,
              moved / best_memcpy / 1e9, best_memcpy / best, static_cast<long long>(state_bytes),
              static_cast<long long>(received), static_cast<long long>(copied),
              static_cast<long long>(messages), static_cast<long long>(zero_copy),
              static_cast<long long>(staging_peak), n);
  std::fflush(stdout);
  if (verify) {
    // Old data of rank p, tensor t is the byte p + t everywhere: check provenance per element.
    for (int p = 0; p < n; ++p) {
      const LocalPlan& plan = plans[static_cast<size_t>(p)];
      for (size_t t = 0; t < plan.tensors.size(); ++t) {
        if (!plan.new_shards[t]) continue;
        for (const Box& b : ShardBoxes(*plan.new_shards[t])) {
          for (const Region& r : s.old_l[t]) {
            for (const Box& piece : IntersectShard(r.shard, b)) {
              const StridedView v = *ViewOf(*plan.new_shards[t], piece);
              const CopyGeometry g = *MakeCopyGeometry(ContiguousView(v.shape), v);
              std::vector<char> out(static_cast<size_t>(g.num_elements * 4));
              HostStridedCopy(g, out.data(), ranks[static_cast<size_t>(p)].news[t].data(), 4, 0, g.num_elements);
              int src = r.holders[0];
              for (char c : out) {
                if (c != static_cast<char>(src + t)) {
                  std::fprintf(stderr, "%s: verify failed at rank %d tensor %zu\n", s.name.c_str(), p, t);
                  std::exit(1);
                }
              }
            }
          }
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
    if (std::strncmp(argv[i], "--mb=", 5) == 0) mb = std::atoll(argv[i] + 5);
    else if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::atoi(argv[i] + 7);
    else if (std::strcmp(argv[i], "--verify") == 0) verify = true;
    else {
      std::fprintf(stderr, "usage: %s [--mb=2048] [--reps=2] [--verify]\n", argv[0]);
      return 2;
    }
  }
  morph::Run(morph::Tp4To2(mb), reps, verify);
  morph::Run(morph::Dp4To3(mb), reps, verify);
  morph::Run(morph::Pp2To1(mb), reps, verify);
  return 0;
}
