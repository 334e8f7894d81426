#include "base/check.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

Status OpenMissing(const char* path) {
  MORPH_ASSIGN_SYSCALL_OR_RETURN(int fd, ::open(path, O_RDONLY), "opening " << path);
  ::close(fd);
  return Status();
}

TEST(CheckTest, SyscallFailureNamesCallErrnoAndLocation) {
  Status s = OpenMissing("/nonexistent/morph");
  EXPECT_THAT(s, StatusIs(StatusCode::kNotFound,
                          AllOf(HasSubstr("opening /nonexistent/morph: "),
                                HasSubstr("::open(path, ") , HasSubstr(") failed: No such file or directory"),
                                HasSubstr("(errno 2)"), HasSubstr("[base/check_test.cc:"))));
}

Status CloseBad() {
  MORPH_SYSCALL_RETURN_IF_ERROR(::close(-1)) << "closing";
  return Status();
}

TEST(CheckTest, SyscallReturnIfError) {
  EXPECT_THAT(CloseBad(), StatusIs(StatusCode::kInvalidArgument,
                                   MatchesRegex("closing: ::close\\(-1\\) failed: Bad file "
                                                "descriptor \\(errno 9\\) \\[base/check_test.cc:[0-9]+\\]")));
}

Status Succeeds(int* fd_out) {
  MORPH_ASSIGN_SYSCALL_OR_RETURN(*fd_out, ::open("/dev/null", O_RDONLY));
  MORPH_SYSCALL_RETURN_IF_ERROR(::close(*fd_out));
  return Status();
}

TEST(CheckTest, SyscallSuccess) {
  int fd = -1;
  MORPH_EXPECT_OK(Succeeds(&fd));
  EXPECT_GE(fd, 0);
}

int eintr_calls = 0;
int FlakyCall() {
  if (++eintr_calls < 3) {
    errno = EINTR;
    return -1;
  }
  return 7;
}

Status RetriesEintr(int* out) {
  MORPH_ASSIGN_SYSCALL_OR_RETURN(*out, FlakyCall());
  return Status();
}

TEST(CheckTest, SyscallRetriesEintr) {
  eintr_calls = 0;
  int v = 0;
  MORPH_EXPECT_OK(RetriesEintr(&v));
  EXPECT_EQ(v, 7);
  EXPECT_EQ(eintr_calls, 3);
}

TEST(CheckTest, ErrnoMapping) {
  EXPECT_EQ(ErrnoToStatusCode(ECONNREFUSED), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoToStatusCode(ECONNRESET), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoToStatusCode(EPIPE), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoToStatusCode(ETIMEDOUT), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ErrnoToStatusCode(ENOENT), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoToStatusCode(EEXIST), StatusCode::kAlreadyExists);
  EXPECT_EQ(ErrnoToStatusCode(EACCES), StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoToStatusCode(ENOSPC), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoToStatusCode(EINVAL), StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrnoToStatusCode(ECANCELED), StatusCode::kCancelled);
  EXPECT_EQ(ErrnoToStatusCode(EIO), StatusCode::kInternal);
}

TEST(CheckTest, ApiErrorFormat) {
  Status s = ApiError(StatusCode::kUnavailable, "NCCL", "ncclAllReduce(...)", 2,
                      "unhandled system error", "/src/morph/collectives/nccl.cc", 88);
  EXPECT_EQ(s.ToString(),
            "UNAVAILABLE: ncclAllReduce(...) failed: unhandled system error (NCCL error 2) "
            "[collectives/nccl.cc:88]");
}

}  // namespace
}  // namespace morph
