#include "reshard/inproc_transport.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "base/testing.h"
#include "reshard/strided_copy.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(InProcTransportTest, MatchesInOrderAcrossGroups) {
  auto hub = std::make_shared<InProcHub>(2);
  std::vector<int> a{1, 2, 3}, b{4, 5};
  std::vector<int> ra(3), rb(2);
  std::thread t0([&] {
    InProcTransport t(hub, 0);
    std::vector<SendOp> s1{{1, a.data(), 12}};
    std::vector<SendOp> s2{{1, b.data(), 8}};
    auto w1 = t.Start(s1, {});
    auto w2 = t.Start(s2, {});
    ASSERT_TRUE(w1.ok() && w2.ok());
    MORPH_EXPECT_OK((*w1)->Wait(Deadline::AfterMs(10000)));
    MORPH_EXPECT_OK((*w2)->Wait(Deadline::AfterMs(10000)));
  });
  std::thread t1([&] {
    InProcTransport t(hub, 1);
    std::vector<RecvOp> r{{0, ra.data(), 12}, {0, rb.data(), 8}};
    auto w = t.Start({}, r);
    ASSERT_TRUE(w.ok());
    MORPH_EXPECT_OK((*w)->Wait(Deadline::AfterMs(10000)));
  });
  t0.join();
  t1.join();
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
  EXPECT_EQ(hub->bytes_delivered(), 20);
}

TEST(InProcTransportTest, SizeMismatchIsInternalOnBothSides) {
  auto hub = std::make_shared<InProcHub>(2);
  char buf[16] = {};
  Status s0, s1;
  std::thread t0([&] {
    InProcTransport t(hub, 0);
    std::vector<SendOp> s{{1, buf, 16}};
    s0 = (*t.Start(s, {}))->Wait(Deadline::AfterMs(10000));
  });
  std::thread t1([&] {
    InProcTransport t(hub, 1);
    char out[8];
    std::vector<RecvOp> r{{0, out, 8}};
    s1 = (*t.Start({}, r))->Wait(Deadline::AfterMs(10000));
  });
  t0.join();
  t1.join();
  EXPECT_THAT(
      s0, StatusIs(StatusCode::kInternal, HasSubstr("sends 16 bytes to rank 1, which expects 8")));
  EXPECT_THAT(s1, StatusIs(StatusCode::kInternal, HasSubstr("size mismatch")));
}

TEST(InProcTransportTest, TagMismatchFailsBothSidesAndCopiesNothing) {
  auto hub = std::make_shared<InProcHub>(2);
  char buf[16] = {1, 2, 3};
  char out[16] = {};
  Status s0, s1;
  std::thread t0([&] {
    InProcTransport t(hub, 0);
    std::vector<SendOp> s{{1, buf, 16, nullptr, /*tag=*/0xabc}};
    s0 = (*t.Start(s, {}))->Wait(Deadline::AfterMs(10000));
  });
  std::thread t1([&] {
    InProcTransport t(hub, 1);
    std::vector<RecvOp> r{{0, out, 16, nullptr, /*tag=*/0xdef}};
    s1 = (*t.Start({}, r))->Wait(Deadline::AfterMs(10000));
  });
  t0.join();
  t1.join();
  for (const Status& s : {s0, s1}) {
    EXPECT_THAT(s, StatusIs(StatusCode::kFailedPrecondition,
                            AllOf(HasSubstr("tag mismatch"), HasSubstr("0x0000000000000abc"),
                                  HasSubstr("0x0000000000000def"))));
  }
  EXPECT_EQ(out[0], 0);
}

TEST(InProcTransportTest, AbortWakesPendingWait) {
  auto hub = std::make_shared<InProcHub>(2);
  InProcTransport t(hub, 0);
  char buf[4];
  std::vector<RecvOp> r{{1, buf, 4}};
  MORPH_ASSERT_OK_AND_ASSIGN(auto work, t.Start({}, r));
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    t.Abort();
  });
  // Without the abort this Wait would end with kDeadlineExceeded after 60 s.
  EXPECT_THAT(work->Wait(Deadline::AfterMs(60000)),
              StatusIs(StatusCode::kAborted, HasSubstr("aborted")));
  aborter.join();
  EXPECT_THAT(t.Start({}, r).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("aborted")));
}

