#include "morph/status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_EQ(Status(StatusCode::kOk, "ignored"), Status());
}

TEST(StatusTest, CodeAndMessage) {
  Status s = AbortedError("peer 3 left");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(s.message(), "peer 3 left");
  EXPECT_EQ(s.ToString(), "ABORTED: peer 3 left");
}

TEST(StatusTest, EveryNamedConstructorHasItsCode) {
  EXPECT_EQ(CancelledError("").code(), StatusCode::kCancelled);
  EXPECT_EQ(UnknownError("").code(), StatusCode::kUnknown);
  EXPECT_EQ(InvalidArgumentError("").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DeadlineExceededError("").code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(NotFoundError("").code(), StatusCode::kNotFound);
  EXPECT_EQ(AlreadyExistsError("").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(PermissionDeniedError("").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(ResourceExhaustedError("").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(FailedPreconditionError("").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(OutOfRangeError("").code(), StatusCode::kOutOfRange);
  EXPECT_EQ(UnimplementedError("").code(), StatusCode::kUnimplemented);
  EXPECT_EQ(InternalError("").code(), StatusCode::kInternal);
  EXPECT_EQ(UnavailableError("").code(), StatusCode::kUnavailable);
  EXPECT_EQ(DataLossError("").code(), StatusCode::kDataLoss);
  EXPECT_EQ(UnauthenticatedError("").code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(StatusCodeName(StatusCode::kDeadlineExceeded), "DEADLINE_EXCEEDED");
}

TEST(StatusTest, WithContextPrependsAndKeepsCode) {
  Status s = UnavailableError("connection refused").WithContext("store get key x");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "store get key x: connection refused");
  EXPECT_TRUE(Status().WithContext("nothing").ok());
}

Status Leaf(bool fail) {
  if (fail) return DeadlineExceededError("allreduce timed out after 30000 ms");
  return Status();
}

Status Middle(bool fail, int tensor) {
  MORPH_RETURN_IF_ERROR(Leaf(fail)) << "resharding tensor " << tensor;
  return Status();
}

Status Top(bool fail) {
  MORPH_RETURN_IF_ERROR(Middle(fail, 7)) << "generation 4";
  return InternalError("reached the end");
}

TEST(StatusTest, ReturnIfErrorAddsContextAcrossLayers) {
  Status s = Top(true);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(), "generation 4: resharding tensor 7: allreduce timed out after 30000 ms");
  EXPECT_THAT(Top(false), StatusIs(StatusCode::kInternal, "reached the end"));
}

Status NoContext(bool fail) {
  MORPH_RETURN_IF_ERROR(Leaf(fail));
  return Status();
}

TEST(StatusTest, ReturnIfErrorWithoutContextPassesThrough) {
  EXPECT_EQ(NoContext(true), Leaf(true));
  EXPECT_TRUE(NoContext(false).ok());
}

StatusOr<int> Parse(int v) {
  if (v < 0) return InvalidArgumentError("negative: " + std::to_string(v));
  return v * 2;
}

StatusOr<int> AddParsed(int a, int b) {
  MORPH_ASSIGN_OR_RETURN(int x, Parse(a));
  MORPH_ASSIGN_OR_RETURN(int y, Parse(b), "second operand " << b);
  return x + y;
}

TEST(StatusOrTest, AssignOrReturn) {
  StatusOr<int> ok = AddParsed(1, 2);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 6);
  EXPECT_THAT(AddParsed(-1, 2), StatusIs(StatusCode::kInvalidArgument, "negative: -1"));
  EXPECT_THAT(AddParsed(1, -5),
              StatusIs(StatusCode::kInvalidArgument, "second operand -5: negative: -5"));
}

StatusOr<std::unique_ptr<int>> MakeBox(bool fail) {
  if (fail) return NotFoundError("no box");
  return std::make_unique<int>(42);
}

StatusOr<int> Unbox(bool fail) {
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<int> p, MakeBox(fail));
  return *p;
}

TEST(StatusOrTest, MoveOnlyValues) {
  EXPECT_EQ(*Unbox(false), 42);
  EXPECT_THAT(Unbox(true), StatusIs(StatusCode::kNotFound, "no box"));
  StatusOr<std::unique_ptr<int>> b = MakeBox(false);
  std::unique_ptr<int> taken = std::move(b).value();
  EXPECT_EQ(*taken, 42);
}

StatusOr<int> ReturnIfErrorInStatusOr(bool fail) {
  MORPH_RETURN_IF_ERROR(Leaf(fail)) << "in StatusOr function";
  return 1;
}

TEST(StatusOrTest, ReturnIfErrorConvertsToStatusOr) {
  EXPECT_THAT(ReturnIfErrorInStatusOr(true),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("in StatusOr function: ")));
  EXPECT_EQ(*ReturnIfErrorInStatusOr(false), 1);
}

TEST(StatusOrTest, OkStatusBecomesInternal) {
  StatusOr<int> s{Status()};
  EXPECT_THAT(s, StatusIs(StatusCode::kInternal, HasSubstr("OK status")));
}

TEST(StatusOrTest, ValueOr) {
  EXPECT_EQ(StatusOr<int>(AbortedError("x")).value_or(5), 5);
  EXPECT_EQ(StatusOr<int>(3).value_or(5), 3);
}

TEST(StatusOrDeathTest, ValueOnErrorAborts) {
  StatusOr<int> s = UnavailableError("peer gone");
  EXPECT_DEATH((void)s.value(), "UNAVAILABLE: peer gone");
}

TEST(StatusPayloadTest, CollectiveFailureRoundTripsAndSurvivesContext) {
  Status plain = UnavailableError("peer gone");
  EXPECT_EQ(plain.collective_failure(), nullptr);
  EXPECT_TRUE(plain.failed_peers().empty());

  Status s = plain.WithCollectiveFailure({CollectiveFailure::Kind::kPeerClosed, {3, 1}});
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "peer gone");
  ASSERT_NE(s.collective_failure(), nullptr);
  EXPECT_EQ(s.collective_failure()->kind, CollectiveFailure::Kind::kPeerClosed);
  EXPECT_EQ(std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()),
            (std::vector<int>{1, 3}));  // sorted, deduplicated
  // The original is unchanged (Status is a value).
  EXPECT_EQ(plain.collective_failure(), nullptr);

  // Context, copies, moves and the macros keep it.
  Status wrapped = s.WithContext("generation 4").WithContext("step 9");
  EXPECT_EQ(wrapped.message(), "step 9: generation 4: peer gone");
  ASSERT_NE(wrapped.collective_failure(), nullptr);
  EXPECT_EQ(std::vector<int>(wrapped.failed_peers().begin(), wrapped.failed_peers().end()),
            (std::vector<int>{1, 3}));
  auto via_macro = [&]() -> Status {
    MORPH_RETURN_IF_ERROR(s) << "allreduce of " << 7 << " floats";
    return Status::Ok();
  };
  Status m = via_macro();
  EXPECT_EQ(m.message(), "allreduce of 7 floats: peer gone");
  EXPECT_EQ(m.failed_peers().size(), 2u);
  StatusOr<int> so = m;
  EXPECT_EQ(so.status().failed_peers().size(), 2u);
  Status moved = std::move(m).WithContext("x");
  EXPECT_EQ(moved.failed_peers().size(), 2u);

  // Timeouts and remote errors with unknown peers: a kind, no peers.
  Status t = DeadlineExceededError("late").WithCollectiveFailure(
      {CollectiveFailure::Kind::kTimeout, {}});
  ASSERT_NE(t.collective_failure(), nullptr);
  EXPECT_EQ(t.collective_failure()->kind, CollectiveFailure::Kind::kTimeout);
  EXPECT_TRUE(t.failed_peers().empty());
  EXPECT_EQ(CollectiveFailureKindName(CollectiveFailure::Kind::kRemoteError), "remote_error");
  // OK stays OK and carries nothing.
  Status ok = Status::Ok().WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {1}});
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.collective_failure(), nullptr);
  // The payload does not change equality or the text.
  EXPECT_EQ(s, plain);
  EXPECT_EQ(s.ToString(), "UNAVAILABLE: peer gone");
}

}  // namespace
}  // namespace morph
