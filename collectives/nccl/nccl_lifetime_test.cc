// NCCL communicator lifetimes, abort from another thread, caller streams, teardown time and
// shrink (label gpu). Skips, saying why, where CUDA finds no device. Single-rank cases run on
// one GPU; two-rank cases need two GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1
// (NCCL 2.28 refuses two ranks on one GPU: "Duplicate GPU detected").
//
// Measurements and skip reasons are printed as "gpu-note: ..." lines (tests/gpu/run.sh shows
// them). A stream is held back by a host function that waits for a flag (StreamGate): this makes
// "an operation that cannot finish yet" deterministic on one GPU, without timing.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "base/testing.h"
#include "collectives/groups.h"
#include "collectives/nccl/nccl_communicator.h"
#include "collectives/testing/rank_harness.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
constexpr std::chrono::seconds kTimeout(60);

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Holds back every later operation on `stream` until Open() (or `auto_open` passes, so that
// a bug cannot hang the test).
class StreamGate {
 public:
  StreamGate(cudaStream_t stream, std::chrono::milliseconds auto_open) {
    opener_ = std::thread([this, auto_open] {
      auto until = Clock::now() + auto_open;
      while (!open_.load() && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      open_.store(true);
    });
    cudaLaunchHostFunc(stream, &StreamGate::Block, this);
  }
  ~StreamGate() {
    Open();
    opener_.join();
  }
  void Open() { open_.store(true); }

 private:
  static void Block(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    while (!gate->open_.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  std::atomic<bool> open_{false};
  std::thread opener_;
};

class NcclLifetimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no GPU: " << why;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&buf_, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(buf_, 0, kBytes), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&a_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (a_ != nullptr) cudaStreamSynchronize(a_), cudaStreamDestroy(a_);
    if (b_ != nullptr) cudaStreamSynchronize(b_), cudaStreamDestroy(b_);
    if (buf_ != nullptr) cudaFree(buf_);
  }
  std::unique_ptr<NcclCommunicator> Solo(std::string_view name) {
    MemoryStore store(table_, 0);
    auto comm = NcclCommunicator::Create(store, name, 0, 1, 0, Deadline::After(kTimeout));
    comm.status().CheckOk("single-rank NCCL communicator");
    return *std::move(comm);
  }
  CollectiveOp Allreduce(cudaStream_t stream) {
    CollectiveOp op =
        CollectiveOp::Allreduce(buf_, kBytes / 4, DType::kF32, ReduceOp::kSum, kTimeout);
    op.stream = stream;
    return op;
  }

  static constexpr size_t kBytes = 64 << 20;
  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
  void* buf_ = nullptr;
  cudaStream_t a_ = nullptr, b_ = nullptr;
};

TEST_F(NcclLifetimeTest, WorkThatOutlivesItsCommunicatorIsFailedPrecondition) {
  auto comm = Solo("outlive");
  MORPH_ASSERT_OK_AND_ASSIGN(auto work, comm->Start(Allreduce(nullptr)));
  comm.reset();  // releases the NCCL communicator; the Work keeps the shared state only
  EXPECT_TRUE(work->Done());
  EXPECT_THAT(work->Wait(Deadline::After(kTimeout)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("communicator destroyed")));
  // The same answer again; nothing touched the released communicator.
  EXPECT_THAT(work->Wait(Deadline::After(kTimeout)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("communicator destroyed")));
}

TEST_F(NcclLifetimeTest, CollectivesRunOnTheCallersStream) {
  auto comm = Solo("streams");
  StreamGate gate(a_, std::chrono::milliseconds(10000));
  // On stream b the allreduce does not wait for a's held-back work: it overlaps it.
  MORPH_ASSERT_OK_AND_ASSIGN(auto on_b, comm->Start(Allreduce(b_)));
  MORPH_EXPECT_OK(on_b->Wait(Deadline::After(std::chrono::seconds(5))));
  // On stream a it runs after a's work (e.g. the backward pass that produced the gradients).
  MORPH_ASSERT_OK_AND_ASSIGN(auto on_a, comm->Start(Allreduce(a_)));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(on_a->Done());
  gate.Open();
  MORPH_EXPECT_OK(on_a->Wait(Deadline::After(kTimeout)));
  EXPECT_TRUE(on_a->Done());
  // The communicator's own stream when none is given.
  MORPH_EXPECT_OK(comm->Run(Allreduce(nullptr)));
}

TEST_F(NcclLifetimeTest, TeardownOfAHealthyCommunicatorIsQuick) {
  auto comm = Solo("teardown-healthy");
  MORPH_ASSERT_OK(comm->Run(Allreduce(nullptr)));
  const Clock::time_point t0 = Clock::now();
  comm.reset();
  const double s = Seconds(Clock::now() - t0);
  std::fprintf(stderr, "gpu-note: teardown of a healthy communicator: %.3f s\n", s);
  EXPECT_LT(s, 1.0);
}

TEST_F(NcclLifetimeTest, ShrinkArgumentsAndStates) {
  auto comm = Solo("shrink-args");
  const std::vector<int> none, self = {0}, out = {1};
  EXPECT_THAT(comm->Shrink(none, ShrinkMode::kPlanned, 1, Deadline::After(kTimeout)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no rank to exclude")));
  EXPECT_THAT(comm->Shrink(self, ShrinkMode::kPlanned, 1, Deadline::After(kTimeout)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("this rank is excluded")));
  EXPECT_THAT(comm->Shrink(out, ShrinkMode::kPlanned, 1, Deadline::After(kTimeout)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("excluded rank 1 out of range")));
  EXPECT_FALSE(comm->broken());
  comm->Abort();
  EXPECT_THAT(comm->Shrink(out, ShrinkMode::kPlanned, 1, Deadline::After(kTimeout)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("out of range")));  // checked first
  const std::vector<int> also_none;
  EXPECT_THAT(comm->Shrink(also_none, ShrinkMode::kFailure, 1, Deadline::After(kTimeout)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no rank to exclude")));
}

// The two cases below leave an NCCL operation queued behind a held-back stream while the
// communicator is aborted; they run last so that whatever that operation does afterwards
// cannot disturb the cases above.
TEST_F(NcclLifetimeTest, AbortFromAnotherThreadReachesAnOperationInProgress) {
  auto comm = Solo("abort");
  StreamGate gate(a_, std::chrono::milliseconds(3000));
  MORPH_ASSERT_OK_AND_ASSIGN(auto work, comm->Start(Allreduce(a_)));
  EXPECT_FALSE(work->Done());  // held back behind the gate
  Clock::time_point aborted_at;
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    aborted_at = Clock::now();
    comm->Abort();
  });
  Status s = work->Wait(Deadline::After(kTimeout));
  const Clock::time_point returned_at = Clock::now();
  aborter.join();
  EXPECT_THAT(s, StatusIs(StatusCode::kAborted, HasSubstr("Abort() called")));
  ASSERT_NE(s.collective_failure(), nullptr);
  EXPECT_EQ(s.collective_failure()->kind, CollectiveFailure::Kind::kAborted);
  // Wait returned only once no NCCL kernel could touch the buffer any more.
  EXPECT_TRUE(work->Done());
  std::fprintf(stderr,
               "gpu-note: abort during a held-back allreduce: Wait returned %.3f s after Abort()\n",
               Seconds(returned_at - aborted_at));
  EXPECT_LT(returned_at - aborted_at, std::chrono::seconds(5));
  EXPECT_TRUE(comm->broken());
  EXPECT_THAT(comm->Barrier(kTimeout), StatusIs(StatusCode::kAborted, HasSubstr("Abort()")));
  gate.Open();
  comm.reset();
}

TEST_F(NcclLifetimeTest, TeardownWithAnOperationThatCannotFlushDoesNotWaitForIt) {
  // Finalize gets its grace, then ncclCommAbort.
  auto comm = Solo("teardown-stuck");
  StreamGate gate(a_, std::chrono::milliseconds(4000));
  MORPH_ASSERT_OK_AND_ASSIGN(auto work, comm->Start(Allreduce(a_)));
  const Clock::time_point t0 = Clock::now();
  comm.reset();
  const double s = Seconds(Clock::now() - t0);
  std::fprintf(stderr, "gpu-note: teardown with a held-back operation: %.3f s\n", s);
  EXPECT_LT(s, 3.5);  // before the gate's own 4 s: teardown did not wait for the stream
  EXPECT_TRUE(work->Done());
  gate.Open();
}

// Two ranks as threads: on two GPUs, or on one with NCCL >= 2.30 and
// NCCL_MULTI_RANK_GPU_ENABLE=1. Returns the device of each rank, or why it cannot run.
bool TwoRankDevices(int devices[2], std::string* why) {
  int n = 0;
  cudaGetDeviceCount(&n);
  int version = 0;
  ncclGetVersion(&version);
  if (n >= 2) {
    devices[0] = 0;
    devices[1] = 1;
    return true;
  }
  if (version >= 23000) {
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
    devices[0] = devices[1] = 0;
    return true;
  }
  *why = "two ranks need two GPUs with NCCL " + std::to_string(version) +
         " (NCCL < 2.30 refuses two ranks on one GPU, \"Duplicate GPU detected\"; from 2.30 "
         "NCCL_MULTI_RANK_GPU_ENABLE=1 allows it)";
  return false;
}

class NcclShrinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no GPU: " << why;
    if (!TwoRankDevices(devices_, &why)) {
      std::fprintf(stderr, "gpu-note: skipped: %s\n", why.c_str());
      GTEST_SKIP() << why;
    }
  }
  int devices_[2] = {0, 0};
  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
};

// Rank 1 leaves cleanly; rank 0 shrinks (NCCL_SHRINK_DEFAULT) and keeps working.
TEST_F(NcclShrinkTest, PlannedShrinkThroughGroupBuilder) {
  std::vector<std::unique_ptr<GroupSet>> sets(2);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(2, [&](int rank) -> Status {
    GroupBuilder builder(NcclFactory(devices_[rank]));
    builder.SplitFromWorld();
    MemoryStore store(table_, 0);
    MORPH_ASSIGN_OR_RETURN(sets[rank], builder.Build(store, ParallelConfig{.dp = 2}, rank, 2,
                                                     Deadline::After(kTimeout)));
    return sets[rank]->world().Barrier(kTimeout);
  })));
  sets[1].reset();
  MORPH_ASSERT_OK(MemoryStore(table_, 1).AdvanceGeneration(1, Deadline::AfterMs(100)));
  MemoryStore store1(table_, 1);
  GroupBuilder builder(NcclFactory(devices_[0]));
  builder.SplitFromWorld();
  const std::vector<int> leaving = {1};
  const Clock::time_point t0 = Clock::now();
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto next, builder.Rebuild(std::move(sets[0]), leaving, ShrinkMode::kPlanned, store1,
                                 ParallelConfig{}, Deadline::After(kTimeout)));
  std::fprintf(stderr, "gpu-note: planned shrink 2 -> 1 with subgroups: %.3f s\n",
               Seconds(Clock::now() - t0));
  EXPECT_TRUE(next->shrunk());
  EXPECT_EQ(next->world().size(), 1);
  EXPECT_EQ(next->world().generation(), 1);
  MORPH_EXPECT_OK(next->dp().Barrier(kTimeout));
}