TEST(InProcTransportTest, DeadlineThenPeerSeesClosedRank) {
  auto hub = std::make_shared<InProcHub>(2);
  InProcTransport t0(hub, 0);
  char buf[4] = {};
  std::vector<RecvOp> r{{1, buf, 4}};
  MORPH_ASSERT_OK_AND_ASSIGN(auto work, t0.Start({}, r));
  EXPECT_THAT(work->Wait(Deadline::AfterMs(20)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("rank 0")));
  InProcTransport t1(hub, 1);
  std::vector<SendOp> s{{0, buf, 4}};
  MORPH_ASSERT_OK_AND_ASSIGN(auto w1, t1.Start(s, {}));
  EXPECT_THAT(w1->Wait(Deadline::AfterMs(10000)),
              StatusIs(StatusCode::kUnavailable, HasSubstr("peer 0 closed its transport")));
}

TEST(InProcTransportTest, KilledRankAndInjectedFault) {
  auto hub = std::make_shared<InProcHub>(3);
  InProcTransport t0(hub, 0);
  char buf[4] = {};
  std::vector<RecvOp> r{{2, buf, 4}};
  MORPH_ASSERT_OK_AND_ASSIGN(auto work, t0.Start({}, r));
  hub->KillRank(2);
  EXPECT_THAT(work->Wait(Deadline::AfterMs(60000)),
              StatusIs(StatusCode::kUnavailable, HasSubstr("peer 2 is gone")));

  auto hub2 = std::make_shared<InProcHub>(2);
  hub2->InjectFailAfterBytes(4);
  InProcTransport a(hub2, 0), b(hub2, 1);
  std::vector<SendOp> s{{1, buf, 4}, {1, buf, 4}};
  char out[8];
  std::vector<RecvOp> rr{{0, out, 4}, {0, out + 4, 4}};
  MORPH_ASSERT_OK_AND_ASSIGN(auto ws, a.Start(s, {}));
  MORPH_ASSERT_OK_AND_ASSIGN(auto wr, b.Start({}, rr));
  EXPECT_THAT(ws->Wait(Deadline::AfterMs(10000)),
              StatusIs(StatusCode::kUnavailable, HasSubstr("injected fault")));
  EXPECT_THAT(wr->Wait(Deadline::AfterMs(10000)),
              StatusIs(StatusCode::kUnavailable, HasSubstr("")));
  EXPECT_EQ(hub2->bytes_delivered(), 4);
}

TEST(InProcTransportTest, BadPeerIsInvalidArgument) {
  auto hub = std::make_shared<InProcHub>(2);
  InProcTransport t(hub, 0);
  char buf[4];
  std::vector<SendOp> s{{5, buf, 4}};
  EXPECT_THAT(t.Start(s, {}).status(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("peer 5")));
  std::vector<SendOp> self{{0, buf, 4}};
  EXPECT_THAT(t.Start(self, {}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("peer 0")));
}

// A 6 x 10 matrix of int32 `base + i`; its box rows [1, 5) x cols [2, 7) is what moves.
std::vector<int32_t> Matrix(int32_t base) {
  std::vector<int32_t> m(60);
  for (int i = 0; i < 60; ++i) m[static_cast<size_t>(i)] = base + i;
  return m;
}
StridedView BoxView(int64_t cols) {  // rows [1, 5) x cols [2, 7) of a matrix with `cols` cols
  return StridedView{1 * cols + 2, {4, 5}, {cols, 1}};
}

