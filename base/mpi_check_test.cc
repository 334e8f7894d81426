// MPI error conversion. Runs as a singleton (no mpirun needed).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/mpi_check.h"
#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

Status MpiFails(int code) {
  MORPH_MPI_RETURN_IF_ERROR(code) << "broadcasting the coordinator address";
  return Status();
}

TEST(MpiCheckTest, ErrorsBecomeStatusWithMessageAndLocation) {
  EXPECT_THAT(MpiFails(MPI_ERR_RANK),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("broadcasting the coordinator address: code failed: "),
                             HasSubstr("invalid rank"), HasSubstr("(MPI error "),
                             HasSubstr("[base/mpi_check_test.cc:"))));
  EXPECT_THAT(MpiFails(MPI_ERR_NO_MEM), StatusIs(StatusCode::kResourceExhausted, HasSubstr("MPI")));
  EXPECT_THAT(MpiFails(MPI_ERR_OTHER), StatusIs(StatusCode::kUnavailable, HasSubstr("MPI error")));
  MORPH_EXPECT_OK(MpiFails(MPI_SUCCESS));
}

}  // namespace
}  // namespace morph

// MPI_Error_string may not be called before MPI_Init in Open MPI 4.1: run as an MPI singleton.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  MPI_Init(&argc, &argv);
  int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
