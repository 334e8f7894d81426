// MORPH_BACKEND=nccl on a GPU (label gpu; tests/gpu/run.sh runs it on a lent machine, here it
// skips): a one-worker job with a CUDA tensor, whose step's world communicator is NCCL and
// reduces the tensor's device memory in place.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "base/testing.h"
#include "collectives/nccl/nccl_communicator.h"
#include "morph/runtime.h"

namespace morph {
namespace {

bool HaveGpu(std::string* why) { return CudaDeviceAvailable(why); }

// On a GPU (tests/gpu/run.sh): a one-worker job with the NCCL backend and a CUDA tensor; the
// step's world communicator is NCCL and reduces the tensor's device memory in place.
TEST(DataPlaneGpuTest, NcclRuntimeReducesCudaStateOnTheGpu) {
  std::string why;
  if (!HaveGpu(&why)) GTEST_SKIP() << "no GPU: " << why;
  Options o;
  o.bootstrap = Bootstrap::kHost;
  o.model = {.num_layers = 1, .global_batch = 4};
  o.dataset_samples = 8;
  o.heartbeat_ms = 50;
  o.start_timeout_ms = 60000;
  o.handle_sigterm = false;
  o.backend = Backend::kNccl;
  MORPH_ASSERT_OK_AND_ASSIGN(auto rt, Runtime::Start(o, [](State& s) {
                               return s.AddTensor("x", {4}, DType::kF32, Layout::Layer(0),
                                                  MemoryKind::kCuda);
                             }));
  MORPH_ASSERT_OK_AND_ASSIGN(Step step, rt->BeginStep());
  EXPECT_EQ(step.world().capabilities().backend, "nccl");
  MORPH_ASSERT_OK_AND_ASSIGN(State::TensorRef x, rt->state().tensor("x"));
  ASSERT_EQ(x.data.kind, MemoryKind::kCuda);
  const float in[4] = {1.5f, -2.f, 3.25f, 4.f};
  float out[4] = {};
  ASSERT_EQ(cudaMemcpy(x.data.data, in, sizeof in, cudaMemcpyHostToDevice), cudaSuccess);
  MORPH_ASSERT_OK(step.world().Allreduce(x.data.data, 4, DType::kF32, ReduceOp::kSum,
                                         std::chrono::seconds(30)));
  ASSERT_EQ(cudaMemcpy(out, x.data.data, sizeof out, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], in[i]) << i;  // one rank: the sum is itself
  MORPH_ASSERT_OK(rt->EndStep());
  MORPH_ASSERT_OK(rt->Finish());
  std::printf("gpu-note: Runtime with MORPH_BACKEND=nccl: allreduce of CUDA state passed\n");
}

}  // namespace
}  // namespace morph