// One 20-element message of the box, split into two ops of 12 and 8 elements, in every
// combination of strided / contiguous on either side; the receiver's layout has a different
// row length (8 columns, 16-bit halves) to check that layouts combine byte-wise.
TEST(InProcTransportTest, StridedOpsScatterAndGatherInOnePass) {
  MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry send_g,
                             MakeCopyGeometry(ContiguousView({4, 5}), BoxView(10)));
  // The receiver sees the same bytes as int16 pairs: a box of 4 x 10 int16 in an 8 x 16 matrix.
  MORPH_ASSERT_OK_AND_ASSIGN(
      CopyGeometry recv_g,
      MakeCopyGeometry(StridedView{2 * 16 + 4, {4, 10}, {16, 1}}, ContiguousView({4, 10})));
  const std::vector<int32_t> src = Matrix(100);
  std::vector<int32_t> want;  // the box, row-major
  for (int r = 1; r < 5; ++r)
    for (int c = 2; c < 7; ++c) want.push_back(src[static_cast<size_t>(r * 10 + c)]);
  for (int mode = 0; mode < 4; ++mode) {
    SCOPED_TRACE("mode " + std::to_string(mode));
    const bool send_strided = mode & 1, recv_strided = mode & 2;
    auto hub = std::make_shared<InProcHub>(2);
    std::vector<int32_t> dst(64, -1);  // 8 x 16 int16 = 64 int32
    std::thread t0([&] {
      InProcTransport t(hub, 0);
      EXPECT_TRUE(t.SupportsStridedOps());
      std::vector<StridedLayout> l{{&send_g, 4, 0, 12}, {&send_g, 4, 12, 20}};
      std::vector<SendOp> s;
      if (send_strided) {
        s = {{1, src.data(), 48, &l[0]}, {1, src.data(), 32, &l[1]}};
      } else {
        s = {{1, want.data(), 48}, {1, want.data() + 12, 32}};
      }
      auto w = t.Start(s, {});
      ASSERT_TRUE(w.ok()) << w.status();
      MORPH_EXPECT_OK((*w)->Wait(Deadline::AfterMs(10000)));
    });
    std::vector<int32_t> flat(20, -1);
    std::thread t1([&] {
      InProcTransport t(hub, 1);
      std::vector<StridedLayout> l{{&recv_g, 2, 0, 24}, {&recv_g, 2, 24, 40}};
      std::vector<RecvOp> r;
      if (recv_strided) {
        r = {{0, dst.data(), 48, &l[0]}, {0, dst.data(), 32, &l[1]}};
      } else {
        r = {{0, flat.data(), 48}, {0, flat.data() + 12, 32}};
      }
      auto w = t.Start({}, r);
      ASSERT_TRUE(w.ok()) << w.status();
      MORPH_EXPECT_OK((*w)->Wait(Deadline::AfterMs(10000)));
    });
    t0.join();
    t1.join();
    EXPECT_EQ(hub->bytes_delivered(), 80);
    if (!recv_strided) {
      EXPECT_EQ(flat, want);
      continue;
    }
    // Rows [2, 6) x int16 cols [4, 14) of the 8 x 16 int16 matrix = int32 cols [2, 7) of 8.
    for (int r = 0; r < 8; ++r) {
      for (int c = 0; c < 8; ++c) {
        const int32_t got = dst[static_cast<size_t>(r * 8 + c)];
        if (r >= 2 && r < 6 && c >= 2 && c < 7) {
          EXPECT_EQ(got, want[static_cast<size_t>((r - 2) * 5 + c - 2)]) << r << "," << c;
        } else {
          EXPECT_EQ(got, -1) << r << "," << c;
        }
      }
    }
  }
}

TEST(InProcTransportTest, MalformedStridedOpsAreInvalidArgument) {
  auto hub = std::make_shared<InProcHub>(2);
  InProcTransport t(hub, 0);
  MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry g, MakeCopyGeometry(ContiguousView({4, 5}), BoxView(10)));
  int32_t buf[60] = {};
  StridedLayout wrong_size{&g, 4, 0, 10};
  std::vector<SendOp> s{{1, buf, 44, &wrong_size}};
  EXPECT_THAT(t.Start(s, {}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("op says 44 bytes")));
  StridedLayout past_end{&g, 4, 10, 21};
  std::vector<RecvOp> r{{1, buf, 44, &past_end}};
  EXPECT_THAT(t.Start({}, r).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("malformed layout")));
  StridedLayout no_geometry{nullptr, 4, 0, 1};
  r = {{1, buf, 4, &no_geometry}};
  EXPECT_THAT(t.Start({}, r).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("malformed layout")));
}

}  // namespace
}  // namespace morph
