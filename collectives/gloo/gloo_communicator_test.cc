// Gloo backend with ranks as threads of this process (label unit).
#include "collectives/gloo/gloo_communicator.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "base/testing.h"
#include "collectives/testing/collective_checks.h"
#include "collectives/gloo/gloo_errors.h"
#include "collectives/testing/rank_harness.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using std::chrono::milliseconds;
using ::testing::HasSubstr;

constexpr milliseconds kTimeout(20000);

std::shared_ptr<GlooDevice> Device() {
  auto d = GlooDevice::Create(GlooOptions{});
  d.status().CheckOk("gloo device");
  return *d;
}

// Builds `world` communicators named `name` over `table` in `generation`, one per thread.
std::vector<std::unique_ptr<GlooCommunicator>> Build(const std::shared_ptr<KvTable>& table,
                                                     int64_t generation, int world,
                                                     const std::string& name,
                                                     const std::shared_ptr<GlooDevice>& dev) {
  std::vector<std::unique_ptr<GlooCommunicator>> comms(world);
  Status s = FirstError(RunRankThreads(world, [&](int rank) -> Status {
    MemoryStore store(table, generation);
    MORPH_ASSIGN_OR_RETURN(comms[rank], GlooCommunicator::Create(store, name, rank, world, dev,
                                                                 Deadline::AfterMs(20000)));
    return Status::Ok();
  }));
  s.CheckOk("building communicators");
  return comms;
}

class GlooWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooWorldTest, EveryCollectiveMatchesTheReference) {
  const int world = GetParam();
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, world, "world", Device());
  MORPH_EXPECT_OK(FirstError(RunRankThreads(
      world, [&](int rank) { return CheckAllCollectives(*comms[rank], kTimeout); })));
  MORPH_EXPECT_OK(FirstError(RunRankThreads(world, [&](int rank) {
    // On one host every size reduces in rank order (shared memory).
    return CheckReductionOrder(
        *comms[rank], comms[rank]->shared_memory() ? SIZE_MAX : GlooCommunicator::kOneShotMaxBytes,
        kTimeout);
  })));
  EXPECT_EQ(comms[0]->capabilities().backend, "gloo");
  EXPECT_FALSE(comms[0]->broken());
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooWorldTest, ::testing::Range(1, 9));

TEST(GlooCommunicatorTest, BadArgumentsAreRejectedBeforeAnythingIsSent) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 2, "args", Device());
  GlooCommunicator& c = *comms[0];
  int32_t x = 0;
  EXPECT_THAT(c.Broadcast(&x, 1, DType::kI32, 2, kTimeout),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("broadcast root 2 out of range")));
  EXPECT_THAT(c.Allreduce(nullptr, 4, DType::kF32, ReduceOp::kSum, kTimeout),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("null buffer for 4 elements")));
  EXPECT_THAT(c.SendRecv({{P2POp::Kind::kSend, 0, &x, 4}}, kTimeout),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("send #0: peer 0 is this rank")));
  EXPECT_THAT(c.SendRecv({{P2POp::Kind::kRecv, 5, &x, 4}}, kTimeout),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("recv #0: peer 5 out of range")));
  EXPECT_THAT(c.Barrier(milliseconds(0)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("timeout must be positive")));
  CollectiveOp on_stream = CollectiveOp::Barrier(kTimeout);
  on_stream.stream = &x;  // any non-null stream
  EXPECT_THAT(c.Run(on_stream),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("gloo backend runs on host memory")));
  const int leave[] = {1};
  EXPECT_FALSE(c.capabilities().shrink);
  EXPECT_THAT(c.Shrink(leave, ShrinkMode::kPlanned, 1, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("gloo cannot shrink")));
  EXPECT_FALSE(c.broken());
  MemoryStore store(table, 0);
  EXPECT_THAT(GlooCommunicator::Create(store, "x", 2, 2, nullptr, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 2 of size 2 out of range")));
  EXPECT_THAT(GlooCommunicator::Create(store, "", 0, 1, nullptr, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("name is empty")));
}

TEST(GlooCommunicatorTest, AbortFromAnotherThreadEndsABlockedOperationWithinASecond) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 2, "abort", Device());
  // Rank 1 never joins the barrier: rank 0 blocks until aborted.
  std::chrono::steady_clock::time_point aborted_at;
  std::thread aborter([&] {
    std::this_thread::sleep_for(milliseconds(200));
    aborted_at = std::chrono::steady_clock::now();
    comms[0]->Abort();
  });
  Status s = comms[0]->Barrier(milliseconds(30000));
  auto returned_at = std::chrono::steady_clock::now();
  aborter.join();
  EXPECT_THAT(s, StatusIs(StatusCode::kAborted, HasSubstr("Abort() called")));
  ASSERT_NE(s.collective_failure(), nullptr) << s;
  EXPECT_EQ(s.collective_failure()->kind, CollectiveFailure::Kind::kAborted);
  EXPECT_TRUE(s.failed_peers().empty());
  EXPECT_LT(returned_at - aborted_at, std::chrono::seconds(1));
  EXPECT_TRUE(comms[0]->broken());
  // Every later operation fails the same way; aborting again is harmless.
  comms[0]->Abort();
  EXPECT_THAT(comms[0]->Barrier(kTimeout), StatusIs(StatusCode::kAborted, HasSubstr("aborted")));
  // The peer sees its connection closed rather than hanging. Through shared memory its first
  // barrier may still succeed (rank 0 had arrived before it aborted); the next one fails.
  Status peer = comms[1]->Barrier(milliseconds(5000));
  if (peer.ok()) peer = comms[1]->Barrier(milliseconds(5000));
  EXPECT_TRUE(peer.code() == StatusCode::kUnavailable || peer.code() == StatusCode::kAborted)
      << peer;
  EXPECT_THAT(peer.message(), HasSubstr("rank 1/2"));
}

