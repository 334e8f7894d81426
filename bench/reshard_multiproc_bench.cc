// Reshard between 4 forked processes (TCP store, one Gloo communicator), planned by the real
// planner: TP 4 -> 2 and DP 4 -> 3 (ZeRO) of one model state, each over
//   - "gloo_tcp": CommTransport's plain constructor, every peer over Gloo TCP (loopback), next to
//     raw Gloo p2p of the same bytes per pair (one message per pair and direction, one group) in
//     the same run: ratio_vs_raw = raw_seconds / seconds;
//   - "shm": CommTransport::Create with the processes' ShmArena (old shards live in it, as
//     morph-owned host storage would): same-host receivers map the senders' segments and memcpy,
//     next to memcpy of the bytes landing in each process's new shards, by all 4 processes at
//     once: ratio_vs_memcpy = memcpy_seconds / seconds, speedup_vs_tcp = gloo_tcp seconds /
//     seconds;
//   - "shm_vm_readv": the same without the arena, so every message goes by process_vm_readv.
// Page state is the same on both sides of each comparison: sources and destinations are written
// before the first pass and reused (a receiver maps the senders' segments afresh in every
// reshard, as it would in a real one: their read faults are part of the reshard's time).
// Times are the slowest process's, between two barriers; after an untimed pass of each, --reps
// interleaved pairs (reshard, baseline) in alternating order; seconds are medians and the ratio
// is the median pair's. One JSON object per line from rank 0:
//   {"name":"reshard_mp/tp4to2/gloo_tcp","bytes":<bytes received over the transport>,
//    "seconds":...,"raw_seconds":...,"ratio_vs_raw":..., ...}
//   {"name":"reshard_mp/tp4to2/shm","bytes":<landing in new shards>,"seconds":...,
//    "memcpy_seconds":...,"ratio_vs_memcpy":..., ...}
// Old shards come from an ShmArena with 2 MiB pages (ShmArena::Options::huge_pages; their
// allocation cost, outside the reshard, is old_alloc_seconds); --huge-pages=0 keeps 4 KiB pages.
// Usage: reshard_multiproc_bench [--mb=1024] [--reps=5] [--huge-pages=1]. BENCH_ONLY=<substring>
// picks scenarios; BENCH_DEBUG=1 prints per-process executor stats. Exchanges use
// ExecutorOptions::FromEnv() (MORPH_RESHARD_*).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/logging.h"
#include "collectives/comm_transport.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/shm/shm_arena.h"
#include "collectives/store/tcp_store.h"
#include "reshard/executor.h"
#include "reshard/plan.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

constexpr char kToken[] = "reshard-mp-bench";
constexpr int kRanks = 4;
using Clock = std::chrono::steady_clock;
constexpr auto kTimeout = std::chrono::seconds(120);

struct Scenario {
  std::string name;
  PlanInput in;
};

std::vector<Scenario> Scenarios(int64_t mb) {
  const int layers = static_cast<int>(std::max<int64_t>(4, mb / 16) / 4);
  auto config = [&](int dp, int tp) {
    ParallelConfig c{.dp = dp, .tp = tp, .pp = 1};
    c.stage_of_layer = *ParallelConfig::EvenStages(layers, 1);
    return c;
  };
  auto make = [&](std::string name, bool zero, ParallelConfig from, ParallelConfig to,
                  std::vector<int32_t> available) {
    Scenario s{std::move(name), {}};
    s.in.tensors = testutil::MatrixModel(mb, zero);
    s.in.old_config = from;
    s.in.new_config = to;
    s.in.old_participant_of_rank = {0, 1, 2, 3};
    s.in.available = std::move(available);
    s.in.num_participants = kRanks;
    return s;
  };
  return {make("reshard_mp/tp4to2", false, config(1, 4), config(1, 2), {0, 1}),
          make("reshard_mp/dp4to3_zero", true, config(4, 1), config(3, 1), {0, 1, 2})};
}

