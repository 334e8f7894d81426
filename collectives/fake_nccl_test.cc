// The fake NCCL communicator moves real bytes and fails the way the device path relies on:
// collective creation, device-memory checks, in-order matching, size mismatches, Abort from
// another thread, deadlines, dead processes, shrink without the dead.
#include "collectives/fake_nccl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "base/testing.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/store/store.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
constexpr std::chrono::milliseconds kTimeout(10000);

struct World {
  explicit World(int n) : device(std::make_shared<FakeDevice>()),
                          hub(std::make_shared<FakeNcclHub>(n, device)) {}
  // Every rank's "world" communicator, built by n threads.
  std::vector<std::unique_ptr<Communicator>> Build(int n, int64_t generation = 1) {
    std::vector<std::unique_ptr<Communicator>> comms(static_cast<size_t>(n));
    FirstError(RunRankThreads(n, [&](int r) -> Status {
      MemoryStore store(table, generation);
      MORPH_ASSIGN_OR_RETURN(comms[static_cast<size_t>(r)],
                             hub->Factory(r)(store, "world", r, n, Deadline::After(kTimeout)));
      return Status::Ok();
    })).CheckOk("building the fake world");
    return comms;
  }
  Buffer Filled(size_t bytes, char c) {
    Buffer b = device->Allocate(bytes).value();
    std::memset(b.data(), c, bytes);
    return b;
  }
  std::shared_ptr<KvTable> table = std::make_shared<KvTable>();
  std::shared_ptr<FakeDevice> device;
  std::shared_ptr<FakeNcclHub> hub;
};

CollectiveOp Exchange(std::vector<P2POp> ops) {
  return CollectiveOp::SendRecv(std::move(ops), kTimeout);
}

TEST(FakeNcclTest, RingMovesBytesInPostingOrder) {
  World w(3);
  auto comms = w.Build(3);
  std::vector<Buffer> out, in1, in2;
  for (int r = 0; r < 3; ++r) {
    out.push_back(w.Filled(64, static_cast<char>('a' + r)));
    in1.push_back(w.Filled(32, 0));
    in2.push_back(w.Filled(32, 0));
  }
  MORPH_ASSERT_OK(FirstError(RunRankThreads(3, [&](int r) -> Status {
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    Communicator& c = *comms[static_cast<size_t>(r)];
    // Two groups; the second's message must match the second receive.
    char* o = static_cast<char*>(out[static_cast<size_t>(r)].data());
    o[32] = 'X';
    MORPH_RETURN_IF_ERROR(c.Run(Exchange({{P2POp::Kind::kSend, next, o, 32},
                                          {P2POp::Kind::kRecv, prev, in1[r].data(), 32}})));
    return c.Run(Exchange({{P2POp::Kind::kSend, next, o + 32, 32},
                           {P2POp::Kind::kRecv, prev, in2[r].data(), 32}}));
  })));
  for (int r = 0; r < 3; ++r) {
    const char want = static_cast<char>('a' + (r + 2) % 3);
    EXPECT_EQ(static_cast<char*>(in1[static_cast<size_t>(r)].data())[5], want);
    EXPECT_EQ(static_cast<char*>(in2[static_cast<size_t>(r)].data())[0], 'X');
  }
  EXPECT_EQ(w.hub->bytes_delivered(), 3 * 64);
  EXPECT_EQ(w.hub->groups_started(), 6);
}

