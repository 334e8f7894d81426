// Multi-process tests of the runtime (issue 9): real worker processes (elastic_worker) launched
// by the Launcher that morphrun is, on CPU over Gloo, through grow, shrink, tp/pp changes,
// several changes at once, spares and SIGTERM (the scenarios of elastic_scenarios.h, which
// elastic_mpi_test runs under mpirun). Each worker checks at every step that its shards are
// bitwise the expected slice and its scalar state is right (it exits 3 otherwise); the scenarios
// check that every worker exited 0, the job completed, and that the samples consumed, step by
// step, are the fixed global order: every step once, each epoch a permutation of the dataset.
//
// Bounded: every job has a deadline, the Launcher's destructor kills what is left.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>

#include "tests/runtime/elastic_testutil.h"
#include "tests/runtime/elastic_job_testutil.h"
#include "tests/runtime/scenarios_testutil.h"
#include "runtime/tools/launcher.h"

namespace morph {
namespace {

namespace fs = std::filesystem;
namespace scenarios = testing::scenarios;

// A job under the Launcher: its coordinator is in this process and starts the joiners a grow
// asks for itself.
class LauncherJob : public testing::ElasticJob {
 public:
  explicit LauncherJob(testing::Job job) : job_(std::move(job)) {}
  ~LauncherJob() override {
    job_.launcher.reset();
    if (std::getenv("MORPH_TEST_KEEP") == nullptr) fs::remove_all(job_.dir);
  }

  CoordinatorSnapshot Observe() override { return job_.launcher->coordinator().Snapshot(); }
  Status Resize(std::optional<int> world, int add, std::vector<WorkerId> remove) override {
    return testing::Resize(job_, world, add, std::move(remove));
  }
  int AddWorkers(int count) override { return job_.launcher->Spawn(count); }
  std::optional<int> Preempt(int index, int64_t timeout_ms) override {
    std::vector<ChildInfo> kids = job_.launcher->children();
    if (index < 0 || index >= static_cast<int>(kids.size())) return std::nullopt;
    const pid_t pid = kids[index].pid;
    kill(pid, SIGTERM);
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      (void)job_.launcher->Wait(Deadline::AfterMs(1));  // reaps
      for (const ChildInfo& c : job_.launcher->children()) {
        if (c.pid == pid && !c.running) return c.exit_code;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::nullopt;
  }
  End WaitForEnd(int64_t timeout_ms) override {
    End end;
    StatusOr<int> code = job_.launcher->Wait(Deadline::AfterMs(timeout_ms));
    end.ended = code.ok();
    if (!code.ok()) end.why = code.status().ToString();
    end.last = job_.launcher->coordinator().Snapshot();
    end.exits.emplace_back("the launcher", code.ok() ? *code : -1);
    for (const ChildInfo& c : job_.launcher->children()) {
      end.exits.emplace_back(
          "worker " + std::to_string(c.index) + " (pid " + std::to_string(c.pid) + ")",
          c.running ? -1 : c.exit_code);
    }
    return end;
  }
  const fs::path& dir() const override { return job_.dir; }
  std::string Logs() const override { return testing::Logs(job_); }

 private:
  testing::Job job_;
};

std::unique_ptr<testing::ElasticJob> StartLauncherJob(const std::string& name, int workers,
                                                      std::map<int, ParallelConfig> configs) {
  testing::Job job = testing::StartJob(name, workers, std::move(configs), scenarios::kSteps);
  if (!job.launcher) return nullptr;
  return std::make_unique<LauncherJob>(std::move(job));
}

TEST(ElasticTest, Grow2To4To8) { scenarios::Grow2To4To8(StartLauncherJob); }
TEST(ElasticTest, Shrink8To3) { scenarios::Shrink8To3(StartLauncherJob); }
TEST(ElasticTest, Tp2To1To2) { scenarios::Tp2To1To2(StartLauncherJob); }
TEST(ElasticTest, Pp2To1AndDpWithPpAtOnce) { scenarios::Pp2To1AndDpWithPpAtOnce(StartLauncherJob); }
TEST(ElasticTest, TwoResizesInQuickSuccession) {
  scenarios::TwoResizesInQuickSuccession(StartLauncherJob);
}
TEST(ElasticTest, SigtermIsAPreemptionNotice) {
  scenarios::SigtermIsAPreemptionNotice(StartLauncherJob);
}
TEST(ElasticTest, StandbySpareTakesARank) { scenarios::StandbySpareTakesARank(StartLauncherJob); }
TEST(ElasticTest, JoinerArrivesWhileAShrinkIsPending) {
  scenarios::JoinerArrivesWhileAShrinkIsPending(StartLauncherJob);
}

}  // namespace
}  // namespace morph