// The slowest process's value.
StatusOr<double> Max(Communicator& comm, double v) {
  MORPH_RETURN_IF_ERROR(comm.Allreduce(&v, 1, DType::kF64, ReduceOp::kMax, kTimeout));
  return v;
}
StatusOr<double> Sum(Communicator& comm, double v) {
  MORPH_RETURN_IF_ERROR(comm.Allreduce(&v, 1, DType::kF64, ReduceOp::kSum, kTimeout));
  return v;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times fn between two barriers; the slowest process's seconds, best of `reps`.
template <typename Fn>
StatusOr<double> Timed(Communicator& comm, int reps, Fn fn) {
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    MORPH_RETURN_IF_ERROR(comm.Barrier(kTimeout));
    const auto t0 = Clock::now();
    MORPH_RETURN_IF_ERROR(fn());
    const double mine = std::chrono::duration<double>(Clock::now() - t0).count();
    MORPH_RETURN_IF_ERROR(comm.Barrier(kTimeout));
    MORPH_ASSIGN_OR_RETURN(double slowest, Max(comm, mine));
    best = std::min(best, slowest);
  }
  return best;
}

Status RunScenario(const Scenario& s, Communicator& comm, CommTransport& tcp, CommTransport& shm,
                   CommTransport& pvr, ShmArena& arena, int me, int reps) {
  MORPH_ASSIGN_OR_RETURN(Planner planner, Planner::Create(s.in));
  MORPH_ASSIGN_OR_RETURN(LocalPlan plan, planner.PlanFor(me));
  std::vector<Buffer> olds(plan.tensors.size());
  std::vector<std::vector<char>> news(plan.tensors.size());
  std::vector<OldShardData> old_views;
  std::vector<NewShardData> new_views;
  // The old shards' allocation and first fill (ShmArena: with --huge-pages, populated and
  // collapsed into 2 MiB pages): what the arena's pages cost where they are allocated, outside
  // the reshard (the slowest process's seconds, printed as old_alloc_seconds).
  double alloc_seconds = 0;
  size_t old_bytes = 0;
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    const TensorInfo& info = plan.tensors[t];
    const size_t es = static_cast<size_t>(DTypeSize(info.dtype));
    if (plan.old_shards[t]) {
      const auto t0 = Clock::now();
      MORPH_ASSIGN_OR_RETURN(
          olds[t], arena.Allocate(static_cast<size_t>(plan.old_shards[t]->NumElements()) * es));
      std::memset(olds[t].data(), static_cast<char>(me + t), olds[t].size());
      alloc_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      old_bytes += olds[t].size();
      old_views.push_back({info.name, info.dtype,
                           ConstBufferView(olds[t].data(), olds[t].size(), MemoryKind::kHost)});
    }
    if (plan.new_shards[t]) {
      news[t].assign(static_cast<size_t>(plan.new_shards[t]->NumElements()) * es, 0);  // touched
      new_views.push_back(
          {info.name, info.dtype, BufferView{news[t].data(), news[t].size(), MemoryKind::kHost}});
    }
  }
  MORPH_ASSIGN_OR_RETURN(const double slowest_alloc, Max(comm, alloc_seconds));
  MORPH_ASSIGN_OR_RETURN(const double all_old_bytes, Sum(comm, static_cast<double>(old_bytes)));
  MORPH_ASSIGN_OR_RETURN(const double huge_bytes,
                         Sum(comm, static_cast<double>(arena.huge_bytes())));
  MORPH_ASSIGN_OR_RETURN(ExecutorOptions opts, ExecutorOptions::FromEnv());
  // Bytes per peer, as the plan moves them: the raw baseline sends the same.
  std::vector<size_t> to(kRanks, 0), from(kRanks, 0);
  for (const PieceMove& p : plan.sends)
    to[static_cast<size_t>(p.peer)] += static_cast<size_t>(PieceBytes(plan, p));
  for (const PieceMove& p : plan.recvs)
    from[static_cast<size_t>(p.peer)] += static_cast<size_t>(PieceBytes(plan, p));
  size_t local_bytes = 0;
  for (const PieceMove& p : plan.local_copies)
    local_bytes += static_cast<size_t>(PieceBytes(plan, p));
  size_t landing = 0;
  for (const PieceMove& p : plan.recvs) landing += static_cast<size_t>(PieceBytes(plan, p));
  for (const PieceMove& p : plan.local_copies) landing += static_cast<size_t>(PieceBytes(plan, p));

  double tcp_seconds = 0;
  for (int mode = 0; mode < 3; ++mode) {
    CommTransport& transport = mode == 0 ? tcp : mode == 1 ? shm : pvr;
    const char* mode_name = mode == 0 ? "gloo_tcp" : mode == 1 ? "shm" : "shm_vm_readv";
    const ShmChannel::Stats shm_before = transport.shm_stats();
    ExecutorStats stats;
    auto reshard = [&]() -> Status {
      MORPH_ASSIGN_OR_RETURN(stats, ExecutePlan(plan, old_views, new_views, transport, opts,
                                                Deadline::After(kTimeout)));
      return Status::Ok();
    };
    // Baselines. Raw Gloo p2p: the same bytes per pair, one contiguous message each way, one
    // group. memcpy: the bytes landing here, by every process at once.
    std::vector<std::vector<char>> out(kRanks), in(kRanks);
    std::vector<P2POp> ops;
    std::vector<char> src, dst, lsrc, ldst;
    if (mode == 0) {
      lsrc.assign(local_bytes, 1);
      ldst.assign(local_bytes, 0);
      for (int p = 0; p < kRanks; ++p) {
        const size_t i = static_cast<size_t>(p);
        out[i].assign(to[i], 1);
        in[i].assign(from[i], 0);
        if (to[i] > 0) ops.push_back({P2POp::Kind::kSend, p, out[i].data(), to[i]});
        if (from[i] > 0) ops.push_back({P2POp::Kind::kRecv, p, in[i].data(), from[i]});
      }
    } else {
      src.assign(landing, 1);
      dst.assign(landing, 0);
    }
    auto base = [&]() -> Status {
      if (mode == 0) return comm.SendRecv(ops, kTimeout);
      if (landing > 0) std::memcpy(dst.data(), src.data(), landing);
      return Status::Ok();
    };
    // Over TCP the reshard also copies its local pieces (overlapped with the exchange) on the
    // same cores: raw p2p with a memcpy of those bytes during it is the same work.
    auto base_local = [&]() -> Status {
      MORPH_ASSIGN_OR_RETURN(auto work, comm.Start(CollectiveOp::SendRecv(ops, kTimeout)));
      if (local_bytes > 0) std::memcpy(ldst.data(), lsrc.data(), local_bytes);
      return work->Wait(Deadline::After(kTimeout));
    };
    // Interleaved pairs in alternating order after one untimed pass of each; medians count
    // (the ratio is the median pair's).
    MORPH_RETURN_IF_ERROR(reshard());
    MORPH_RETURN_IF_ERROR(base());
    std::vector<double> xs, bs, bls, ratios;
    for (int rep = 0; rep < reps; ++rep) {
      double x = 0, b = 0, bl = 0;
      if (rep % 2 == 0) {
        MORPH_ASSIGN_OR_RETURN(x, Timed(comm, 1, reshard));
        MORPH_ASSIGN_OR_RETURN(b, Timed(comm, 1, base));
        if (mode == 0) {
          MORPH_ASSIGN_OR_RETURN(bl, Timed(comm, 1, base_local));
        }
      } else {
        if (mode == 0) {
          MORPH_ASSIGN_OR_RETURN(bl, Timed(comm, 1, base_local));
        }
        MORPH_ASSIGN_OR_RETURN(b, Timed(comm, 1, base));
        MORPH_ASSIGN_OR_RETURN(x, Timed(comm, 1, reshard));
      }
      xs.push_back(x);
      bs.push_back(b);
      bls.push_back(bl);
      ratios.push_back(b / x);
    }
    const double best_local_ratio =
        *std::min_element(bls.begin(), bls.end()) / *std::min_element(xs.begin(), xs.end());
    const double seconds = Median(xs), baseline = Median(bs), ratio = Median(ratios);
    // Best of each side: on a loaded machine the least disturbed run of each.
    const double best_ratio =
        *std::min_element(bs.begin(), bs.end()) / *std::min_element(xs.begin(), xs.end());
    if (mode == 0) tcp_seconds = seconds;
    if (std::getenv("BENCH_DEBUG")) {
      const ShmChannel::Stats after = transport.shm_stats();
      std::fprintf(
          stderr,
          "%s %s rank %d: %s; shm messages mapped %llu, vm_readv %llu, copying %.3f s "
          "(all passes)\n",
          s.name.c_str(), mode_name, me, stats.ToString().c_str(),
          static_cast<unsigned long long>(after.mapped_messages - shm_before.mapped_messages),
          static_cast<unsigned long long>(after.vm_readv_messages - shm_before.vm_readv_messages),
          after.copy_seconds - shm_before.copy_seconds);
    }
    // Over TCP: the bytes on the wire (each counted once, at its receiver); shm: what lands.
    const double moved_here =
        mode == 0 ? static_cast<double>(stats.bytes_received) : static_cast<double>(landing);
    MORPH_ASSIGN_OR_RETURN(double bytes, Sum(comm, moved_here));
    MORPH_ASSIGN_OR_RETURN(double strided, Sum(comm, static_cast<double>(stats.messages_strided)));
    MORPH_ASSIGN_OR_RETURN(
        double messages,
        Sum(comm, static_cast<double>(stats.messages_sent + stats.messages_received)));
    MORPH_ASSIGN_OR_RETURN(double staging,
                           Max(comm, static_cast<double>(stats.staging_peak_bytes)));
    if (me == 0) {
      std::printf(
          "{\"name\":\"%s/%s\",\"bytes\":%.0f,\"seconds\":%.6f,\"gbps\":%.3f,"
          "\"%s_seconds\":%.6f,\"%s_gbps\":%.3f,\"ratio_vs_%s\":%.3f,\"best_ratio\":%.3f,"
          "\"messages\":%.0f,"
          "\"strided_messages\":%.0f,\"staging_peak_bytes\":%.0f,\"speedup_vs_tcp\":%.3f,"
          "\"best_ratio_vs_raw_plus_local_copies\":%.3f,"
          "\"old_shard_bytes\":%.0f,\"old_alloc_seconds\":%.3f,\"huge_page_bytes\":%.0f,"
          "\"processes\":%d}\n",
          s.name.c_str(), mode_name, bytes, seconds, bytes / seconds / 1e9,
          mode == 0 ? "raw" : "memcpy", baseline, mode == 0 ? "raw" : "memcpy",
          bytes / baseline / 1e9, mode == 0 ? "raw" : "memcpy", ratio, best_ratio, messages,
          strided, staging, tcp_seconds / seconds, mode == 0 ? best_local_ratio : 0.0,
          all_old_bytes, slowest_alloc, huge_bytes, kRanks);
      std::fflush(stdout);
    }
  }
  return Status::Ok();
}

