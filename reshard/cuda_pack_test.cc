// GPU tests of the CUDA pack/unpack kernels and of the executor on device memory. Label `gpu`;
// every test skips, saying why, when no usable GPU is present.
#include "reshard/cuda_pack.h"

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "base/testing.h"
#include "reshard/executor.h"
#include "reshard/inproc_transport.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

using namespace ::morph::testutil;  // NOLINT

class CudaPackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      GTEST_SKIP() << "no usable GPU: cudaGetDeviceCount -> "
                   << (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
};

struct DeviceBuf {
  explicit DeviceBuf(size_t n) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&p, n == 0 ? 1 : n), cudaSuccess);
  }
  ~DeviceBuf() { cudaFree(p); }
  void* p = nullptr;
  size_t bytes;
};

TEST_F(CudaPackTest, RandomCopiesMatchHost) {
  const unsigned long long seed = morph::testing::TestSeed();
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 300; ++iter) {
    const int rank = 1 + static_cast<int>(rng() % 4);
    std::vector<Interval> box, fa, fb;
    for (int d = 0; d < rank; ++d) {
      const int64_t len = 1 + static_cast<int64_t>(rng() % (d == rank - 1 ? 300 : 9));
      box.push_back({2, 2 + len});
      fa.push_back(
          {2 - static_cast<int64_t>(rng() % 3), 2 + len + static_cast<int64_t>(rng() % 3)});
      fb.push_back(
          {2 - static_cast<int64_t>(rng() % 3), 2 + len + static_cast<int64_t>(rng() % 3)});
    }
    const Box b(box);
    const Shard sa = *Shard::Whole(Box(fa)), sb = *Shard::Whole(Box(fb));
    const int es = 1 << (rng() % 4);
    MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry g, MakeCopyGeometry(*ViewOf(sb, b), *ViewOf(sa, b)));
    std::vector<char> src(static_cast<size_t>(sa.NumElements() * es));
    for (char& c : src) c = static_cast<char>(rng());
    std::vector<char> want(static_cast<size_t>(sb.NumElements() * es), 7), got(want.size());
    const int64_t n = g.num_elements;
    const int64_t lo = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
    const int64_t hi = lo + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - lo));
    HostStridedCopy(g, want.data(), src.data(), es, lo, hi);
    DeviceBuf ds(src.size()), dd(want.size());
    ASSERT_EQ(cudaMemcpy(ds.p, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dd.p, 7, want.size()), cudaSuccess);
    MORPH_ASSERT_OK(CudaStridedCopy(g, dd.p, ds.p, es, lo, hi, nullptr));
    ASSERT_EQ(cudaMemcpy(got.data(), dd.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(got, want) << "iteration " << iter << " box " << b << " elem " << es;
  }
}

TEST_F(CudaPackTest, ExecutorOnDeviceMemory) {
  std::vector<TensorInfo> tensors{{"w1", DType::kF32, {256, 512}},
                                  {"w2", DType::kBF16, {512, 256}}};
  auto plans = BuildPlans(
      tensors, {TpLayout(tensors[0], 1, {0, 1, 2, 3}), FlatLayout(tensors[1], {0, 1, 2, 3})},
      {TpLayout(tensors[0], 1, {0, 1}), TpLayout(tensors[1], 0, {0, 1, 2})}, 4);
  std::vector<std::vector<char>> ref;
  for (size_t i = 0; i < tensors.size(); ++i)
    ref.push_back(ReferenceTensor(tensors[i], static_cast<int>(i)));
  auto hub = std::make_shared<InProcHub>(4, /*device_memory=*/true);
  std::vector<Status> status(4);
  std::vector<std::vector<std::vector<char>>> results(4);
  std::vector<std::thread> threads;
  for (int p = 0; p < 4; ++p) {
    threads.emplace_back([&, p] {
      cudaSetDevice(0);
      const LocalPlan& plan = plans[static_cast<size_t>(p)];
      ParticipantData host = MakeParticipantData(plan, ref);
      std::vector<Buffer> olds_dev;
      std::vector<OldShardData> olds;
      for (size_t t = 0; t < tensors.size(); ++t) {
        if (!plan.old_shards[t]) continue;
        auto b = CudaAllocator(0)(host.old_data[t].size());
        if (!b.ok()) {
          status[static_cast<size_t>(p)] = b.status();
          return;
        }
        cudaMemcpy(b->data(), host.old_data[t].data(), host.old_data[t].size(),
                   cudaMemcpyHostToDevice);
        olds.push_back({tensors[t].name, tensors[t].dtype, b->view()});
        olds_dev.push_back(std::move(b).value());
      }
      InProcTransport tr(hub, p);
      ExecutorOptions o;
      o.chunk_bytes = 16 << 10;
      auto r = Reshard(plan, olds, tr, CudaAllocator(0), o, Deadline::AfterMs(60000));
      if (!r.ok()) {
        status[static_cast<size_t>(p)] = r.status();
        return;
      }
      for (size_t t = 0; t < tensors.size(); ++t) {
        std::vector<char> h(r->new_buffers[t].size());
        if (!h.empty())
          cudaMemcpy(h.data(), r->new_buffers[t].data(), h.size(), cudaMemcpyDeviceToHost);
        results[static_cast<size_t>(p)].push_back(std::move(h));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int p = 0; p < 4; ++p) {
    MORPH_ASSERT_OK(status[static_cast<size_t>(p)]);
    for (size_t t = 0; t < tensors.size(); ++t) {
      const auto& s = plans[static_cast<size_t>(p)].new_shards[t];
      if (!s) continue;
      EXPECT_EQ(results[static_cast<size_t>(p)][t], ExtractShard(tensors[t], *s, ref[t]))
          << "participant " << p << " tensor " << tensors[t].name;
    }
  }
}

}  // namespace
}  // namespace morph
