// Checkpoint save and load throughput next to plain sequential file write (+fsync) and read of
// the same bytes, by the same number of threads, in the same run. One JSON object per line:
//   {"name":"checkpoint/save","bytes":...,"seconds":...,"baseline_seconds":...,"ratio":...}
// ratio = baseline_seconds / seconds (1.0 = as fast as plain file I/O).
// Usage: checkpoint_bench [--mb=1024] [--dir=/tmp/morph_ckpt_bench]
//   4 ranks (threads) save a TP-4 sharded state of --mb MiB; 2 ranks load it TP-2 sharded.
//   Loads run right after the writes and after one untimed pass, so both they and the baseline
//   reads hit the page cache; load and plain read are measured in interleaved pairs, and the
//   median pair's ratio is reported (with the spread, and the loader's bytes read per byte
//   loaded: a load reads whole checksum blocks, 1.00 when they fall on the rows it keeps).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

using namespace testutil;  // NOLINT
using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

template <typename F>
double Parallel(int n, F&& f) {
  std::vector<std::thread> th;
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) th.emplace_back([&, i] { f(i); });
  for (auto& t : th) t.join();
  return Since(t0);
}

void Die(const Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

// `blocking`: how long the caller was blocked (the snapshot copy, for async saves); < 0: n/a.
void Print(const char* name, int64_t bytes, double secs, double base, double blocking = -1) {
  std::printf(
      "{\"name\":\"%s\",\"bytes\":%lld,\"seconds\":%.6f,\"gbps\":%.3f,"
      "\"baseline_seconds\":%.6f,\"baseline_gbps\":%.3f,\"ratio\":%.3f",
      name, static_cast<long long>(bytes), secs, bytes / secs / 1e9, base, bytes / base / 1e9,
      base / secs);
  if (blocking >= 0) std::printf(",\"caller_blocked_seconds\":%.6f", blocking);
  std::printf("}\n");
  std::fflush(stdout);
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  using namespace morph;  // NOLINT
  int64_t mb = 1024;
  std::string dir = "/tmp/morph_ckpt_bench";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--mb=", 5) == 0)
      mb = std::atoll(argv[i] + 5);
    else if (std::strncmp(argv[i], "--dir=", 6) == 0)
      dir = argv[i] + 6;
    else {
      std::fprintf(stderr, "usage: %s [--mb=1024] [--dir=/tmp/morph_ckpt_bench]\n", argv[0]);
      return 2;
    }
  }
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<TensorInfo> tensors;
  for (int64_t i = 0; i < std::max<int64_t>(2, mb / 16); ++i) {
    tensors.push_back({"w" + std::to_string(i), DType::kF32, {2048, 2048}});
  }
  const int n = 4;
  std::vector<std::vector<char>> data;
  std::vector<std::vector<CheckpointPiece>> pieces(n);
  data.reserve(tensors.size() * n);
  int64_t total = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (const Region& r : TpLayout(tensors[t], static_cast<int>(t % 2), {0, 1, 2, 3})) {
      data.emplace_back(static_cast<size_t>(r.shard.NumElements() * 4), static_cast<char>(t));
      pieces[static_cast<size_t>(r.holders[0])].push_back(
          {tensors[t], r.shard,
           ConstBufferView(data.back().data(), data.back().size(), MemoryKind::kHost)});
      total += static_cast<int64_t>(data.back().size());
    }
  }
  // Baseline write: each rank writes its bytes to one file and fsyncs it. Baseline and saves
  // alternate, twice, and the best time of each counts (the disk's write-back state drifts).
  auto plain_write = [&](int r) {
    const std::string path = dir + "/plain-" + std::to_string(r) + ".bin";
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (const auto& p : pieces[static_cast<size_t>(r)]) {
      const char* c = static_cast<const char*>(p.data.data);
      size_t left = p.data.bytes;
      while (left > 0) {
        ssize_t w = ::write(fd, c, left);
        if (w <= 0) std::exit(1);
        c += w;
        left -= static_cast<size_t>(w);
      }
    }
    ::fsync(fd);
    ::close(fd);
  };
  double base_write = 1e30, save[2] = {1e30, 1e30}, blocking[2] = {1e30, 1e30};
  // One snapshot pool per rank, as a training loop would keep across its periodic saves: the
  // first save allocates (and page-faults) the snapshot, later ones reuse it.
  std::vector<std::shared_ptr<CheckpointSnapshotPool>> pools;
  for (int r = 0; r < n; ++r) pools.push_back(std::make_shared<CheckpointSnapshotPool>());
  for (int rep = 0; rep < 2; ++rep) {
    base_write = std::min(base_write, Parallel(n, plain_write));
    for (int snapshot = 0; snapshot <= 1; ++snapshot) {
      const std::string ck = dir + (snapshot ? "/ckpt" : "/ckpt-nosnap");
      std::filesystem::remove_all(ck);
      CheckpointSaveOptions opts;
      opts.snapshot = snapshot != 0;
      std::vector<double> block(n);
      const double secs = Parallel(n, [&](int r) {
        const auto t0 = Clock::now();
        CheckpointSaveOptions rank_opts = opts;
        rank_opts.snapshot_pool = pools[static_cast<size_t>(r)];
        auto s = SaveCheckpointAsync(ck, r, n, 100, R"({"tp": 4})", pieces[static_cast<size_t>(r)],
                                     rank_opts);
        block[static_cast<size_t>(r)] = Since(t0);
        Die(s.status(), "save");
        Die((*s)->Wait(Deadline::AfterMs(600000)), "save");
      });
      save[snapshot] = std::min(save[snapshot], secs);
      blocking[snapshot] =
          std::min(blocking[snapshot], *std::max_element(block.begin(), block.end()));
    }
  }
  for (int snapshot = 1; snapshot >= 0; --snapshot) {
    Print(snapshot ? "checkpoint/save" : "checkpoint/save_no_snapshot", total, save[snapshot],
          base_write, blocking[snapshot]);
  }
  // Baseline read: each of 2 loader threads reads two ranks' plain files sequentially into a
  // buffer the size of one loaded tensor shard (what the loader writes into).
  std::vector<std::vector<char>> sink(2);
  auto plain_read = [&](int r) {
    sink[static_cast<size_t>(r)].resize(8 << 20);
    for (int k = 0; k < 2; ++k) {
      const std::string path = dir + "/plain-" + std::to_string(2 * r + k) + ".bin";
      int fd = ::open(path.c_str(), O_RDONLY);
      while (::read(fd, sink[static_cast<size_t>(r)].data(), sink[static_cast<size_t>(r)].size()) >
             0) {
      }
      ::close(fd);
    }
  };
  auto reader = CheckpointReader::Open(dir + "/ckpt");
  Die(reader.status(), "open");
  std::vector<std::vector<char>> out(2);
  auto tp2_load = [&](int r) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      // Loaded TP-2 along the other dimension than saved: every piece is re-sliced.
      const Region reg =
          TpLayout(tensors[t], static_cast<int>((t + 1) % 2), {0, 1})[static_cast<size_t>(r)];
      out[static_cast<size_t>(r)].resize(static_cast<size_t>(reg.shard.NumElements() * 4));
      Die(reader->Read(tensors[t].name, DType::kF32, reg.shard,
                       BufferView{out[static_cast<size_t>(r)].data(),
                                  out[static_cast<size_t>(r)].size(), MemoryKind::kHost}),
          "read");
      if (out[static_cast<size_t>(r)][0] != static_cast<char>(t)) {
        std::fprintf(stderr, "wrong data loaded for %s\n", tensors[t].name.c_str());
        std::exit(1);
      }
    }
  };
  // Paired and interleaved: one untimed pass of each warms the page cache, the output buffers
  // and the reader's descriptors; then kLoadReps pairs of (plain read, load), in alternating
  // order, and the median of the pairs' ratios counts. A single unpaired measurement of each
  // (as before) swung from 0.32 to 0.95 on this loaded machine, between runs and between pairs
  // of one run (docs/performance.md).
  constexpr int kLoadReps = 5;
  plain_read(0), plain_read(1), tp2_load(0), tp2_load(1);
  const int64_t read_before = reader->bytes_read();
  std::vector<double> bases, loads, ratios;
  for (int rep = 0; rep < kLoadReps; ++rep) {
    double b = 0, l = 0;
    if (rep % 2 == 0) {
      b = Parallel(2, plain_read);
      l = Parallel(2, tp2_load);
    } else {
      l = Parallel(2, tp2_load);
      b = Parallel(2, plain_read);
    }
    if (std::getenv("BENCH_DEBUG")) {
      std::fprintf(stderr, "load pair %d: plain %.3f s, load %.3f s, ratio %.3f\n", rep, b, l,
                   b / l);
    }
    bases.push_back(b);
    loads.push_back(l);
    ratios.push_back(b / l);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double load = median(loads), base_read = median(bases), ratio = median(ratios);
  const double amplification = static_cast<double>(reader->bytes_read() - read_before) / kLoadReps /
                               static_cast<double>(total);
  std::printf(
      "{\"name\":\"checkpoint/load_tp4_to_tp2_other_dim\",\"bytes\":%lld,\"seconds\":%.6f,"
      "\"gbps\":%.3f,\"baseline_seconds\":%.6f,\"baseline_gbps\":%.3f,\"ratio\":%.3f,"
      "\"ratio_min\":%.3f,\"ratio_max\":%.3f,\"pairs\":%d,\"bytes_read_per_byte\":%.2f}\n",
      static_cast<long long>(total), load, total / load / 1e9, base_read, total / base_read / 1e9,
      ratio, *std::min_element(ratios.begin(), ratios.end()),
      *std::max_element(ratios.begin(), ratios.end()), kLoadReps, amplification);
  std::fflush(stdout);
  std::filesystem::remove_all(dir);
  return 0;
}
