// The device data path on a GPU (issue 25): a reshard that moves device state between two ranks
// over NCCL (the executor, DeviceTransport, NcclCommunicator) next to raw NCCL p2p of the same
// bytes in the same run, and the NCCL communicator lifecycle (init, abort, shrink). Ranks are
// threads; with two GPUs each rank has its own, with one they share it (NCCL >= 2.30 with
// NCCL_MULTI_RANK_GPU_ENABLE=1; older NCCL refuses: "Duplicate GPU", printed as the case's
// error). One JSON object per line:
//   {"name":"device_reshard/1GiB","bytes":...,"seconds":...,"gbps":...,"raw_p2p_seconds":...,
//    "ratio_vs_raw_p2p":...}   ratio = raw p2p time / reshard time (target >= 0.8)
//   {"name":"nccl/init","ranks":2,"seconds":...}  (and nccl/abort, nccl/shrink)
// Without a GPU: one line {"name":"device_reshard_gpu","skipped":"no GPU: ..."}, exit 0.
// Usage: device_reshard_gpu_bench [--mb=N] (bytes moved, default 1024 MiB)
#include <cuda_runtime_api.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/device_memory.h"
#include "collectives/device_transport.h"
#include "collectives/nccl/nccl_communicator.h"
#include "collectives/store/store.h"
#include "reshard/executor.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kRanks = 2;
constexpr auto kTimeout = std::chrono::seconds(120);

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) out += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return out + "\"";
}

void PrintError(const char* name, const Status& s) {
  std::printf("{\"name\":\"%s\",\"error\":%s}\n", name, Quote(s.ToString()).c_str());
  std::fflush(stdout);
}

