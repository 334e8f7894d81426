// Multi-process tests of the runtime (issue 9): real worker processes (elastic_worker) launched
// by the Launcher that morphrun is, on CPU over Gloo, through grow, shrink, tp/pp changes,
// several changes at once, spares and SIGTERM. Each worker checks at every step that its shards
// are bitwise the expected slice and its scalar state is right (it exits 3 otherwise); this test
// checks that every worker exited 0, the job completed, and that the samples consumed, step by
// step, are the fixed global order: every step once, each epoch a permutation of the dataset.
//
// Bounded: every job has a deadline, the Launcher's destructor kills what is left.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>

#include "runtime/tests/elastic_checks.h"
#include "runtime/tests/elastic_job.h"
#include "runtime/tools/launcher.h"

namespace morph {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kSteps = 60;

using testing::Config;
using testing::Job;
using testing::Logs;
using testing::Resize;
using testing::StartJob;
using testing::StepOf;
using testing::WaitForGeneration;
using testing::WaitForStep;

// Waits for the job's end; then every worker exited 0, the last generation has `world` ranks
// with `config` and `changes` reconfigurations completed after the first generation.
void Finish(Job& job, const ParallelConfig& config, int64_t changes,
            int64_t steps = kSteps) {
  StatusOr<int> code = job.launcher->Wait(Deadline::AfterMs(120000));
  CoordinatorSnapshot last = job.launcher->coordinator().Snapshot();
  EXPECT_EQ(last.config.dp, config.dp) << Logs(job);
  EXPECT_EQ(last.config.tp, config.tp);
  EXPECT_EQ(last.config.pp, config.pp);
  EXPECT_EQ(static_cast<int>(last.members.size()), config.world());
  EXPECT_EQ(last.reconfigurations, changes);
  if (changes > 0) {
    // The workers' phases reach the coordinator (Applied) and its status.
    ASSERT_TRUE(last.last_reconfiguration.has_value());
    EXPECT_GT(last.last_reconfiguration->stall_ms, 0);
    EXPECT_GT(last.last_reconfiguration->communicators_ms, 0);
    EXPECT_GE(last.last_reconfiguration->stall_ms, last.last_reconfiguration->transfer_ms);
  }
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << Logs(job);
  EXPECT_EQ(*code, 0) << Logs(job);
  for (const ChildInfo& c : job.launcher->children()) {
    EXPECT_FALSE(c.running);
    EXPECT_EQ(c.exit_code, 0) << "worker " << c.index << "\n" << Logs(job);
  }
  testing::CheckSamples(job.dir, steps);
  job.launcher.reset();
  fs::remove_all(job.dir);
}


TEST(ElasticTest, Grow2To4To8) {
  Job job = StartJob("grow", 2, {{1, Config(1, 1, 1)}, {2, Config(2, 1, 1)}, {4, Config(4, 1, 1)},
                                 {8, Config(8, 1, 1)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 3));
  ASSERT_TRUE(Resize(job, std::nullopt, 2).ok());
  ASSERT_TRUE(WaitForGeneration(job, 2)) << Logs(job);
  ASSERT_TRUE(WaitForStep(job, 10));
  ASSERT_TRUE(Resize(job, 8).ok());
  Finish(job, Config(8, 1, 1), 2);
}

TEST(ElasticTest, Shrink8To3) {
  Job job = StartJob("shrink", 8, {{3, Config(3, 1, 1)}, {8, Config(4, 2, 1)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 4));
  ASSERT_TRUE(Resize(job, 3).ok());
  Finish(job, Config(3, 1, 1), 1);
}

TEST(ElasticTest, Tp2To1To2) {
  Job job = StartJob("tp", 4, {{2, Config(2, 1, 1)}, {4, Config(2, 2, 1)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 3));
  ASSERT_TRUE(Resize(job, 2).ok());
  ASSERT_TRUE(WaitForGeneration(job, 2)) << Logs(job);
  ASSERT_TRUE(WaitForStep(job, 10));
  ASSERT_TRUE(Resize(job, 4).ok());
  Finish(job, Config(2, 2, 1), 2);
}

TEST(ElasticTest, Pp2To1AndDpWithPpAtOnce) {
  Job job = StartJob("pp", 4, {{2, Config(2, 1, 1)}, {3, Config(3, 1, 1)}, {4, Config(2, 1, 2)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 3));
  ASSERT_TRUE(Resize(job, 3).ok());  // dp 2 -> 3 and pp 2 -> 1 at once
  ASSERT_TRUE(WaitForGeneration(job, 2)) << Logs(job);
  ASSERT_TRUE(WaitForStep(job, 10));
  ASSERT_TRUE(Resize(job, 2).ok());
  Finish(job, Config(2, 1, 1), 2);
}

TEST(ElasticTest, TwoResizesInQuickSuccession) {
  Job job = StartJob("quick", 4, {{2, Config(2, 1, 1)}, {3, Config(3, 1, 1)}, {4, Config(4, 1, 1)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 3));
  ASSERT_TRUE(Resize(job, 3).ok());
  // The second arrives while the first is in progress: refused (409) or folded in, never lost.
  Status second = Resize(job, 2);
  if (!second.ok()) {
    EXPECT_EQ(second.code(), StatusCode::kFailedPrecondition) << second;
    ASSERT_TRUE(WaitForGeneration(job, 2)) << Logs(job);
    ASSERT_TRUE(Resize(job, 2).ok());
  }
  Finish(job, Config(2, 1, 1), 2);
}

TEST(ElasticTest, SigtermIsAPreemptionNotice) {
  Job job = StartJob("sigterm", 4, {{3, Config(3, 1, 1)}, {4, Config(4, 1, 1)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 4));
  std::vector<ChildInfo> kids = job.launcher->children();
  ASSERT_EQ(kids.size(), 4u);
  auto sent = std::chrono::steady_clock::now();
  kill(kids[1].pid, SIGTERM);
  // It leaves (exit 0) within its deadline, after its state moved to the others.
  bool gone = false;
  while (std::chrono::steady_clock::now() - sent < std::chrono::seconds(30)) {
    for (const ChildInfo& c : job.launcher->children()) {
      if (c.pid == kids[1].pid && !c.running) gone = true;
    }
    if (gone) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    (void)job.launcher->Wait(Deadline::AfterMs(1));  // reaps
  }
  EXPECT_TRUE(gone) << Logs(job);
  Finish(job, Config(3, 1, 1), 1);
}

TEST(ElasticTest, StandbySpareTakesARank) {
  // 5 workers for a world of 4: one spare. Removing a ranked worker gives its rank to the spare.
  Job job = StartJob("spare", 5, {{4, Config(2, 2, 1)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 3));
  CoordinatorSnapshot s = job.launcher->coordinator().Snapshot();
  ASSERT_EQ(s.members.size(), 4u);
  ASSERT_EQ(s.standby.size(), 1u);
  WorkerId spare = s.standby[0];
  WorkerId removed = s.members[1].worker;
  ASSERT_TRUE(Resize(job, std::nullopt, 0, {removed}).ok());
  ASSERT_TRUE(WaitForGeneration(job, 2)) << Logs(job);
  s = job.launcher->coordinator().Snapshot();
  bool spare_ranked = false, removed_ranked = false;
  for (const auto& m : s.members) {
    spare_ranked |= m.worker == spare;
    removed_ranked |= m.worker == removed;
  }
  EXPECT_TRUE(spare_ranked);
  EXPECT_FALSE(removed_ranked);
  Finish(job, Config(2, 2, 1), 1);
}

TEST(ElasticTest, JoinerArrivesWhileAShrinkIsPending) {
  Job job = StartJob("joinshrink", 4, {{2, Config(2, 1, 1)}, {3, Config(3, 1, 1)},
                                       {4, Config(4, 1, 1)}});
  ASSERT_TRUE(job.launcher);
  ASSERT_TRUE(WaitForStep(job, 3));
  ASSERT_TRUE(Resize(job, 2).ok());
  EXPECT_EQ(job.launcher->Spawn(1), 1);  // registers while the shrink is being applied
  ASSERT_TRUE(WaitForGeneration(job, 2)) << Logs(job);
  // The scheduler asked for 2: the joiner is not needed and is released (exits 0).
  Finish(job, Config(2, 1, 1), 1);
}

}  // namespace
}  // namespace morph