// Rank 1 stops answering; rank 0's allreduce times out, then it shrinks with
// NCCL_SHRINK_ABORT (the communicator was only revoked, not released) and keeps working.
TEST_F(NcclShrinkTest, FailureShrinkAfterATimeout) {
  std::vector<std::unique_ptr<NcclCommunicator>> comms(2);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(2, [&](int rank) -> Status {
    MemoryStore store(table_, 0);
    MORPH_ASSIGN_OR_RETURN(comms[rank],
                           NcclCommunicator::Create(store, "world", rank, 2, devices_[rank],
                                                    Deadline::After(kTimeout)));
    return comms[rank]->Barrier(kTimeout);
  })));
  cudaSetDevice(devices_[0]);
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 4096), cudaSuccess);
  // Rank 1 never joins: rank 0 fails by deadline.
  Status s = comms[0]->Allreduce(buf, 1024, DType::kF32, ReduceOp::kSum,
                                 std::chrono::milliseconds(1000));
  EXPECT_THAT(s, StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("did not finish in time")));
  ASSERT_NE(s.collective_failure(), nullptr);
  EXPECT_EQ(s.collective_failure()->kind, CollectiveFailure::Kind::kTimeout);
  const std::vector<int> dead = {1};
  EXPECT_THAT(comms[0]->Shrink(dead, ShrinkMode::kPlanned, 1, Deadline::After(kTimeout)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("use ShrinkMode::kFailure")));
  const Clock::time_point t0 = Clock::now();
  auto smaller = comms[0]->Shrink(dead, ShrinkMode::kFailure, 1, Deadline::After(kTimeout));
  std::fprintf(stderr, "gpu-note: failure shrink 2 -> 1: %.3f s: %s\n", Seconds(Clock::now() - t0),
               smaller.status().ToString().c_str());
  MORPH_ASSERT_OK(smaller.status());
  EXPECT_EQ((*smaller)->size(), 1);
  EXPECT_EQ((*smaller)->rank(), 0);
  MORPH_EXPECT_OK((*smaller)->Allreduce(buf, 1024, DType::kF32, ReduceOp::kSum, kTimeout));
  // The parent is released: its later calls say so.
  EXPECT_THAT(comms[0]->Barrier(kTimeout),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("did not finish in time")));
  comms[1]->Abort();
  comms.clear();
  cudaFree(buf);
}

}  // namespace
}  // namespace morph
