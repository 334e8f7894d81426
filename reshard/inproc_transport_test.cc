#include "reshard/inproc_transport.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
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

}  // namespace
}  // namespace morph