TEST(GlooCommunicatorTest, MismatchedMessageSizesAreInternalNotACrash) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 2, "mismatch", Device());
  std::vector<Status> r = RunRankThreads(2, [&](int rank) {
    std::vector<uint8_t> buf(8, 1);
    P2POp op = rank == 0 ? P2POp{P2POp::Kind::kSend, 1, buf.data(), 8}
                         : P2POp{P2POp::Kind::kRecv, 0, buf.data(), 4};
    return comms[rank]->SendRecv({op}, milliseconds(5000));
  });
  EXPECT_THAT(r[1], StatusIs(StatusCode::kInternal,
                             HasSubstr("peer 0 sends 1 messages, this rank receives 1 (sizes "
                                       "differ)")));
  EXPECT_TRUE(comms[1]->broken());
  // Over TCP the sender fails in the same call; through shared memory its send was eager (its
  // bytes were in the ring before the receiver looked), and its next call fails.
  if (r[0].ok()) {
    EXPECT_TRUE(comms[0]->shared_memory());
    EXPECT_FALSE(comms[0]->Barrier(milliseconds(5000)).ok());
  }
}

TEST(GlooCommunicatorTest, LosingAnotherPeerFailsAWaitOnAHealthyPair) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 3, "sentinel", Device());
  // Rank 0 waits for rank 1, which is alive but silent; rank 2 goes away.
  std::thread closer([&] {
    std::this_thread::sleep_for(milliseconds(100));
    comms[2].reset();
  });
  uint8_t b = 0;
  auto start = std::chrono::steady_clock::now();
  Status s = comms[0]->SendRecv({{P2POp::Kind::kRecv, 1, &b, 1}}, milliseconds(10000));
  closer.join();
  EXPECT_THAT(s, StatusIs(StatusCode::kUnavailable, HasSubstr("a peer connection closed")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  // The typed field names the peer that went away, not the silent healthy one.
  ASSERT_NE(s.collective_failure(), nullptr) << s;
  EXPECT_EQ(s.collective_failure()->kind, CollectiveFailure::Kind::kPeerClosed);
  EXPECT_EQ(std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()),
            std::vector<int>{2});
  // Later calls return the same error with the same payload.
  Status again = comms[0]->Barrier(kTimeout);
  EXPECT_EQ(std::vector<int>(again.failed_peers().begin(), again.failed_peers().end()),
            std::vector<int>{2});
}

TEST(GlooCommunicatorTest, TimeoutBreaksTheCommunicator) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 2, "timeout", Device());
  float v = 1;
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(comms[0]->Allreduce(&v, 1, DType::kF32, ReduceOp::kSum, milliseconds(200)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("allreduce")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_TRUE(comms[0]->broken());
  Status later = comms[0]->Barrier(kTimeout);
  EXPECT_THAT(later, StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("allreduce")));
  ASSERT_NE(later.collective_failure(), nullptr) << later;
  EXPECT_EQ(later.collective_failure()->kind, CollectiveFailure::Kind::kTimeout);
  EXPECT_TRUE(later.failed_peers().empty());
}

