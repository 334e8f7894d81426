// The multi-process elastic scenarios of issue 9 ("Tests"), written once against ElasticJob: a
// job of elastic_worker processes, whatever launched them — the Launcher that morphrun is
// (elastic_test.cc) or mpirun (elastic_mpi_test.cc). Grow 2->4->8, shrink 8->3, tp 2->1->2,
// pp 2->1 with dp at once, two resizes in quick succession, a SIGTERM preemption, a standby spare
// taking a rank, a joiner arriving while a shrink is pending. Each worker checks its state
// bitwise at every step (it exits 3 otherwise); ExpectJobEnd checks that every process exited 0,
// the final config and world, the number of reconfigurations, and that the samples consumed step
// by step are the fixed global order (CheckSamples).
//
//   TEST(ElasticTest, Grow2To4To8) { testing::scenarios::Grow2To4To8(StartLauncherJob); }
//
// gtest assertions; the test's thread. Every wait is bounded.
#ifndef MORPH_TESTS_RUNTIME_SCENARIOS_TESTUTIL_H_
#define MORPH_TESTS_RUNTIME_SCENARIOS_TESTUTIL_H_

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "morph/parallel_config.h"
#include "morph/status.h"
#include "runtime/coordinator/http_api.h"
#include "runtime/protocol/messages.h"

namespace morph::testing {

// A running job of elastic_worker processes as a scenario drives it. Its destructor stops
// whatever still runs and removes its directory (kept with MORPH_TEST_KEEP set).
class ElasticJob {
 public:
  virtual ~ElasticJob() = default;

  // The coordinator's view now (through the scheduler API where the coordinator is in another
  // process; generation 0 when it cannot be read).
  virtual CoordinatorSnapshot Observe() = 0;
  // A resize as a scheduler asks for it, then the workers it needs started, where starting them
  // is the scheduler's part. kFailedPrecondition when refused because one is in progress.
  virtual Status Resize(std::optional<int> world, int add = 0,
                        std::vector<WorkerId> remove = {}) = 0;
  // Starts `count` more workers that join the job, unasked; how many started.
  virtual int AddWorkers(int count) = 0;
  // SIGTERM (a preemption notice) to the `index`-th worker the job started with (never the one
  // that hosts the coordinator); its exit code, or nullopt if it still ran after `timeout_ms`.
  virtual std::optional<int> Preempt(int index, int64_t timeout_ms) = 0;

  struct End {
    bool ended = false;        // the launcher and every worker exited within the timeout
    std::string why;           // when not
    CoordinatorSnapshot last;  // the coordinator's last view
    // Every process of the job (the launcher, each worker), named, with its exit code (128 +
    // signal when killed; -1 when none is known).
    std::vector<std::pair<std::string, int>> exits;
  };
  // Waits up to `timeout_ms` for the end of the job.
  virtual End WaitForEnd(int64_t timeout_ms) = 0;

  virtual const std::filesystem::path& dir() const = 0;  // the workers' --out and logs
  virtual std::string Logs() const = 0;
};

// Starts a job of `workers` workers under the config policy `configs` (for N workers the config
// listed for the largest world <= N): the name makes its directory unique. Null on failure
// (after a gtest failure saying why).
using JobStarter = std::function<std::unique_ptr<ElasticJob>(
    const std::string& name, int workers, std::map<int, ParallelConfig> configs)>;

// Until some worker reported `step`; false after `timeout_ms`.
bool WaitForStep(ElasticJob& job, int64_t step, int64_t timeout_ms = 60000);
// Until the job runs generation `generation` or later with no change pending.
bool WaitForGeneration(ElasticJob& job, int64_t generation, int64_t timeout_ms = 60000);

// Waits for the job's end; then every process exited 0, the last generation has `config` (its
// world: the members) and `changes` reconfigurations completed after the first generation (with
// the phases the workers reported), and the samples of steps 0..steps-1 are the global order.
void ExpectJobEnd(ElasticJob& job, const ParallelConfig& config, int64_t changes,
                  int64_t steps = 60);

namespace scenarios {

// 60 steps of 50 ms each (elastic_worker --steps 60 --step-ms 50).
constexpr int64_t kSteps = 60;

void Grow2To4To8(const JobStarter& start);
void Shrink8To3(const JobStarter& start);
void Tp2To1To2(const JobStarter& start);
void Pp2To1AndDpWithPpAtOnce(const JobStarter& start);
void TwoResizesInQuickSuccession(const JobStarter& start);
void SigtermIsAPreemptionNotice(const JobStarter& start);
void StandbySpareTakesARank(const JobStarter& start);
void JoinerArrivesWhileAShrinkIsPending(const JobStarter& start);

}  // namespace scenarios
}  // namespace morph::testing

#endif  // MORPH_TESTS_RUNTIME_SCENARIOS_TESTUTIL_H_
