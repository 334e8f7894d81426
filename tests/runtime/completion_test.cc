// A job that ends while a change is on its way (the audit's hang): elastic_worker processes
// under the Launcher (what morphrun is) train a fixed number of steps, and during the last one
// a shrink, a grow or a preemption notice arrives. Whatever the change had reached — planned,
// prepared, or committed for a step past the end — the job completes: the Launcher's Wait
// returns 0 (morphrun exits 0), every worker, a joiner started in that window included, exits
// 0, and the coordinator is not left "committed" with a resize in progress.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "tests/runtime/elastic_job_testutil.h"

namespace morph::testing {
namespace {

constexpr int64_t kSteps = 6;

Job StartLastStepJob(const std::string& name) {
  // Slow steps, so that the request lands inside the last one.
  return StartJob(name, 2, {{1, ParallelConfig{.dp = 1}}, {2, ParallelConfig{.dp = 2}},
                            {3, ParallelConfig{.dp = 3}}},
                  kSteps, /*step_ms=*/600);
}

// Waits for the job to end; returns the Launcher's code (-1: it did not end in time).
int EndOf(Job& job) {
  StatusOr<int> code = job.launcher->Wait(Deadline::AfterMs(60000));
  if (!code.ok()) {
    ADD_FAILURE() << code.status() << "\n" << Logs(job);
    return -1;
  }
  return *code;
}

void ExpectCompleted(Job& job, int code) {
  EXPECT_EQ(code, 0) << Logs(job);
  // The published snapshot trails the decider by a few milliseconds.
  CoordinatorSnapshot s;
  for (int i = 0; i < 100; ++i) {
    s = job.launcher->coordinator().Snapshot();
    if (s.phase == "complete") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.phase, "complete");
  EXPECT_FALSE(s.resize_in_progress);
  EXPECT_FALSE(s.pending_generation);
  for (const ChildInfo& c : job.launcher->children()) {
    EXPECT_FALSE(c.running) << "worker " << c.index;
    EXPECT_EQ(c.exit_code, 0) << "worker " << c.index << "\n" << Logs(job);
  }
}

TEST(CompletionTest, AShrinkDuringTheLastStepLetsTheJobComplete) {
  Job job = StartLastStepJob("shrink-last");
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, kSteps - 1)) << Logs(job);
  ASSERT_TRUE(Resize(job, 1).ok());
  ExpectCompleted(job, EndOf(job));
  fs::remove_all(job.dir);
}

TEST(CompletionTest, AGrowDuringTheLastStepLetsTheJobAndItsJoinerComplete) {
  Job job = StartLastStepJob("grow-last");
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, kSteps - 1)) << Logs(job);
  ASSERT_TRUE(Resize(job, std::nullopt, /*add=*/1).ok());
  ExpectCompleted(job, EndOf(job));
  EXPECT_EQ(job.launcher->children().size(), 3u);  // the joiner was started, and ended well
  fs::remove_all(job.dir);
}

TEST(CompletionTest, APreemptionNoticeDuringTheLastStepLetsTheJobComplete) {
  Job job = StartLastStepJob("sigterm-last");
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, kSteps - 1)) << Logs(job);
  std::vector<ChildInfo> kids = job.launcher->children();
  ASSERT_EQ(kids.size(), 2u);
  ASSERT_EQ(kill(kids[1].pid, SIGTERM), 0);
  ExpectCompleted(job, EndOf(job));
  fs::remove_all(job.dir);
}

}  // namespace
}  // namespace morph::testing
