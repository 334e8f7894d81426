// Per-step cost of the recovery redundancy (runtime/recovery/): the periodic checkpoint's
// snapshot copy (MaybeSave) and the buddy snapshot (MaybeBegin ... WaitCopied), next to the same
// steps without them, in one run. `seconds`: what one save / snapshot keeps the training thread
// (mean); `per_step_overhead`: that, summed over the run, per step, as a fraction of the step.
// A step is 100 ms of "forward/backward" (a sleep: the GPU works, the host is idle) followed by
// the update point (WaitCopied). One JSON object per line.
//
//   recovery_bench [--mib=128] [--steps=20] [--every=10] [--step_ms=100] [--dir=/tmp/...]
//                  [--chunk_mib=32] [--group=2] [--cases=checkpoint,snapshot]
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "base/logging.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/store/tcp_store.h"
#include "runtime/recovery/checkpointer.h"
#include "runtime/state/state_testutil.h"
#include "runtime/recovery/snapshot.h"

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;
using state_testutil::Config;
using state_testutil::Fill;
using state_testutil::MakeBigState;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Args {
  int64_t mib = 128;
  int steps = 20;
  int every = 10;
  int step_ms = 100;
  int64_t chunk_mib = 32;
  int64_t group = 2;
  std::string dir;
  std::string cases = "checkpoint,snapshot";
};

int Fail(const Status& s) {
  std::fprintf(stderr, "recovery_bench: %s\n", s.ToString().c_str());
  return 1;
}

