// Jobs of elastic_worker processes launched by mpirun (Open MPI 4.1), for the tests that run the
// runtime as a user runs it under mpirun (elastic_mpi_test.cc, launch_test.cc): the mpirun
// command line, its ranks' pids, and StartMpirunJob, the ElasticJob (scenarios_testutil.h) of
// `mpirun --enable-recovery -np N`.
//
// In such a job rank 0 hosts the coordinator (with the scenario's config policy: elastic_worker
// --configs) and writes its address and token to MORPH_COORDINATOR_FILE; its log names the
// scheduler API's port. The test does what a scheduler does: it resizes through POST /v1/resize
// with the job token and starts the workers a grow needs itself, outside mpirun (whose world is
// fixed at -np), with MORPH_COORDINATOR and MORPH_TOKEN. With --enable-recovery mpirun exits 0
// whatever its ranks exit with (docs/operations.md), so each rank runs under a shell that
// records the worker's pid and exit status in the job's directory (rank-R.pid, rank-R.exit).
//
// The test's thread.
#ifndef MORPH_TESTS_RUNTIME_MPIRUN_TESTUTIL_H_
#define MORPH_TESTS_RUNTIME_MPIRUN_TESTUTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "morph/parallel_config.h"
#include "tests/runtime/scenarios_testutil.h"

namespace morph::testing {

// mpirun --allow-run-as-root --oversubscribe [--enable-recovery] -np N, -x K=V for each
// non-empty value of `env`, then `program`.
std::vector<std::string> MpirunArgv(const std::string& mpirun, int np, bool enable_recovery,
                                    const std::vector<std::string>& program,
                                    const std::map<std::string, std::string>& env);

// The ranks mpirun started, by OMPI_COMM_WORLD_RANK (its children, from /proc).
std::map<int, pid_t> MpiRanks(pid_t mpirun);

// "" when `mpirun --enable-recovery` runs a one-rank job here, else why not (for GTEST_SKIP).
std::string MpirunWithRecoveryUnusable(const std::string& mpirun);

struct MpirunJobOptions {
  std::string mpirun;  // the binary
  std::string worker;  // elastic_worker
  std::string name;    // unique per test: names the job's directory
  int np = 1;
  // The config policy rank 0's coordinator uses (JobStarter's); empty: the planner's default.
  std::map<int, ParallelConfig> configs;
  int64_t steps = 60;
  int64_t step_ms = 50;
};

// Starts the job and waits (up to 60 s) for its coordinator file and scheduler API port; null
// after a gtest failure saying why not.
std::unique_ptr<ElasticJob> StartMpirunJob(const MpirunJobOptions& options);

}  // namespace morph::testing

#endif  // MORPH_TESTS_RUNTIME_MPIRUN_TESTUTIL_H_