TEST(FakeNcclTest, RefusesHostMemoryAndCollectives) {
  World w(2);
  auto comms = w.Build(2);
  char host[8] = {};
  EXPECT_THAT(comms[0]->Start(Exchange({{P2POp::Kind::kSend, 1, host, 8}})).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("host memory")));
  Buffer b = w.Filled(8, 1);
  EXPECT_THAT(comms[0]->Allreduce(b.data(), 2, DType::kF32, ReduceOp::kSum, kTimeout),
              StatusIs(StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(comms[0]->Barrier(kTimeout), StatusIs(StatusCode::kUnimplemented, ::testing::_));
}

TEST(FakeNcclTest, SizeMismatchFailsBothSides) {
  World w(2);
  auto comms = w.Build(2);
  Buffer a = w.Filled(16, 1), b = w.Filled(16, 0);
  std::vector<Status> r = RunRankThreads(2, [&](int rank) -> Status {
    if (rank == 0) return comms[0]->Run(Exchange({{P2POp::Kind::kSend, 1, a.data(), 16}}));
    return comms[1]->Run(Exchange({{P2POp::Kind::kRecv, 0, b.data(), 8}}));
  });
  EXPECT_THAT(r[0], StatusIs(StatusCode::kInternal, HasSubstr("sends 16 bytes")));
  EXPECT_THAT(r[1], StatusIs(StatusCode::kInternal, HasSubstr("expects 8")));
}

TEST(FakeNcclTest, AbortFromAnotherThreadFailsTheWaitAndThePeer) {
  World w(3);
  auto comms = w.Build(3);
  Buffer a = w.Filled(16, 0), b = w.Filled(16, 0);
  // Rank 0 waits for rank 2, which never sends; rank 1 waits for rank 0.
  MORPH_ASSERT_OK_AND_ASSIGN(auto w0,
                             comms[0]->Start(Exchange({{P2POp::Kind::kRecv, 2, a.data(), 16},
                                                       {P2POp::Kind::kSend, 1, a.data(), 16},
                                                       {P2POp::Kind::kRecv, 1, a.data(), 16}})));
  MORPH_ASSERT_OK_AND_ASSIGN(auto w1,
                             comms[1]->Start(Exchange({{P2POp::Kind::kRecv, 0, b.data(), 16},
                                                       {P2POp::Kind::kSend, 0, b.data(), 16}})));
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    comms[0]->Abort();
  });
  const auto t0 = std::chrono::steady_clock::now();
  Status s0 = w0->Wait(Deadline::After(kTimeout));
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_THAT(s0, StatusIs(StatusCode::kAborted, ::testing::_));
  // Rank 1's group matched before the abort: it completed.
  MORPH_EXPECT_OK(w1->Wait(Deadline::After(kTimeout)));
  EXPECT_TRUE(comms[0]->broken());
  EXPECT_THAT(comms[0]->Start(Exchange({})).status(), StatusIs(StatusCode::kAborted, ::testing::_));
  // A later operation with the aborted rank fails at once, naming it.
  Status s1 = comms[1]->Run(Exchange({{P2POp::Kind::kRecv, 0, b.data(), 16}}));
  EXPECT_THAT(s1, StatusIs(StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(s1.failed_peers(), ElementsAre(0));
}

TEST(FakeNcclTest, DeadlineBreaksTheCommunicator) {
  World w(2);
  auto comms = w.Build(2);
  Buffer a = w.Filled(16, 0);
  CollectiveOp op = Exchange({{P2POp::Kind::kRecv, 1, a.data(), 16}});
  op.timeout = std::chrono::milliseconds(100);
  EXPECT_THAT(comms[0]->Run(op), StatusIs(StatusCode::kDeadlineExceeded, ::testing::_));
  EXPECT_TRUE(comms[0]->broken());
}

TEST(FakeNcclTest, InitWaitsForEveryRank) {
  World w(3);
  MemoryStore store(w.table, 1);
  auto c = w.hub->Factory(0)(store, "world", 0, 3, Deadline::AfterMs(100));
  EXPECT_THAT(c.status(), StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("1 of 3")));
}

// A process dies mid-operation: its peer fails; the survivors shrink without it (no rendezvous,
// the dead rank does not block it), keep their order, and talk again; the parent is released.
TEST(FakeNcclTest, KillThenShrinkWithoutTheDead) {
  World w(4);
  auto comms = w.Build(4);
  Buffer a = w.Filled(16, 7), b = w.Filled(16, 0);
  MORPH_ASSERT_OK_AND_ASSIGN(auto w0,
                             comms[0]->Start(Exchange({{P2POp::Kind::kRecv, 2, b.data(), 16}})));
  w.hub->Kill(2);
  Status s0 = w0->Wait(Deadline::After(kTimeout));
  EXPECT_THAT(s0, StatusIs(StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(s0.failed_peers(), ElementsAre(2));
  // A planned shrink needs a healthy communicator.
  EXPECT_THAT(comms[0]->Shrink(std::vector<int>{2}, ShrinkMode::kPlanned, 2, Deadline::AfterMs(50))
                  .status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("kFailure")));
  std::vector<std::unique_ptr<Communicator>> shrunk(4);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(4, [&](int r) -> Status {
    if (r == 2) return Status::Ok();
    MORPH_ASSIGN_OR_RETURN(shrunk[static_cast<size_t>(r)],
                           comms[static_cast<size_t>(r)]->Shrink(
                               std::vector<int>{2}, ShrinkMode::kFailure, 2,
                               Deadline::After(kTimeout)));
    return Status::Ok();
  })));
  EXPECT_EQ(shrunk[3]->rank(), 2);
  EXPECT_EQ(shrunk[3]->size(), 3);
  EXPECT_EQ(shrunk[0]->generation(), 2);
  EXPECT_THAT(comms[0]->Start(Exchange({})).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("released")));
  MORPH_ASSERT_OK(FirstError(RunRankThreads(2, [&](int r) -> Status {
    if (r == 0) return shrunk[0]->Run(Exchange({{P2POp::Kind::kSend, 2, a.data(), 16}}));
    return shrunk[3]->Run(Exchange({{P2POp::Kind::kRecv, 0, b.data(), 16}}));
  })));
  EXPECT_EQ(static_cast<char*>(b.data())[15], 7);
  // A shrink that leaves a dead rank in waits for it until the deadline.
  w.hub->Kill(1);
  auto stuck = shrunk[0]->Shrink(std::vector<int>{2}, ShrinkMode::kFailure, 3,
                                 Deadline::AfterMs(100));
  EXPECT_THAT(stuck.status(), StatusIs(StatusCode::kDeadlineExceeded, ::testing::_));
}

TEST(FakeNcclTest, DeviceCapacity) {
  auto d = std::make_shared<FakeDevice>(100);
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer a, d->Allocate(60));
  EXPECT_THAT(d->Allocate(60).status(), StatusIs(StatusCode::kResourceExhausted, ::testing::_));
  a = Buffer();
  MORPH_EXPECT_OK(d->Allocate(60).status());
  EXPECT_EQ(d->peak_bytes(), 60);
  EXPECT_EQ(d->held_bytes(), 0);
}

}  // namespace
}  // namespace morph