void Sleep(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// memcpy of `bytes` between two warm buffers, GB/s: what a copy could reach on this machine now.
double MemcpyGbPerS(int64_t bytes) {
  std::vector<char> a(static_cast<size_t>(bytes), 1), b(static_cast<size_t>(bytes), 2);
  std::memcpy(b.data(), a.data(), a.size());
  const auto t0 = Clock::now();
  std::memcpy(b.data(), a.data(), a.size());
  return bytes / Since(t0) / 1e9;
}

// Steps without anything: the baseline.
double Baseline(const Args& a) {
  const auto t0 = Clock::now();
  for (int s = 0; s < a.steps; ++s) Sleep(a.step_ms);
  return Since(t0);
}

int CheckpointCases(const Args& a) {
  const ParallelConfig c = Config(1, 1, 1);
  auto state = MakeBigState(c, 0, a.mib << 20);
  if (!state.ok()) return Fail(state.status());
  Fill(**state, 1);
  const int64_t bytes = (*state)->local_bytes();
  const double base = Baseline(a);
  PeriodicCheckpointer ckpt(a.dir, a.every, 2);
  double blocking = 0, waiting = 0, first = 0;
  int saves = 0;
  const auto t0 = Clock::now();
  for (int s = 0; s < a.steps; ++s) {
    if (Status st = ckpt.MaybeSave(s, 1, **state, 0, 1, c); !st.ok()) return Fail(st);
    if (ckpt.Due(s)) {
      if (saves == 0) first = ckpt.last_blocking_seconds();
      blocking += ckpt.last_blocking_seconds();
      waiting += ckpt.last_wait_seconds();
      ++saves;
    }
    Sleep(a.step_ms);
  }
  const double with = Since(t0);
  if (Status st = ckpt.Flush(Deadline::AfterMs(600000)); !st.ok()) return Fail(st);
  std::printf(
      "{\"name\": \"checkpoint_maybe_save\", \"bytes\": %lld, \"seconds\": %.6f, "
      "\"saves\": %d, \"every\": %d, \"step_seconds\": %.3f, \"per_step_overhead\": %.6f, "
      "\"baseline_seconds\": %.4f, \"with_seconds\": %.4f, \"ratio_vs_baseline\": %.4f, "
      "\"wait_seconds\": %.6f, \"first_save_seconds\": %.6f, \"later_save_seconds\": %.6f, "
      "\"copy_gb_per_s\": %.3f, \"memcpy_gb_per_s\": %.3f}\n",
      static_cast<long long>(bytes), blocking / saves, saves, a.every, a.step_ms / 1000.0,
      blocking / a.steps / (a.step_ms / 1000.0), base, with, with / base, waiting / saves, first,
      saves > 1 ? (blocking - first) / (saves - 1) : first,
      bytes / ((blocking - waiting) / saves) / 1e9, MemcpyGbPerS(bytes));
  std::fflush(stdout);
  return 0;
}

constexpr char kToken[] = "recovery-bench";

int SnapshotCases(const Args& a) {
  const ParallelConfig c = Config(2, 1, 1);
  auto server = TcpStoreServer::Start("127.0.0.1", 0, kToken);
  if (!server.ok()) return Fail(server.status());
  const std::string address = (*server)->address();
  const double base = Baseline(a);
  struct Out {
    double with = 0, blocking = 0, copy = 0, round = 0, p2p = 0;
    int64_t bytes = 0, memory = 0;
  };
  std::vector<Out> out(2);
  std::vector<Status> results = RunRankThreads(2, [&](int rank) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto store,
                           TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
    MORPH_ASSIGN_OR_RETURN(auto state, MakeBigState(c, rank, a.mib << 20));
    Fill(*state, 7);
    BuddySnapshotOptions opts;
    opts.chunk_bytes = static_cast<size_t>(a.chunk_mib) << 20;
    opts.chunks_per_group = static_cast<size_t>(a.group);
    BuddySnapshotter snap(a.every, opts);
    MORPH_RETURN_IF_ERROR(snap.StartGeneration(
        *store, {.generation = 0, .rank = rank, .hosts = {"a", "b"}}, Deadline::AfterMs(20000)));
    Out& o = out[static_cast<size_t>(rank)];
    o.bytes = state->local_bytes();
    // The copy alone and the whole round (copy + exchange), not overlapped, three times (the first
    // two allocate the buffers; the third is reported).
    for (int i = 0; i < 3; ++i) {
      const int64_t step = static_cast<int64_t>(i) * a.every;
      const auto t0 = Clock::now();
      MORPH_RETURN_IF_ERROR(snap.MaybeBegin(step, *state));
      MORPH_RETURN_IF_ERROR(snap.WaitCopied(Deadline::AfterMs(60000)));
      o.copy = Since(t0);
      MORPH_RETURN_IF_ERROR(snap.WaitExchanged(Deadline::AfterMs(600000)));
      o.round = Since(t0);
    }
    // Training steps: forward/backward overlaps the copy and the exchange.
    const auto t0 = Clock::now();
    for (int s = 0; s < a.steps; ++s) {
      const int64_t step = 3 * a.every + s;
      auto b0 = Clock::now();
      MORPH_RETURN_IF_ERROR(snap.MaybeBegin(step, *state));
      double blocked = Since(b0);
      Sleep(a.step_ms);
      b0 = Clock::now();
      MORPH_RETURN_IF_ERROR(snap.WaitCopied(Deadline::AfterMs(60000)));
      o.blocking += blocked + Since(b0);
    }
    o.with = Since(t0);
    MORPH_RETURN_IF_ERROR(snap.WaitExchanged(Deadline::AfterMs(600000)));
    o.memory = snap.memory_bytes();
    // The transport's own rate for the same bytes: one message each way between the two ranks
    // over a fresh Gloo pair (twice; the second, with warm buffers, is reported).
    MORPH_ASSIGN_OR_RETURN(auto pair, GlooCommunicator::Create(*store, "bench/p2p", rank, 2, nullptr,
                                                             Deadline::AfterMs(20000)));
    std::vector<char> out(static_cast<size_t>(o.bytes), 1), in(static_cast<size_t>(o.bytes), 0);
    for (int i = 0; i < 2; ++i) {
      const auto p0 = Clock::now();
      MORPH_RETURN_IF_ERROR(pair->SendRecv({{P2POp::Kind::kSend, 1 - rank, out.data(), out.size()},
                                            {P2POp::Kind::kRecv, 1 - rank, in.data(), in.size()}},
                                           std::chrono::milliseconds(600000)));
      o.p2p = Since(p0);
    }
    return Status::Ok();
  });
  if (Status s = FirstError(results); !s.ok()) return Fail(s);
  const Out& o = out[0];
  std::printf(
      "{\"name\": \"snapshot_copy\", \"bytes\": %lld, \"seconds\": %.6f, \"gb_per_s\": %.3f, "
      "\"memcpy_gb_per_s\": %.3f}\n",
      static_cast<long long>(o.bytes), o.copy, o.bytes / o.copy / 1e9, MemcpyGbPerS(o.bytes));
  std::printf(
      "{\"name\": \"snapshot_round\", \"bytes\": %lld, \"seconds\": %.6f, \"gb_per_s\": %.3f, "
      "\"memory_bytes\": %lld, \"memory_vs_state\": %.3f, \"gloo_p2p_seconds\": %.6f, "
      "\"gloo_p2p_gb_per_s\": %.3f, \"exchange_vs_gloo_p2p\": %.3f}\n",
      static_cast<long long>(o.bytes), o.round, o.bytes / o.round / 1e9,
      static_cast<long long>(o.memory), static_cast<double>(o.memory) / o.bytes, o.p2p,
      o.bytes / o.p2p / 1e9, (o.round - o.copy) / o.p2p);
  std::printf(
      "{\"name\": \"snapshot_per_step\", \"bytes\": %lld, \"seconds\": %.6f, \"every\": %d, "
      "\"step_seconds\": %.3f, \"per_step_overhead\": %.6f, \"baseline_seconds\": %.4f, "
      "\"with_seconds\": %.4f, \"ratio_vs_baseline\": %.4f}\n",
      static_cast<long long>(o.bytes), o.blocking / a.steps, a.every, a.step_ms / 1000.0,
      o.blocking / a.steps / (a.step_ms / 1000.0), base, o.with, o.with / base);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  morph::InitLogging(argv[0]);
  morph::Args a;
  char tmpl[] = "/tmp/morph_recovery_bench_XXXXXX";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto val = [&](const char* key) -> const char* {
      const size_t n = std::strlen(key);
      return arg.compare(0, n, key) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = val("--mib="))
      a.mib = std::atoll(v);
    else if (const char* v = val("--steps="))
      a.steps = std::atoi(v);
    else if (const char* v = val("--every="))
      a.every = std::atoi(v);
    else if (const char* v = val("--step_ms="))
      a.step_ms = std::atoi(v);
    else if (const char* v = val("--dir="))
      a.dir = v;
    else if (const char* v = val("--chunk_mib="))
      a.chunk_mib = std::atoll(v);
    else if (const char* v = val("--group="))
      a.group = std::atoll(v);
    else if (const char* v = val("--cases="))
      a.cases = v;
    else {
      std::fprintf(
          stderr,
          "usage: %s [--mib=N] [--steps=N] [--every=N] [--step_ms=N] [--dir=D] [--chunk_mib=N] [--group=N] [--cases=checkpoint,snapshot]\n",
          argv[0]);
      return 2;
    }
  }
  const bool own_dir = a.dir.empty();
  if (own_dir) {
    if (::mkdtemp(tmpl) == nullptr) return 1;
    a.dir = tmpl;
  }
  int rc = 0;
  if (a.cases.find("checkpoint") != std::string::npos) rc = morph::CheckpointCases(a);
  if (rc == 0 && a.cases.find("snapshot") != std::string::npos) rc = morph::SnapshotCases(a);
  if (own_dir) std::filesystem::remove_all(a.dir);
  return rc;
}
