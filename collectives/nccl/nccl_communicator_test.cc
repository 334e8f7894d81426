// NCCL backend on one GPU (label gpu): single-rank init, collectives on device memory,
// split, abort, re-init. Skips, saying why, where CUDA finds no device.
#include "collectives/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <thread>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;
constexpr std::chrono::seconds kTimeout(60);

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no GPU: " << why;
  }
  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
};

template <typename T>
std::vector<T> RoundTrip(Communicator& comm, std::vector<T> host, CollectiveOp op) {
  void* dev = nullptr;
  cudaMalloc(&dev, host.size() * sizeof(T));
  cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  op.recv = dev;
  comm.Run(op).CheckOk("collective");
  cudaMemcpy(host.data(), dev, host.size() * sizeof(T), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  return host;
}

TEST_F(NcclTest, SingleRankInitAllreduceSplitAbortReinit) {
  MemoryStore g0(table_, 0);
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto comm, NcclCommunicator::Create(g0, "world", 0, 1, 0, Deadline::After(kTimeout)));
  EXPECT_EQ(comm->capabilities().backend, "nccl");
  EXPECT_TRUE(comm->capabilities().device_memory);
  std::vector<float> f = {1.5f, -2.0f, 3.25f};
  EXPECT_EQ(
      RoundTrip(*comm, f,
                CollectiveOp::Allreduce(nullptr, 3, DType::kF32, ReduceOp::kSum, kTimeout)),
      f);
  std::vector<uint16_t> b = {FloatToBFloat16(1), FloatToBFloat16(-7)};
  EXPECT_EQ(
      RoundTrip(*comm, b,
                CollectiveOp::Allreduce(nullptr, 2, DType::kBF16, ReduceOp::kMax, kTimeout)),
      b);
  MORPH_EXPECT_OK(comm->Barrier(kTimeout));
  // Host memory is refused up front.
  float host = 0;
  EXPECT_THAT(comm->Allreduce(&host, 1, DType::kF32, ReduceOp::kSum, kTimeout),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("host memory")));

  MORPH_ASSERT_OK_AND_ASSIGN(auto sub, comm->Split(0, 0, "sub", Deadline::After(kTimeout)));
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  std::vector<int64_t> i = {4, 5};
  EXPECT_EQ(RoundTrip(*sub, i, CollectiveOp::Broadcast(nullptr, 2, DType::kI64, 0, kTimeout)),
            i);

  // Abort from another thread: the next call returns kAborted; nothing hangs.
  std::thread([&] { comm->Abort(); }).join();
  EXPECT_THAT(comm->Barrier(kTimeout), StatusIs(StatusCode::kAborted, HasSubstr("Abort()")));
  EXPECT_TRUE(comm->broken());
  comm.reset();  // ncclCommAbort, not Destroy

  // Re-init for the next generation with a fresh unique id.
  MORPH_ASSERT_OK(g0.AdvanceGeneration(1, Deadline::AfterMs(100)));
  MemoryStore g1(table_, 1);
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto again, NcclCommunicator::Create(g1, "world", 0, 1, 0, Deadline::After(kTimeout)));
  MORPH_EXPECT_OK(again->Barrier(kTimeout));
}

TEST_F(NcclTest, GroupBuilderSplitsSubgroupsFromWorld) {
  MemoryStore g0(table_, 0);
  GroupBuilder builder(NcclFactory(0));
  builder.SplitFromWorld();
  MORPH_ASSERT_OK_AND_ASSIGN(auto groups, builder.Build(g0, ParallelConfig{}, 0, 1,
                                                        Deadline::After(kTimeout)));
  EXPECT_EQ(groups->dp().size(), 1);
  EXPECT_EQ(groups->tp().capabilities().backend, "nccl");
  MORPH_EXPECT_OK(groups->pp().Barrier(kTimeout));
}

TEST(NcclArgsTest, BadArgumentsWithoutAGpu) {
  auto table = std::make_shared<KvTable>();
  MemoryStore store(table, 0);
  EXPECT_THAT(NcclCommunicator::Create(store, "w", 1, 1, 0, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 1 of size 1")));
  std::string why;
  if (!CudaDeviceAvailable(&why)) {
    EXPECT_THAT(NcclCommunicator::Create(store, "w", 0, 1, 0, Deadline::AfterMs(100)),
                StatusIs(StatusCode::kUnavailable, HasSubstr("cudaGetDeviceCount")));
  }
}

}  // namespace
}  // namespace morph