// Gloo reports timeouts in several wordings ("Timed out waiting", "Connect timeout", "Read
// timeout", "Wait timeout for key(s)", "Application timeout caused pair closure"): one
// classifier decides, for rendezvous and operations alike.
TEST(GlooErrorsTest, OneClassifierForGlooTexts) {
  using K = GlooErrorKind;
  EXPECT_EQ(ClassifyGlooError("[enforce fail at pair.cc:589] Timed out waiting 200ms for recv "
                              "operation to complete"),
            K::kTimeout);
  EXPECT_EQ(ClassifyGlooError("Connect timeout [127.0.0.1]:4242"), K::kTimeout);
  EXPECT_EQ(ClassifyGlooError("Read timeout [127.0.0.1]:4242"), K::kTimeout);
  EXPECT_EQ(ClassifyGlooError("Wait timeout for key(s): [gloo/world/1]"), K::kTimeout);
  EXPECT_EQ(ClassifyGlooError("Application timeout caused pair closure"), K::kTimeout);
  EXPECT_EQ(ClassifyGlooError("Connection closed by peer [127.0.0.1]:4242"), K::kPeerClosed);
  EXPECT_EQ(ClassifyGlooError("Read error [127.0.0.1]:4242: Connection reset by peer"),
            K::kPeerClosed);
  EXPECT_EQ(ClassifyGlooError("Socket unexpectedly closed [127.0.0.1]:4242"), K::kPeerClosed);
  // What this rank raised itself on its own pairs (Abort, or its own failure) is not a peer's.
  EXPECT_EQ(ClassifyGlooError("morph: communicator aborted"), K::kLocal);
  EXPECT_EQ(ClassifyGlooError("morph: peer rank 1 failed: allreduce: Timed out waiting"),
            K::kLocal);
  EXPECT_EQ(ClassifyGlooError("something else"), K::kOther);
}

TEST(GlooCommunicatorTest, AsyncWorkOverlapsAndCompletesInOrder) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 3, "async", Device());
  MORPH_EXPECT_OK(FirstError(RunRankThreads(3, [&](int rank) -> Status {
    std::vector<int64_t> a(100, rank), b(100, rank * 10);
    MORPH_ASSIGN_OR_RETURN(
        auto w1, comms[rank]->Start(CollectiveOp::Allreduce(a.data(), a.size(), DType::kI64,
                                                            ReduceOp::kSum, kTimeout)));
    MORPH_ASSIGN_OR_RETURN(
        auto w2, comms[rank]->Start(CollectiveOp::Allreduce(b.data(), b.size(), DType::kI64,
                                                            ReduceOp::kMax, kTimeout)));
    MORPH_RETURN_IF_ERROR(w2->Wait(Deadline::After(kTimeout)));
    if (!w1->Done()) return InternalError("second op finished before the first");
    MORPH_RETURN_IF_ERROR(w1->Wait(Deadline::After(kTimeout)));
    if (a[99] != 3 || b[0] != 20) return InternalError("wrong async results");
    return Status::Ok();
  })));
}

TEST(GlooCommunicatorTest, SendRecvAmongSomeRanksThenACollective) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 3, "partial", Device());
  MORPH_EXPECT_OK(FirstError(RunRankThreads(3, [&](int rank) -> Status {
    std::vector<uint8_t> b(1 << 20, static_cast<uint8_t>(rank));
    for (int i = 0; i < 3; ++i) {
      Status s;
      if (rank == 0)
        s = comms[0]->SendRecv({{P2POp::Kind::kSend, 1, b.data(), b.size()}}, kTimeout);
      if (rank == 1)
        s = comms[1]->SendRecv({{P2POp::Kind::kRecv, 0, b.data(), b.size()}}, kTimeout);
      MORPH_RETURN_IF_ERROR(s);
    }
    std::vector<float> v(1 << 20, 1.0f);
    MORPH_RETURN_IF_ERROR(comms[rank]->Allreduce(v.data(), v.size(), DType::kF32, ReduceOp::kSum,
                                                 milliseconds(10000)));
    if (v.back() != 3.0f) return InternalError("wrong sum");
    return Status::Ok();
  })));
}

