#include "tests/runtime/scenarios_testutil.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "base/testing.h"
#include "tests/runtime/elastic_testutil.h"

namespace morph::testing {

namespace {

bool WaitFor(ElasticJob& job, int64_t timeout_ms,
             const std::function<bool(const CoordinatorSnapshot&)>& pred) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    if (pred(job.Observe())) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

bool WaitForStep(ElasticJob& job, int64_t step, int64_t timeout_ms) {
  return WaitFor(job, timeout_ms, [&](const CoordinatorSnapshot& s) { return s.step >= step; });
}

bool WaitForGeneration(ElasticJob& job, int64_t generation, int64_t timeout_ms) {
  return WaitFor(job, timeout_ms, [&](const CoordinatorSnapshot& s) {
    return s.generation >= generation && !s.pending_generation;
  });
}

void ExpectJobEnd(ElasticJob& job, const ParallelConfig& config, int64_t changes, int64_t steps) {
  ElasticJob::End end = job.WaitForEnd(120000);
  EXPECT_TRUE(end.ended) << end.why << "\n" << job.Logs();
  const CoordinatorSnapshot& last = end.last;
  EXPECT_EQ(last.config.dp, config.dp) << job.Logs();
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
  ASSERT_FALSE(end.exits.empty());
  for (const auto& [who, code] : end.exits) EXPECT_EQ(code, 0) << who << "\n" << job.Logs();
  CheckSamples(job.dir(), steps);
}

namespace scenarios {

void Grow2To4To8(const JobStarter& start) {
  auto job = start(
      "grow", 2,
      {{1, Config(1, 1, 1)}, {2, Config(2, 1, 1)}, {4, Config(4, 1, 1)}, {8, Config(8, 1, 1)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 3)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(std::nullopt, 2));
  ASSERT_TRUE(WaitForGeneration(*job, 2)) << job->Logs();
  ASSERT_TRUE(WaitForStep(*job, 10)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(8));
  ExpectJobEnd(*job, Config(8, 1, 1), 2);
}

void Shrink8To3(const JobStarter& start) {
  auto job = start("shrink", 8, {{3, Config(3, 1, 1)}, {8, Config(4, 2, 1)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 4)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(3));
  ExpectJobEnd(*job, Config(3, 1, 1), 1);
}

void Tp2To1To2(const JobStarter& start) {
  auto job = start("tp", 4, {{2, Config(2, 1, 1)}, {4, Config(2, 2, 1)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 3)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(2));
  ASSERT_TRUE(WaitForGeneration(*job, 2)) << job->Logs();
  ASSERT_TRUE(WaitForStep(*job, 10)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(4));
  ExpectJobEnd(*job, Config(2, 2, 1), 2);
}

void Pp2To1AndDpWithPpAtOnce(const JobStarter& start) {
  auto job = start("pp", 4, {{2, Config(2, 1, 1)}, {3, Config(3, 1, 1)}, {4, Config(2, 1, 2)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 3)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(3));  // dp 2 -> 3 and pp 2 -> 1 at once
  ASSERT_TRUE(WaitForGeneration(*job, 2)) << job->Logs();
  ASSERT_TRUE(WaitForStep(*job, 10)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(2));
  ExpectJobEnd(*job, Config(2, 1, 1), 2);
}

void TwoResizesInQuickSuccession(const JobStarter& start) {
  auto job = start("quick", 4, {{2, Config(2, 1, 1)}, {3, Config(3, 1, 1)}, {4, Config(4, 1, 1)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 3)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(3));
  // The second arrives while the first is in progress: refused (409) or folded in, never lost.
  Status second = job->Resize(2);
  if (!second.ok()) {
    EXPECT_EQ(second.code(), StatusCode::kFailedPrecondition) << second;
    ASSERT_TRUE(WaitForGeneration(*job, 2)) << job->Logs();
    MORPH_ASSERT_OK(job->Resize(2));
  }
  ExpectJobEnd(*job, Config(2, 1, 1), 2);
}

void SigtermIsAPreemptionNotice(const JobStarter& start) {
  auto job = start("sigterm", 4, {{3, Config(3, 1, 1)}, {4, Config(4, 1, 1)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 4)) << job->Logs();
  // It leaves (exit 0) within its deadline, after its state moved to the others.
  EXPECT_EQ(job->Preempt(1, 30000), 0) << job->Logs();
  ExpectJobEnd(*job, Config(3, 1, 1), 1);
}

void StandbySpareTakesARank(const JobStarter& start) {
  // 5 workers for a world of 4: one spare. Removing a ranked worker gives its rank to the spare.
  auto job = start("spare", 5, {{4, Config(2, 2, 1)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 3)) << job->Logs();
  CoordinatorSnapshot s = job->Observe();
  ASSERT_EQ(s.members.size(), 4u);
  ASSERT_EQ(s.standby.size(), 1u);
  WorkerId spare = s.standby[0];
  WorkerId removed = s.members[1].worker;
  MORPH_ASSERT_OK(job->Resize(std::nullopt, 0, {removed}));
  ASSERT_TRUE(WaitForGeneration(*job, 2)) << job->Logs();
  s = job->Observe();
  bool spare_ranked = false, removed_ranked = false;
  for (const auto& m : s.members) {
    spare_ranked |= m.worker == spare;
    removed_ranked |= m.worker == removed;
  }
  EXPECT_TRUE(spare_ranked);
  EXPECT_FALSE(removed_ranked);
  ExpectJobEnd(*job, Config(2, 2, 1), 1);
}

void JoinerArrivesWhileAShrinkIsPending(const JobStarter& start) {
  auto job =
      start("joinshrink", 4, {{2, Config(2, 1, 1)}, {3, Config(3, 1, 1)}, {4, Config(4, 1, 1)}});
  ASSERT_TRUE(job);
  ASSERT_TRUE(WaitForStep(*job, 3)) << job->Logs();
  MORPH_ASSERT_OK(job->Resize(2));
  EXPECT_EQ(job->AddWorkers(1), 1);  // registers while the shrink is being applied
  ASSERT_TRUE(WaitForGeneration(*job, 2)) << job->Logs();
  // The scheduler asked for 2: the joiner is not needed and is released (exits 0).
  ExpectJobEnd(*job, Config(2, 1, 1), 1);
}

}  // namespace scenarios
}  // namespace morph::testing
