// A job of elastic_worker processes under the Launcher (what morphrun is), for the multi-process
// runtime tests (elastic_test.cc, failure_test.cc): start it with a config policy, watch its
// coordinator's step and generation, resize it. Inline helpers; the test's thread.
#ifndef MORPH_TESTS_RUNTIME_ELASTIC_JOB_TESTUTIL_H_
#define MORPH_TESTS_RUNTIME_ELASTIC_JOB_TESTUTIL_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/runtime/elastic_testutil.h"
#include "runtime/tools/launcher.h"

namespace morph::testing {

namespace fs = std::filesystem;

inline std::string WorkerPath() { return std::string(MORPH_ELASTIC_WORKER); }

struct Job {
  fs::path dir;
  std::unique_ptr<Launcher> launcher;
};

struct JobOptions {
  int64_t steps = 60;
  int64_t step_ms = 50;
  std::vector<std::string> extra_args;  // e.g. {"--variant", "hybrid2"}
  std::map<std::string, std::string> env;  // added to the workers' environment
  int64_t heartbeat_timeout_ms = 20000;
};

// Starts `workers` workers; `configs` maps a world size to the config to use (the policy: the
// largest listed world that fits).
inline Job StartJob(const std::string& name, int workers, std::map<int, ParallelConfig> configs,
                    const JobOptions& jo) {
  Job job;
  job.dir = fs::temp_directory_path() / ("morph-elastic-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(job.dir);
  fs::create_directories(job.dir);
  LauncherOptions o;
  o.workers = workers;
  o.argv = {WorkerPath(), "--steps", std::to_string(jo.steps), "--out", job.dir.string(),
            "--step-ms", std::to_string(jo.step_ms)};
  o.argv.insert(o.argv.end(), jo.extra_args.begin(), jo.extra_args.end());
  o.log_dir = job.dir.string();
  o.kill_grace_ms = 3000;
  o.env = {{"MORPH_HEARTBEAT_MS", "50"}, {"MORPH_CHANGE_TIMEOUT_MS", "60000"},
           {"MORPH_START_TIMEOUT_MS", "60000"}, {"MORPH_RESHARD_SHM", "1"}};
  for (const auto& [k, v] : jo.env) o.env[k] = v;
  o.coordinator.serve_http = false;
  o.coordinator.heartbeat_timeout_ms = jo.heartbeat_timeout_ms;
  o.coordinator.policy = [configs](int n, const ParallelConfig*,
                                   const ModelConstraints&) -> std::optional<ParallelConfig> {
    auto it = configs.upper_bound(n);
    if (it == configs.begin()) return std::nullopt;
    return std::prev(it)->second;
  };
  StatusOr<std::unique_ptr<Launcher>> l = Launcher::Start(std::move(o));
  EXPECT_TRUE(l.ok()) << l.status();
  if (l.ok()) job.launcher = std::move(*l);
  return job;
}

inline Job StartJob(const std::string& name, int workers, std::map<int, ParallelConfig> configs,
                    int64_t steps = 60, int64_t step_ms = 50) {
  return StartJob(name, workers, std::move(configs), JobOptions{.steps = steps, .step_ms = step_ms});
}

// The latest step any worker reported.
inline int64_t StepOf(Job& job) { return job.launcher->coordinator().Snapshot().step; }

inline bool WaitForStep(Job& job, int64_t step, int64_t timeout_ms = 60000) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    if (StepOf(job) >= step) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

inline bool WaitForGeneration(Job& job, int64_t generation, int64_t timeout_ms = 60000) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    CoordinatorSnapshot s = job.launcher->coordinator().Snapshot();
    if (s.generation >= generation && !s.pending_generation) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

inline std::string Logs(const Job& job) { return WorkerLogs(job.dir); }

inline Status Resize(Job& job, std::optional<int> world, int add = 0,
                     std::vector<WorkerId> remove = {}) {
  ResizeRequest r;
  r.world_size = world;
  r.add = add;
  r.remove = std::move(remove);
  r.reason = "test";
  return job.launcher->coordinator().Resize(r, Deadline::AfterMs(10000));
}

}  // namespace morph::testing

#endif  // MORPH_TESTS_RUNTIME_ELASTIC_JOB_TESTUTIL_H_