TEST(GlooCommunicatorTest, RendezvousFailures) {
  auto table = std::make_shared<KvTable>();
  MemoryStore g1(table, 1);
  // The peer never comes: the deadline names what was missing.
  EXPECT_THAT(GlooCommunicator::Create(g1, "lonely", 0, 2, Device(), Deadline::AfterMs(200)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("'gloo/lonely/1'")));
  // A stale generation cannot rendezvous.
  MORPH_ASSERT_OK(MemoryStore(table, 2).AdvanceGeneration(2, Deadline::AfterMs(100)));
  EXPECT_THAT(GlooCommunicator::Create(g1, "stale", 0, 2, Device(), Deadline::AfterMs(2000)),
              StatusIs(StatusCode::kAborted, HasSubstr("generation 1 is older")));
}

// A peer's store that fails every call after the peer published its own Gloo address (key
// `dies_after`): the peer's rendezvous throws there and its pairs close, as a process killed
// between publishing and connecting leaves them.
class DyingStore : public Store {
 public:
  DyingStore(std::shared_ptr<KvTable> table, int64_t generation, std::string dies_after)
      : inner_(std::move(table), generation), dies_after_(std::move(dies_after)) {}
  int64_t generation() const override { return inner_.generation(); }
  Status Set(std::string_view key, std::string_view value, Deadline d) override {
    if (dead_) return UnavailableError("dead");
    Status s = inner_.Set(key, value, d);
    if (key == dies_after_) dead_ = true;
    return s;
  }
  StatusOr<std::string> Get(std::string_view key, Deadline d) override {
    if (dead_) return UnavailableError("dead");
    return inner_.Get(key, d);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline d) override {
    if (dead_) return UnavailableError("dead");
    return inner_.Add(key, delta, d);
  }
  StatusOr<std::string> CompareAndSet(std::string_view key,
                                      const std::optional<std::string>& expected,
                                      std::string_view desired, Deadline d) override {
    if (dead_) return UnavailableError("dead");
    return inner_.CompareAndSet(key, expected, desired, d);
  }
  Status Wait(std::span<const std::string> keys, Deadline d) override {
    if (dead_) return UnavailableError("dead");
    return inner_.Wait(keys, d);
  }
  Status AdvanceGeneration(int64_t generation, Deadline d) override {
    return inner_.AdvanceGeneration(generation, d);
  }

 private:
  MemoryStore inner_;
  std::string dies_after_;
  bool dead_ = false;
};

// Gloo waits up to 5x its context timeout for a pair's first connection. A rank whose peer
// published its address and then died (the listening side of that pair) must still give up
// at its own deadline, not five deadlines later (an abandoned change's communicators held a
// worker's exit for 75 s at a 15 s change timeout).
TEST(GlooCommunicatorTest, APeerThatDiesBeforeConnectingEndsTheRendezvousAtTheDeadline) {
  constexpr int kWorld = 4;
  constexpr int kDeadlineMs = 1500;
  for (int dead = 0; dead < kWorld; ++dead) {
    auto table = std::make_shared<KvTable>();
    auto dev = Device();
    std::vector<double> seconds(kWorld, 0);
    std::vector<Status> result(kWorld);
    RunRankThreads(kWorld, [&](int rank) -> Status {
      auto t0 = std::chrono::steady_clock::now();
      if (rank == dead) {
        DyingStore store(table, 0, "gloo/w/" + std::to_string(rank));
        result[rank] = GlooCommunicator::Create(store, "w", rank, kWorld, dev,
                                                Deadline::AfterMs(kDeadlineMs))
                           .status();
      } else {
        MemoryStore store(table, 0);
        result[rank] = GlooCommunicator::Create(store, "w", rank, kWorld, dev,
                                                Deadline::AfterMs(kDeadlineMs))
                           .status();
      }
      seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return Status::Ok();
    });
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_FALSE(result[r].ok()) << "dead " << dead << " rank " << r;
      EXPECT_LT(seconds[r], kDeadlineMs / 1000.0 + 1.0)
          << "dead " << dead << " rank " << r << ": " << result[r];
    }
  }
}