Status Child(const std::string& address, int me, int64_t mb, int reps, bool huge_pages) {
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(30000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "bench", me, kRanks, nullptr,
                                                             Deadline::AfterMs(30000)));
  CommTransport tcp(comm.get(), kTimeout);
  ShmArena arena(ShmArena::Options{.huge_pages = huge_pages});
  MORPH_ASSIGN_OR_RETURN(
      auto shm, CommTransport::Create(comm.get(), kTimeout, CommTransportOptions{.arena = &arena},
                                      Deadline::AfterMs(30000)));
  MORPH_ASSIGN_OR_RETURN(auto pvr,
                         CommTransport::Create(comm.get(), kTimeout, CommTransportOptions{},
                                               Deadline::AfterMs(30000)));
  const char* only = std::getenv("BENCH_ONLY");
  for (const Scenario& s : Scenarios(mb)) {
    if (only != nullptr && s.name.find(only) == std::string::npos) continue;
    MORPH_RETURN_IF_ERROR(RunScenario(s, *comm, tcp, *shm, *pvr, arena, me, reps)) << s.name;
  }
  return comm->Barrier(kTimeout);
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  morph::InitLogging(argv[0]);
  int64_t mb = 1024;
  int reps = 5;
  bool huge_pages = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--mb=", 5) == 0) {
      mb = std::atoll(argv[i] + 5);
    } else if (std::strncmp(argv[i], "--reps=", 7) == 0) {
      reps = std::atoi(argv[i] + 7);
    } else if (std::strncmp(argv[i], "--huge-pages=", 13) == 0) {
      huge_pages = std::atoi(argv[i] + 13) != 0;
    } else {
      std::fprintf(stderr, "usage: %s [--mb=1024] [--reps=5] [--huge-pages=1]\n", argv[0]);
      return 2;
    }
  }
  morph::ForkedRanks ranks =
      morph::ForkedRanks::Fork(morph::kRanks, [&](int rank, const std::string& address) {
        return morph::ExitCode(rank, morph::Child(address, rank, mb, reps, huge_pages));
      });
  auto server = morph::TcpStoreServer::Start("127.0.0.1", 0, morph::kToken);
  if (!server.ok()) {
    std::fprintf(stderr, "store: %s\n", server.status().ToString().c_str());
    return 1;
  }
  ranks.Release((*server)->address());
  std::vector<int> codes = ranks.Wait(morph::Deadline::AfterMs(600000));
  for (int c : codes) {
    if (c != 0) return 1;
  }
  return 0;
}
