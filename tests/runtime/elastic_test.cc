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
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
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

// Options::host_arena (MORPH_HOST_ARENA): the shards morph allocates come from the runtime's
// ShmArena, so a same-host reshard (dp 4 -> 2 here) reads every old shard by memcpy from a
// mapping of the sender's segment; without it, by process_vm_readv (messages packed into the
// executor's staging, the small tensors' here, go by process_vm_readv either way). The bytes each worker
// received by each path (Reconfiguration::shm_mapped_bytes / shm_vm_readv_bytes), summed over
// the new generation's workers; the data is checked at every step by the workers.
struct ShmPaths {
  int64_t received = 0, mapped = 0, vm_readv = 0;
};

ShmPaths ShrinkAndCountShmPaths(const std::string& arena) {
  ShmPaths paths;
  testing::Job job = testing::StartJob(
      "arena" + arena, 4, {{2, testing::Config(2, 1, 1)}, {4, testing::Config(4, 1, 1)}},
      testing::JobOptions{.steps = 40,
                          .step_ms = 20,
                          .extra_args = {"--variant", "big"},
                          // Messages of 64 KiB: the big tensor's pieces travel alone.
                          .env = {{"MORPH_HOST_ARENA", arena},
                                  {"MORPH_RESHARD_CHUNK_BYTES", "65536"}}});
  EXPECT_TRUE(job.launcher);
  if (!job.launcher) return paths;
  EXPECT_TRUE(testing::WaitForStep(job, 3)) << testing::Logs(job);
  EXPECT_TRUE(testing::Resize(job, 2).ok());
  EXPECT_TRUE(testing::WaitForGeneration(job, 2)) << testing::Logs(job);
  StatusOr<int> code = job.launcher->Wait(Deadline::AfterMs(120000));
  EXPECT_TRUE(code.ok() && *code == 0) << testing::Logs(job);
  const std::string logs = testing::Logs(job);
  size_t at = 0;
  int lines = 0;
  while ((at = logs.find(": gen 2 rank ", at)) != std::string::npos) {
    const size_t end = logs.find('\n', at);
    const std::string line = logs.substr(at, end - at);
    at = end;
    long received = 0, mapped = 0, vm_readv = 0;
    const size_t r = line.find("received ");
    if (r == std::string::npos ||
        std::sscanf(line.c_str() + r, "received %ld shm_mapped %ld shm_vm_readv %ld", &received,
                    &mapped, &vm_readv) != 3) {
      ADD_FAILURE() << "unparsed: " << line;
      continue;
    }
    ++lines;
    paths.received += received;
    paths.mapped += mapped;
    paths.vm_readv += vm_readv;
  }
  EXPECT_EQ(lines, 2) << logs;
  fs::remove_all(job.dir);
  return paths;
}

TEST(ElasticTest, SameHostReshardReadsTheHostArena) {
  const ShmPaths on = ShrinkAndCountShmPaths("1");
  // dp 4 -> 2: each new rank receives the big tensor's 256 KiB range of one leaver.
  constexpr int64_t kBigMoved = int64_t{2} << 18;
  EXPECT_GT(on.received, kBigMoved);
  EXPECT_GE(on.mapped, kBigMoved);
  const ShmPaths off = ShrinkAndCountShmPaths("0");
  EXPECT_EQ(off.received, on.received);
  EXPECT_EQ(off.mapped, 0);
  // The same messages: what the arena path took, process_vm_readv took without it.
  EXPECT_EQ(on.mapped + on.vm_readv, off.vm_readv);
}

}  // namespace
}  // namespace morph