// /proc counts of this process.
int CountFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}
long StatusField(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

TEST(GlooCommunicatorTest, TwoHundredRebuildsKeepFdsThreadsAndMemoryFlat) {
  constexpr int kWorld = 3, kGenerations = 200, kWarmup = 20;
  auto table = std::make_shared<KvTable>();
  auto dev = Device();
  int fds0 = 0;
  long threads0 = 0, rss0 = 0;
  for (int g = 0; g < kGenerations; ++g) {
    if (g == kWarmup) {
      fds0 = CountFds();
      threads0 = StatusField("Threads");
      rss0 = StatusField("VmRSS");
    }
    MORPH_ASSERT_OK(MemoryStore(table, g).AdvanceGeneration(g, Deadline::AfterMs(100)));
    auto comms = Build(table, g, kWorld, "world", dev);
    ASSERT_EQ(FirstError(RunRankThreads(kWorld,
                                        [&](int rank) {
                                          float v = static_cast<float>(rank + g);
                                          return comms[rank]->Allreduce(&v, 1, DType::kF32,
                                                                        ReduceOp::kSum, kTimeout);
                                        })),
              Status::Ok());
  }
  EXPECT_EQ(CountFds(), fds0);
  EXPECT_EQ(StatusField("Threads"), threads0);
#if defined(__SANITIZE_ADDRESS__)
  // ASan's quarantine holds freed memory back, so RSS grows by design; LeakSanitizer checks
  // for leaks at exit instead.
  (void)rss0;
#else
  EXPECT_LT(StatusField("VmRSS") - rss0, 8 * 1024)
      << "kB of RSS growth over " << kGenerations - kWarmup << " generations";
#endif
  EXPECT_LE(table->size(), 3u * kWorld) << "old generations' keys were not dropped";
}

}  // namespace
}  // namespace morph

namespace morph {
namespace {

// The tasks (threads) of this process.
std::vector<pid_t> Tasks() {
  std::vector<pid_t> tids;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return tids;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') tids.push_back(static_cast<pid_t>(std::atoi(e->d_name)));
  }
  closedir(d);
  return tids;
}

int CpuCount(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(tid, sizeof(set), &set) != 0) return -1;
  return CPU_COUNT(&set);
}

// mpirun binds a rank to one core; Gloo's threads (started by the device and the
// communicator) must not inherit that binding, or every message waits for the core behind
// the training thread. The caller's own binding stays. Failed before: they inherited it.
TEST(GlooThreadsTest, GlooThreadsDoNotInheritTheCallersCpuBinding) {
  cpu_set_t process;
  CPU_ZERO(&process);
  ASSERT_EQ(sched_getaffinity(0, sizeof(process), &process), 0);
  const int allowed = CPU_COUNT(&process);
  if (allowed < 2) GTEST_SKIP() << "this process may use one CPU only";
  int first = 0;
  while (!CPU_ISSET(first, &process)) ++first;
  for (bool unbind : {true, false}) {
    std::thread caller([&] {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(first, &one);
      ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(one), &one), 0);
      std::vector<pid_t> before = Tasks();
      MORPH_ASSERT_OK_AND_ASSIGN(auto device,
                                 GlooDevice::Create(GlooOptions{.unbind_threads = unbind}));
      auto table = std::make_shared<KvTable>();
      MemoryStore store(table, 0);
      MORPH_ASSERT_OK_AND_ASSIGN(
          auto comm, GlooCommunicator::Create(store, "solo", 0, 1, device, Deadline::AfterMs(5000)));
      int started = 0;
      for (pid_t tid : Tasks()) {
        if (std::find(before.begin(), before.end(), tid) != before.end()) continue;
        ++started;
        EXPECT_EQ(CpuCount(tid), unbind ? allowed : 1) << "thread " << tid << " unbind " << unbind;
      }
      EXPECT_GE(started, 2);  // the device's event thread and the communicator's op thread
      EXPECT_EQ(CpuCount(0), 1);  // the caller's binding is unchanged
      float x = 1;
      MORPH_EXPECT_OK(comm->Allreduce(&x, 1, DType::kF32, ReduceOp::kSum, kTimeout));
      EXPECT_EQ(CpuCount(0), 1);
    });
    caller.join();
  }
}

// A blocking call runs on the caller's thread; it leaves that thread's signal mask as it was.
TEST(GlooCommunicatorTest, BlockingCallsLeaveTheCallersSignalMask) {
  auto table = std::make_shared<KvTable>();
  auto comms = Build(table, 0, 2, "mask", Device());
  MORPH_EXPECT_OK(FirstError(RunRankThreads(2, [&](int rank) -> Status {
    sigset_t none, before, after;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, &before);
    std::vector<float> x(64, 1.0f);
    for (int i = 0; i < 20; ++i) {
      MORPH_RETURN_IF_ERROR(
          comms[rank]->Allreduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum, kTimeout));
    }
    pthread_sigmask(SIG_SETMASK, &before, &after);
    if (sigismember(&after, SIGPIPE)) return InternalError("SIGPIPE left blocked");
    return x[0] == static_cast<float>(1 << 20) ? Status::Ok() : InternalError("wrong sum");
  })));
}

}  // namespace
}  // namespace morph