// Runs f(rank) on kRanks threads; the first error, if any.
Status OnRanks(const std::function<Status(int)>& f) {
  std::vector<Status> st(kRanks);
  std::vector<std::thread> th;
  for (int r = 0; r < kRanks; ++r) th.emplace_back([&, r] { st[static_cast<size_t>(r)] = f(r); });
  for (auto& t : th) t.join();
  for (const Status& s : st) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

struct Bench {
  int gpus = 1;
  int64_t bytes = int64_t{1} << 30;
  std::shared_ptr<KvTable> table = std::make_shared<KvTable>();
  int64_t generation = 0;
  int DeviceOf(int r) const { return r % gpus; }

  // One communicator per rank named `name` in a fresh store generation; init seconds (max).
  Status Build(const std::string& name, std::vector<std::unique_ptr<NcclCommunicator>>& comms,
               double* seconds) {
    comms.clear();
    comms.resize(kRanks);
    const int64_t g = ++generation;
    std::atomic<double> slowest{0};
    Status s = OnRanks([&](int r) -> Status {
      MemoryStore store(table, g);
      const auto t0 = Clock::now();
      MORPH_ASSIGN_OR_RETURN(
          comms[static_cast<size_t>(r)],
          NcclCommunicator::Create(store, name, r, kRanks, DeviceOf(r), Deadline::After(kTimeout)));
      double took = Since(t0), seen = slowest.load();
      while (took > seen && !slowest.compare_exchange_weak(seen, took)) {
      }
      return Status::Ok();
    });
    *seconds = slowest.load();
    return s;
  }

  void Lifecycle() {
    std::vector<std::unique_ptr<NcclCommunicator>> comms;
    double init = 0;
    Status s = Build("init", comms, &init);
    if (!s.ok()) return PrintError("nccl/init", s);
    std::printf("{\"name\":\"nccl/init\",\"ranks\":%d,\"gpus\":%d,\"seconds\":%.6f}\n", kRanks,
                gpus, init);
    auto t0 = Clock::now();
    comms[0]->Abort();
    comms[1]->Abort();
    std::printf("{\"name\":\"nccl/abort\",\"ranks\":%d,\"seconds\":%.6f}\n", kRanks, Since(t0));
    comms.clear();
    s = Build("shrink", comms, &init);
    if (!s.ok()) return PrintError("nccl/shrink", s);
    // Rank 1 leaves; rank 0 shrinks without it (no unique id, no rendezvous).
    const std::vector<int> exclude = {1};
    t0 = Clock::now();
    StatusOr<std::unique_ptr<Communicator>> shrunk =
        comms[0]->Shrink(exclude, ShrinkMode::kPlanned, generation + 1, Deadline::After(kTimeout));
    const double took = Since(t0);
    if (!shrunk.ok()) return PrintError("nccl/shrink", shrunk.status());
    std::printf("{\"name\":\"nccl/shrink\",\"ranks\":\"2->1\",\"seconds\":%.6f}\n", took);
    std::fflush(stdout);
  }

  // Raw p2p of `n` bytes 0 -> 1 and the executor's reshard of a tensor of n bytes from
  // participant 0 to participant 1 over DeviceTransport, best of 3 each.
  void Reshard() {
    const char* name = "device_reshard/1GiB";
    std::vector<std::unique_ptr<NcclCommunicator>> comms;
    double init = 0;
    Status s = Build("world", comms, &init);
    if (!s.ok()) return PrintError(name, s);
    const int64_t side = 1 << 14;  // f32 side x (bytes / 4 / side)
    TensorInfo info{"w", DType::kF32, {bytes / 4 / side, side}};
    const int64_t n = info.shape[0] * info.shape[1] * 4;
    std::vector<LocalPlan> plans = testutil::BuildPlans({info}, {testutil::FlatLayout(info, {0})},
                                                        {testutil::FlatLayout(info, {1})}, kRanks);
    std::vector<void*> old_buf(kRanks, nullptr), new_buf(kRanks, nullptr);
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(DeviceOf(r));
      void** p = r == 0 ? &old_buf[0] : &new_buf[1];
      if (cudaMalloc(p, static_cast<size_t>(n)) != cudaSuccess ||
          cudaMemset(*p, r + 1, static_cast<size_t>(n)) != cudaSuccess) {
        return PrintError(name, ResourceExhaustedError("cudaMalloc of the tensor"));
      }
    }
    std::barrier sync(kRanks);
    double raw = 1e30, reshard = 1e30;
    for (int rep = 0; rep < 3 && s.ok(); ++rep) {
      std::vector<double> t(kRanks, 0);
      s = OnRanks([&](int r) -> Status {
        cudaSetDevice(DeviceOf(r));
        P2POp op{r == 0 ? P2POp::Kind::kSend : P2POp::Kind::kRecv, 1 - r,
                 r == 0 ? old_buf[0] : new_buf[1], static_cast<size_t>(n)};
        sync.arrive_and_wait();
        const auto t0 = Clock::now();
        MORPH_RETURN_IF_ERROR(comms[static_cast<size_t>(r)]->SendRecv({op}, kTimeout));
        t[static_cast<size_t>(r)] = Since(t0);
        return Status::Ok();
      });
      raw = std::min(raw, std::max(t[0], t[1]));
    }
    ExecutorOptions options;
    for (int rep = 0; rep < 3 && s.ok(); ++rep) {
      std::vector<double> t(kRanks, 0);
      s = OnRanks([&](int r) -> Status {
        cudaSetDevice(DeviceOf(r));
        MORPH_ASSIGN_OR_RETURN(std::unique_ptr<DeviceMemory> mem, CudaDeviceMemory(DeviceOf(r)));
        MORPH_ASSIGN_OR_RETURN(auto tr, DeviceTransport::Create(comms[static_cast<size_t>(r)].get(),
                                                                {0, 1}, std::move(mem), kTimeout));
        std::vector<OldShardData> olds;
        std::vector<NewShardData> news;
        if (r == 0) olds.push_back({"w", DType::kF32, {old_buf[0], size_t(n), MemoryKind::kCuda}});
        if (r == 1) news.push_back({"w", DType::kF32, {new_buf[1], size_t(n), MemoryKind::kCuda}});
        sync.arrive_and_wait();
        const auto t0 = Clock::now();
        MORPH_RETURN_IF_ERROR(ExecutePlan(plans[static_cast<size_t>(r)], olds, news, *tr, options,
                                          Deadline::After(kTimeout))
                                  .status());
        t[static_cast<size_t>(r)] = Since(t0);
        return Status::Ok();
      });
      reshard = std::min(reshard, std::max(t[0], t[1]));
    }
    // The bytes arrived: rank 1's buffer holds rank 0's fill (1) everywhere we look.
    unsigned char ends[2] = {0, 0};
    if (s.ok()) {
      cudaSetDevice(DeviceOf(1));
      cudaMemcpy(&ends[0], new_buf[1], 1, cudaMemcpyDeviceToHost);
      cudaMemcpy(&ends[1], static_cast<char*>(new_buf[1]) + n - 1, 1, cudaMemcpyDeviceToHost);
      if (ends[0] != 1 || ends[1] != 1) s = DataLossError("rank 1 did not receive rank 0's bytes");
    }
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(DeviceOf(r));
      cudaFree(r == 0 ? old_buf[0] : new_buf[1]);
    }
    if (!s.ok()) return PrintError(name, s);
    std::printf(
        "{\"name\":\"%s\",\"bytes\":%lld,\"gpus\":%d,\"seconds\":%.6f,\"gbps\":%.2f,"
        "\"raw_p2p_seconds\":%.6f,\"raw_p2p_gbps\":%.2f,\"ratio_vs_raw_p2p\":%.3f}\n",
        name, static_cast<long long>(n), gpus, reshard, n / reshard / 1e9, raw, n / raw / 1e9,
        raw / reshard);
    std::fflush(stdout);
  }
};

int Main(int argc, char** argv) {
  Bench b;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--mb=", 5) == 0) b.bytes = std::atoll(argv[i] + 5) << 20;
  }
  std::string why;
  if (!CudaDeviceAvailable(&why)) {
    std::printf("{\"name\":\"device_reshard_gpu\",\"skipped\":%s}\n",
                Quote("no GPU: " + why).c_str());
    return 0;
  }
  cudaGetDeviceCount(&b.gpus);
  b.gpus = std::max(1, std::min(b.gpus, kRanks));
  b.Lifecycle();
  b.Reshard();
  return 0;
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) { return morph::Main(argc, argv); }
