// CUDA and NCCL error conversion. Needs the toolkit's headers and libraries but no GPU:
// cudaGetErrorString and ncclGetErrorString are table lookups.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/cuda_check.h"
#include "base/nccl_check.h"
#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

Status CudaFails(cudaError_t e) {
  MORPH_CUDA_RETURN_IF_ERROR(e) << "copying shard w1";
  return Status();
}

TEST(CudaCheckTest, ErrorsBecomeStatusWithMessageAndLocation) {
  EXPECT_THAT(CudaFails(cudaErrorMemoryAllocation),
              StatusIs(StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("copying shard w1: e failed: cudaErrorMemoryAllocation: "),
                             HasSubstr("out of memory"), HasSubstr("(CUDA error 2)"),
                             HasSubstr("[base/cuda_check_test.cc:"))));
  EXPECT_THAT(CudaFails(cudaErrorInsufficientDriver),
              StatusIs(StatusCode::kUnavailable, HasSubstr("cudaErrorInsufficientDriver")));
  EXPECT_THAT(CudaFails(cudaErrorInvalidValue), StatusIs(StatusCode::kInvalidArgument, HasSubstr("invalid argument")));
  EXPECT_THAT(CudaFails(cudaErrorIllegalAddress), StatusIs(StatusCode::kInternal, HasSubstr("illegal memory access")));
  MORPH_EXPECT_OK(CudaFails(cudaSuccess));
}

Status NcclFails(ncclResult_t r) {
  MORPH_NCCL_RETURN_IF_ERROR(r) << "allreduce";
  return Status();
}

TEST(NcclCheckTest, ErrorsBecomeStatusWithMessageAndLocation) {
  EXPECT_THAT(NcclFails(ncclSystemError),
              StatusIs(StatusCode::kUnavailable,
                       AllOf(HasSubstr("allreduce: r failed: unhandled system error"),
                             HasSubstr("(NCCL error 2)"), HasSubstr("[base/cuda_check_test.cc:"))));
  EXPECT_THAT(NcclFails(ncclRemoteError), StatusIs(StatusCode::kUnavailable, HasSubstr("remote process exited")));
  EXPECT_THAT(NcclFails(ncclInvalidArgument), StatusIs(StatusCode::kInvalidArgument, HasSubstr("invalid argument")));
  EXPECT_THAT(NcclFails(ncclInternalError), StatusIs(StatusCode::kInternal, HasSubstr("internal error")));
  MORPH_EXPECT_OK(NcclFails(ncclSuccess));
}

TEST(NcclCheckTest, VersionIsAvailableWithoutGpu) {
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  EXPECT_GE(version, 22800);
}

}  // namespace
}  // namespace morph
