// Deterministic simulation of the change protocol: one Decider, a dozen AgentCores, a simulated
// network with random delays and late duplicates (per-connection FIFO, as TCP, plus stale
// copies delivered out of order), random joins, leave requests, resizes and deaths of workers
// that hold no rank, and training threads coupled by their collectives (a step completes only
// when every rank of its generation began it). After every event the invariants are checked:
//   - every step number is trained in one generation only, by every worker that trains it
//     (all workers switch at the same step boundary);
//   - each worker's steps are consecutive and a generation's first step is its start step;
//   - one change at a time; a generation never changes once committed; store generations rise;
// and at the end the job is live: stable, everybody in the last generation, training. Workers
// holding a rank die too: the survivors are aborted, report the step their state holds, and
// the recovery resumes every rank at one step (steps from it on are trained again).
// Half the schedules are a job of a fixed number of steps L: a ranked worker ends its loop at
// the boundary of step L (in the style of examples/gpt: BeginStep(L), then break; or, in the
// other style, right after step L-1 without calling BeginStep(L)), sends Done and exits at
// once or lingers until the job completes (a hosting rank 0), whatever change is being planned,
// prepared or committed meanwhile. Such a job must complete: every worker ends, none trains
// step L or later, and nothing is left waiting.
// Two schedules in five lose their coordinator up to three times (coordinator failover): the
// leader dies after persisting its decider's state (Decider::Save) and before carrying out some
// or all of that event's actions; what workers sent it since is lost; a successor restores the
// saved state (Load, Resume), every live worker reconnects (Rejoin) and sends again what it is
// owed an answer for (AgentCore::Outstanding); the same invariants hold, and a re-sent commit is
// the original one.
// MORPH_TEST_SEED=<n> runs one seed (printed on failure); MORPH_SIM_RUNS overrides the count.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "runtime/coordinator/decider_sim.h"

namespace morph {
namespace {

using decider_sim::Sim;

TEST(DeciderSimTest, SeededSchedulesKeepEveryInvariant) {
  int runs = 10000;
  uint64_t first = 1;
  if (const char* s = std::getenv("MORPH_TEST_SEED")) {
    first = std::strtoull(s, nullptr, 10);
    runs = 1;
  }
  if (const char* r = std::getenv("MORPH_SIM_RUNS")) runs = std::atoi(r);
  int64_t commits = 0, ended = 0, recoveries = 0, resumed = 0, complete = 0, mid_change = 0,
          successions = 0;
  for (int i = 0; i < runs; ++i) {
    uint64_t seed = first + i;
    Sim sim(seed);
    std::string err = sim.Run();
    ASSERT_EQ(err, "") << "seed " << seed << " (MORPH_TEST_SEED=" << seed << ")";
    commits += sim.commits();
    successions += sim.successions();
    recoveries += sim.recoveries();
    resumed += sim.resumed();
    ended += sim.ended() ? 1 : 0;
    complete += sim.complete() ? 1 : 0;
    mid_change += sim.done_during_change() ? 1 : 0;
  }
  // Jobs of a fixed length complete, and the end often meets a change in progress.
  EXPECT_GT(complete * 4, runs) << complete << " of " << runs << " runs completed";
  EXPECT_GT(mid_change * 50, runs) << mid_change << " runs ended during a change";
  // Few schedules end with every worker gone; most run to a live, quiescent job.
  EXPECT_LE(ended * 10, runs) << ended << " of " << runs << " runs ended";
  // The schedules exercise changes, not just the first generation.
  EXPECT_GT(commits, 3 * runs);
  // Deaths of ranked workers are recovered from, often.
  EXPECT_GT(recoveries, runs / 2) << recoveries << " recoveries in " << runs << " runs";
  // Coordinators die often (up to three times in two schedules of five).
  EXPECT_GT(successions * 5, runs) << successions << " successions in " << runs << " runs";
  // About a fifth of the schedules resume their first generation from a checkpoint.
  EXPECT_GT(resumed * 10, runs) << resumed << " resumed in " << runs << " runs";
}

}  // namespace
}  // namespace morph
