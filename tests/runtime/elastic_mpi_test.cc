// The multi-process scenarios of elastic_test (elastic_scenarios.h) launched by
// `mpirun --enable-recovery --allow-run-as-root --oversubscribe -np N` (issue 9, label mpi):
// rank 0 hosts the coordinator, with the scenario's config policy (elastic_worker --configs);
// the test acts as the scheduler, resizing through the scheduler API with the job token and
// starting the workers a grow needs outside mpirun, with MORPH_COORDINATOR and MORPH_TOKEN from
// MORPH_COORDINATOR_FILE (mpirun_job.h). The same checks: each worker checks its state bitwise
// at every step; every rank and joiner exits 0; the last status has the expected config, world
// and reconfigurations; the consumed samples are the fixed global order.
//
// All eight scenarios run here; what differs from the Launcher is who starts the workers:
// - the first generation is mpirun's -np (grow 2->4->8 starts with -np 2, shrink 8->3 with -np
//   8, the spare scenario with -np 5: one rank is the spare);
// - every worker beyond it is a joiner this test starts, as a scheduler would after its own
//   resize request (the Launcher starts them itself when the coordinator asks);
// - SIGTERM goes to rank 1's worker: rank 0 hosts the coordinator, and its death is the
//   coordinator's (launch_test's MpirunRankZeroKilledStopsEveryRank), not a preemption.
// A worker that the job lets go (a shrink, the removed rank, the joiner nobody needs) exits 0
// on its own; rank 0's stays until the job completes, since its coordinator does.
//
// Skipped, saying why, where mpirun is missing or has no --enable-recovery. Bounded: every wait
// has a timeout; each job's destructor stops mpirun and every worker pid, and removes its
// directory.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>

#include "tests/runtime/scenarios_testutil.h"
#include "tests/runtime/mpirun_testutil.h"

namespace morph {
namespace {

namespace scenarios = testing::scenarios;

class ElasticMpiTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef MORPH_MPIEXEC
    GTEST_SKIP() << "built without MPI (no mpirun found when configuring)";
#else
    static const std::string unusable = testing::MpirunWithRecoveryUnusable(MORPH_MPIEXEC);
    if (!unusable.empty()) GTEST_SKIP() << unusable;
#endif
  }

  static std::unique_ptr<testing::ElasticJob> Start(const std::string& name, int workers,
                                                    std::map<int, ParallelConfig> configs) {
#ifdef MORPH_MPIEXEC
    return testing::StartMpirunJob({.mpirun = MORPH_MPIEXEC,
                                    .worker = MORPH_ELASTIC_WORKER,
                                    .name = name,
                                    .np = workers,
                                    .configs = std::move(configs),
                                    .steps = scenarios::kSteps});
#else
    return nullptr;
#endif
  }
};

TEST_F(ElasticMpiTest, Grow2To4To8) { scenarios::Grow2To4To8(Start); }
TEST_F(ElasticMpiTest, Shrink8To3) { scenarios::Shrink8To3(Start); }
TEST_F(ElasticMpiTest, Tp2To1To2) { scenarios::Tp2To1To2(Start); }
TEST_F(ElasticMpiTest, Pp2To1AndDpWithPpAtOnce) { scenarios::Pp2To1AndDpWithPpAtOnce(Start); }
TEST_F(ElasticMpiTest, TwoResizesInQuickSuccession) {
  scenarios::TwoResizesInQuickSuccession(Start);
}
TEST_F(ElasticMpiTest, SigtermIsAPreemptionNotice) { scenarios::SigtermIsAPreemptionNotice(Start); }
TEST_F(ElasticMpiTest, StandbySpareTakesARank) { scenarios::StandbySpareTakesARank(Start); }
TEST_F(ElasticMpiTest, JoinerArrivesWhileAShrinkIsPending) {
  scenarios::JoinerArrivesWhileAShrinkIsPending(Start);
}

}  // namespace
}  // namespace morph
