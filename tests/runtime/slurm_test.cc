// morph under a real Slurm 22.05 cluster (issue 13): scripts/slurm-local.sh's four emulated
// nodes, an sbatch job whose script runs `morphrun --slurm`, which starts each elastic_worker as
// its own job step, and the scheduler acting on the job as an operator would: a step signalled
// (graceful preemption), extra steps (grow), the node list cut (shrink: SIGKILL), a node set
// DOWN. elastic_worker checks its state bitwise at every step (exit 3 otherwise); this test
// checks exit codes, memberships and the consumed sample order (elastic_checks.h).
//
// Skipped, saying why, where the daemons cannot run (not root, packages missing, the cluster
// does not come up). Bounded: every wait polls with a timeout; TearDown cancels the job; the
// ctest fixture slurm_down stops the cluster even when a case failed.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "runtime/recovery/checkpoint_catalog.h"
#include "tests/runtime/elastic_testutil.h"

namespace morph {
namespace {

namespace fs = std::filesystem;
using testing::ReadFile;
using testing::Stable;

constexpr char kToken[] = "slurm-test-token";

struct Ran {
  int code = -1;  // the exit code, -1 when it did not end in time
  std::string out;
};

// Runs argv (a program found on PATH or a path) with extra environment, stdout+stderr captured.
Ran RunCommand(const std::vector<std::string>& argv, const fs::path& log,
               int64_t timeout_ms = 30000, const std::map<std::string, std::string>& env = {}) {
  std::vector<std::string> full = {"/usr/bin/env"};
  full.insert(full.end(), argv.begin(), argv.end());
  pid_t p = testing::SpawnProcess(full, env, log.string());
  Ran r;
  if (p <= 0) return r;
  std::optional<int> code = testing::WaitExit(p, timeout_ms);
  if (!code) testing::Stop(p);
  r.code = code.value_or(-1);
  r.out = ReadFile(log);
  return r;
}

class SlurmTest : public ::testing::Test {
 protected:
  // Brings the cluster up once (slurm-local.sh is idempotent); remembers why when it cannot.
  static void SetUpTestSuite() {
    skip_ = new std::string();
    fs::path log = fs::temp_directory_path() / ("morph-slurm-up-" + std::to_string(getpid()));
    Ran up = RunCommand({"bash", MORPH_SLURM_LOCAL, "up"}, log, 90000);
    fs::remove(log);
    if (up.code != 0) {
      *skip_ = "the private Slurm cluster cannot run here (slurm-local.sh up exited " +
               std::to_string(up.code) + "): " + up.out;
      return;
    }
    Ran where = RunCommand({"bash", MORPH_SLURM_LOCAL, "env"}, log, 10000);
    fs::remove(log);
    std::string env_file = where.out.substr(0, where.out.find('\n'));
    std::string env = ReadFile(env_file);
    const std::string key = "export SLURM_CONF=";
    size_t at = env.find(key);
    if (at == std::string::npos) {
      *skip_ = "slurm-local.sh up printed no env file: " + up.out;
      return;
    }
    std::string conf = env.substr(at + key.size());
    conf = conf.substr(0, conf.find('\n'));
    setenv("SLURM_CONF", conf.c_str(), 1);
  }

  void SetUp() override {
    if (!skip_->empty()) GTEST_SKIP() << *skip_;
    dir_ = fs::temp_directory_path() /
           ("morph-slurm-" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "-" +
            std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    api_ = testing::FreePort();
  }

  void TearDown() override {
    if (!skip_->empty()) return;
    if (!job_.empty() && !JobEnded()) {
      Slurm({"scancel", job_});
      WaitJobEnd(20000);
    }
    // A node this case set DOWN goes back in service for the next one (ReturnToService=2 has
    // usually done it already when its slurmd registered again: then RESUME is refused).
    if (!downed_.empty()) {
      Ran state = Slurm({"sinfo", "-h", "-N", "-n", downed_, "-o", "%T"});
      if (state.out.find("down") != std::string::npos ||
          state.out.find("drain") != std::string::npos) {
        Slurm({"scontrol", "update", "NodeName=" + downed_, "State=RESUME"});
      }
    }
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // A Slurm client command, output in <dir>/slurm-cmd.out.
  Ran Slurm(const std::vector<std::string>& argv, int64_t timeout_ms = 20000) {
    return RunCommand(argv, dir_ / "slurm-cmd.out", timeout_ms);
  }

  // sbatch on all four nodes, two task slots each (room for joiners), --no-kill (a failed node
  // does not end the job), the script running morphrun --slurm with elastic_worker.
  // `failures`: the workers' state survives a death (hybrid ZeRO in DP groups of 2, so every
  // piece has a copy; old shards kept during a switch), as in failure_test.cc.
  void Submit(int workers, int max_workers, int64_t steps, int64_t step_ms, bool failures = false) {
    std::ostringstream body;
    if (failures) body << "export MORPH_RESHARD_KEEP_OLD=1\n";
    body << MORPHRUN << " --slurm -n " << workers << " --max " << max_workers << " --api-port "
         << api_ << " --log-dir " << dir_.string() << " -- " << Worker(steps, step_ms)
         << (failures ? " --variant hybrid2" : "");
    SubmitScript(body.str());
  }
  std::string Worker(int64_t steps, int64_t step_ms) const {
    return std::string(MORPH_ELASTIC_WORKER) + " --steps " + std::to_string(steps) + " --out " +
           dir_.string() + " --step-ms " + std::to_string(step_ms);
  }
  // The batch script runs `command`, then writes its exit code to <dir>/morphrun.rc.
  // `sbatch_extra`: more sbatch options.
  void SubmitScript(const std::string& command, const std::vector<std::string>& sbatch_extra = {}) {
    const fs::path script = dir_ / "job.sh";
    {
      std::ofstream s(script);
      s << "#!/bin/bash\n" << command << "\necho $? > " << (dir_ / "morphrun.rc").string() << "\n";
    }
    std::map<std::string, std::string> env = {{"MORPH_TOKEN", kToken},
                                              {"MORPH_HEARTBEAT_MS", "50"},
                                              {"MORPH_CHANGE_TIMEOUT_MS", "60000"},
                                              {"MORPH_START_TIMEOUT_MS", "60000"},
                                              {"MORPH_COORDINATOR", ""},
                                              {"MORPH_TOKEN_FILE", ""},
                                              {"MORPH_COORDINATOR_FILE", ""}};
    std::vector<std::string> argv = {
        "sbatch",     "-N4", "--ntasks-per-node=2",         "--no-kill", "--time=3",   "-J",
        "morph-test", "-o",  (dir_ / "batch.out").string(), "--chdir",   dir_.string()};
    argv.insert(argv.end(), sbatch_extra.begin(), sbatch_extra.end());
    argv.push_back(script.string());
    Ran r = RunCommand(argv, dir_ / "sbatch.out", 20000, env);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string key = "Submitted batch job ";
    size_t at = r.out.find(key);
    ASSERT_NE(at, std::string::npos) << r.out;
    job_ = r.out.substr(at + key.size());
    job_ = job_.substr(0, job_.find_first_not_of("0123456789"));
    ASSERT_FALSE(job_.empty()) << r.out;
  }

  bool JobEnded() {
    Ran r = Slurm({"squeue", "-h", "-j", job_, "-o", "%T"});
    // squeue lists a finished job for a while (COMPLETED) or not at all (an error for -j).
    return r.code != 0 || r.out.empty() || r.out.find("COMPLET") == 0 ||
           r.out.find("CANCELLED") == 0 || r.out.find("FAILED") == 0;
  }
  bool WaitJobEnd(int64_t timeout_ms) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      if (JobEnded()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return JobEnded();
  }

  // The job's worker steps by launch index: "morph-<index>" -> (step id, node).
  struct StepInfo {
    std::string id, node;
  };
  std::map<int, StepInfo> Steps() {
    std::map<int, StepInfo> out;
    Ran r = Slurm({"squeue", "-h", "-s", "-j", job_, "-o", "%i %j %N"});
    std::istringstream lines(r.out);
    std::string id, name, node;
    while (lines >> id >> name >> node) {
      if (name.rfind("morph-", 0) == 0) out[std::stoi(name.substr(6))] = {id, node};
    }
    return out;
  }
  // Until `count` worker steps run.
  std::map<int, StepInfo> WaitSteps(size_t count, int64_t timeout_ms = 30000) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    std::map<int, StepInfo> s = Steps();
    while (s.size() < count && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      s = Steps();
    }
    return s;
  }

  // The job trains with `world` workers in generation >= g.
  // Fails at once when morphrun ended meanwhile (its exit code file appeared).
  // `standby`: workers beyond the configuration (the planner keeps dp a multiple of the hybrid
  // ZeRO group: 3 workers train as dp 2 with one spare).
  void WaitStable(int64_t generation, size_t world, int64_t min_step = 0, size_t standby = 0,
                  int64_t timeout_ms = 60000) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      ASSERT_FALSE(fs::exists(dir_ / "morphrun.rc"))
          << "morphrun exited " << ReadFile(dir_ / "morphrun.rc") << " before generation "
          << generation << " with " << world << " workers\n"
          << Logs();
      nlohmann::json s = testing::ApiStatus(api_);
      if (s.is_object() && Stable(s, generation, world) &&
          s.value("step", int64_t{0}) >= min_step && s.contains("standby") &&
          s["standby"].size() == standby) {
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    FAIL() << "no generation " << generation << " with " << world << " workers (+" << standby
           << " standby) in " << timeout_ms << " ms: " << testing::ApiStatus(api_).dump() << "\n"
           << Logs();
  }

  // The job ended and morphrun exited `code`; morphrun's "worker N ... exited with C" lines.
  std::map<int, int> Finish(int code) {
    EXPECT_TRUE(WaitJobEnd(90000)) << Logs();
    EXPECT_EQ(ReadFile(dir_ / "morphrun.rc"), std::to_string(code) + "\n") << Logs();
    std::map<int, int> exits;
    const std::string text = ReadFile(dir_ / "batch.out");
    const std::string tag = "morphrun: worker ";
    for (size_t at = text.find(tag); at != std::string::npos; at = text.find(tag, at + 1)) {
      size_t line_end = text.find('\n', at);
      std::string line = text.substr(at, line_end - at);
      size_t with = line.find(" exited with ");
      if (with == std::string::npos) continue;
      exits[std::stoi(line.substr(tag.size()))] = std::stoi(line.substr(with + 13));
    }
    return exits;
  }

  std::string Logs() const {
    return "---- batch.out\n" + ReadFile(dir_ / "batch.out") + testing::WorkerLogs(dir_);
  }

  static std::string* skip_;
  fs::path dir_;
  uint16_t api_ = 0;
  std::string job_;
  std::string downed_;  // a node set DOWN by the case

  // The failure cases' start: 4 workers, one step per node, hybrid ZeRO (every piece has a
  // surviving copy), stable in generation 1; `victim` gets the index of the worker on n4.
  void StartFourWithOneOnN4(int64_t steps, int& victim) {
    Submit(4, 4, steps, 50, /*failures=*/true);
    std::map<int, StepInfo> started = WaitSteps(4);
    ASSERT_EQ(started.size(), 4u) << Logs();
    WaitStable(1, 4, 3);
    ASSERT_FALSE(HasFatalFailure());
    for (const auto& [index, s] : started) {
      if (s.node == "n4") victim = index;
    }
    ASSERT_GE(victim, 0) << "no worker on n4 (one step per node expected)\n" << Logs();
  }
};

std::string* SlurmTest::skip_ = nullptr;

// Graceful preemption of one worker: `scancel --signal=TERM JOB.STEP` reaches that step only;
// its worker hands its state to the other three and leaves; nothing is lost.
TEST_F(SlurmTest, PreemptOneWorkerByStepSignal) {
  constexpr int64_t kSteps = 80;
  Submit(4, 4, kSteps, 50);
  std::map<int, StepInfo> steps = WaitSteps(4);
  ASSERT_EQ(steps.size(), 4u) << Logs();
  WaitStable(1, 4, 3);
  ASSERT_FALSE(HasFatalFailure());
  const StepInfo victim = steps.at(1);
  Ran r = Slurm({"scancel", "--signal=TERM", victim.id});
  // Slurm 22.05 signals the step, then also asks the job's other nodes, which do not run it:
  // on a multi-node job scancel exits 225 with this error although the step got the signal.
  if (r.code != 0) {
    EXPECT_NE(r.out.find("Invalid job id specified"), std::string::npos) << r.code << r.out;
  }
  WaitStable(2, 3);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_LT(testing::ApiStatus(api_).value("step", int64_t{0}), kSteps)
      << "the job ended before the preemption was handled";
  // Its step ends (the worker left), the other three run on.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (Steps().count(1) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(Steps().count(1), 0u) << "step " << victim.id << " still runs\n" << Logs();

  std::map<int, int> exits = Finish(0);
  EXPECT_EQ(exits.size(), 4u) << Logs();
  for (const auto& [index, code] : exits) EXPECT_EQ(code, 0) << "worker " << index << Logs();
  EXPECT_NE(ReadFile(dir_ / "worker-1.log").find("finished at step"), std::string::npos)
      << "the preempted worker did not leave through Finish\n"
      << Logs();
  testing::CheckSamples(dir_, kSteps);
}

// Grow by extra steps: morphctl asks for 6; morphrun --slurm starts two joiner steps inside the
// allocation (Slurm cannot grow a running job in 22.05); they receive their state and train.
TEST_F(SlurmTest, GrowByExtraSteps) {
  constexpr int64_t kSteps = 100;
  Submit(4, 6, kSteps, 50);
  WaitStable(1, 4, 3);
  ASSERT_FALSE(HasFatalFailure());
  Ran r = RunCommand(
      {MORPHCTL, "--addr", "127.0.0.1:" + std::to_string(api_), "--token", kToken, "resize", "6"},
      dir_ / "morphctl.out");
  ASSERT_EQ(r.code, 0) << r.out;
  WaitStable(2, 6);
  ASSERT_FALSE(HasFatalFailure());
  std::map<int, StepInfo> steps = Steps();
  EXPECT_EQ(steps.size(), 6u) << Logs();
  EXPECT_TRUE(steps.count(4) && steps.count(5)) << "the joiners are steps morph-4, morph-5";
  std::map<int, int> exits = Finish(0);
  EXPECT_EQ(exits.size(), 6u) << Logs();
  for (const auto& [index, code] : exits) EXPECT_EQ(code, 0) << "worker " << index << Logs();
  testing::CheckSamples(dir_, kSteps);
}

#ifdef MORPH_TORCH_PYTHON
// A PyTorch program (tests/torch/mpirun_worker.py) under `morphrun --slurm -n 2`: each worker a
// step of the allocation, the coordinator in morphrun, torch process groups from morph; both
// train 6 steps on the generation's groups and exit 0 with the state every step wrote, and see
// the torchrun variables (what torch_mpirun_test checks under mpirun).
TEST_F(SlurmTest, TorchProgramUnderMorphrun) {
  SubmitScript(std::string("export PYTHONPATH=") + MORPH_TORCH_PYTHONPATH + " OMP_NUM_THREADS=1\n" +
               MORPHRUN + " --slurm -n 2 --api-port " + std::to_string(api_) + " --log-dir " +
               dir_.string() + " -- " + MORPH_TORCH_PYTHON + " " + MORPH_TORCH_WORKER);
  std::map<int, int> exits = Finish(0);
  EXPECT_EQ(exits.size(), 2u) << Logs();
  for (const auto& [index, code] : exits) EXPECT_EQ(code, 0) << "worker " << index << Logs();
  std::set<int64_t> ranks;
  for (int w = 0; w < 2; ++w) {
    std::istringstream log(ReadFile(dir_ / ("worker-" + std::to_string(w) + ".log")));
    for (std::string line; std::getline(log, line);) {
      if (line.rfind("{\"rank\"", 0) != 0) continue;
      nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_EQ(j["world"], 2) << line;
      EXPECT_EQ(j["steps"], 6) << line;
      EXPECT_TRUE(j["w_equal"].get<bool>()) << line;
      EXPECT_EQ(j["torch_rank"], std::to_string(j["rank"].get<int64_t>())) << line;
      EXPECT_EQ(j["torch_world"], "2") << line;
      ranks.insert(j["rank"].get<int64_t>());
    }
  }
  EXPECT_EQ(ranks, (std::set<int64_t>{0, 1})) << Logs();
}
#endif

// The single-step bootstrap (no morphrun): `srun -n 4` starts all four workers as one step,
// task 0 (SLURM_PROCID) hosts the coordinator at MORPH_COORDINATOR_PORT on the first node of
// SLURM_STEP_NODELIST and the others dial it. The emulated node names (n1..n4) do not resolve,
// so each task's node list is rewritten to this host's name, as on a cluster whose node names
// are host names.
TEST_F(SlurmTest, SingleStepTaskZeroHosts) {
  constexpr int64_t kSteps = 30;
  const std::string port = std::to_string(testing::FreePort());
  SubmitScript("export MORPH_COORDINATOR_PORT=" + port + "\nsrun -n4 --kill-on-bad-exit=1 -o " +
               (dir_ / "worker-%t.log").string() +
               " bash -c 'SLURM_STEP_NODELIST=$(hostname) exec " + Worker(kSteps, 20) + "'");
  EXPECT_TRUE(WaitJobEnd(90000)) << Logs();
  EXPECT_EQ(ReadFile(dir_ / "morphrun.rc"), "0\n") << "srun's exit code\n" << Logs();
  int finished = 0;
  for (int t = 0; t < 4; ++t) {
    finished +=
        ReadFile(dir_ / ("worker-" + std::to_string(t) + ".log")).find("finished at step") !=
        std::string::npos;
  }
  EXPECT_EQ(finished, 4) << Logs();
  EXPECT_NE(ReadFile(dir_ / "worker-0.log").find("Slurm task 0: hosting the coordinator at"),
            std::string::npos)
      << Logs();
  testing::CheckSamples(dir_, kSteps);
}

// Shrink by node list: `scontrol update JobId=X NodeList=n[1-3]` SIGKILLs the task on n4 with no
// SIGTERM first; the coordinator sees a failure and the other three go on.
// The workers' state has a surviving copy of every piece (hybrid ZeRO), so the survivors recover
// in place from the newest step their states cover and train on.
TEST_F(SlurmTest, ShrinkByNodeList) {
  constexpr int64_t kSteps = 60;
  int victim = -1;
  StartFourWithOneOnN4(kSteps, victim);
  ASSERT_FALSE(HasFatalFailure());
  Ran r = Slurm({"scontrol", "update", "JobId=" + job_, "NodeList=n[1-3]"});
  ASSERT_EQ(r.code, 0) << r.out;
  WaitStable(2, 2, 0, /*standby=*/1);  // the three survivors: dp 2 and a spare
  ASSERT_FALSE(HasFatalFailure());
  std::map<int, int> exits = Finish(0);
  EXPECT_EQ(exits.size(), 4u) << Logs();
  for (const auto& [index, code] : exits) {
    EXPECT_EQ(code, index == victim ? 128 + SIGKILL : 0) << "worker " << index << Logs();
  }
  testing::CheckSamples(dir_, kSteps, /*retrained=*/true);
}

// A node set DOWN (sbatch --no-kill: the job survives it): its task dies, the others recover
// in place and go on, as in ShrinkByNodeList.
TEST_F(SlurmTest, SurviveANodeSetDown) {
  constexpr int64_t kSteps = 60;
  int victim = -1;
  StartFourWithOneOnN4(kSteps, victim);
  ASSERT_FALSE(HasFatalFailure());
  downed_ = "n4";  // TearDown puts it back in service
  Ran r = Slurm({"scontrol", "update", "NodeName=n4", "State=DOWN", "Reason=morph-slurm-test"});
  ASSERT_EQ(r.code, 0) << r.out;
  WaitStable(2, 2, 0, /*standby=*/1);  // the three survivors: dp 2 and a spare
  ASSERT_FALSE(HasFatalFailure());
  std::map<int, int> exits = Finish(0);
  EXPECT_EQ(exits.size(), 4u) << Logs();
  // Slurm 22.05 SIGKILLs the task on the DOWN node, and its srun says "Node failure on n4" and
  // exits 0 (checked by hand on this cluster): the worker's own log says it never finished.
  for (const auto& [index, code] : exits) EXPECT_EQ(code, 0) << "worker " << index << Logs();
  const std::string victim_log = ReadFile(dir_ / ("worker-" + std::to_string(victim) + ".log"));
  EXPECT_NE(victim_log.find("Node failure on n4"), std::string::npos) << Logs();
  EXPECT_EQ(victim_log.find("finished at step"), std::string::npos) << Logs();
  testing::CheckSamples(dir_, kSteps, /*retrained=*/true);
}

// Whole-job preemption and requeue: an `sbatch --requeue` job whose every task is stopped by
// `scontrol requeue` (SIGTERM, SIGKILL after KillWait; nobody is left to hand the state to)
// runs its batch script again with SLURM_RESTART_COUNT=1. morphrun's coordinator (MORPH_RESUME
// auto) then commits the first generation at the step of the newest complete checkpoint in
// MORPH_CHECKPOINT_DIR, every worker reads its shards from it and checks them bitwise from its
// first step on, and the samples of both runs together are the fixed global order.
// Slurm 22.05 holds a requeued job until now + cred_expire (120 s by default): the test moves
// its start time to now (`scontrol update JobId=J StartTime=now`), as an operator would.
TEST_F(SlurmTest, RequeueResumesFromTheLatestCheckpoint) {
  constexpr int64_t kSteps = 60;
  const fs::path ckpt = dir_ / "ckpt";
  // Each run logs into its own folder (run-0, run-1: SLURM_RESTART_COUNT).
  const std::string run = (dir_ / "run-").string() + "${SLURM_RESTART_COUNT:-0}";
  SubmitScript("export MORPH_CHECKPOINT_DIR=" + ckpt.string() +
                   " MORPH_CHECKPOINT_EVERY=4\nmkdir -p " + run + "\n" + MORPHRUN +
                   " --slurm -n 4 --max 4 --api-port " + std::to_string(api_) + " --log-dir " +
                   run + " -- " + MORPH_ELASTIC_WORKER + " --steps " + std::to_string(kSteps) +
                   " --out " + run + " --step-ms 50",
               {"--requeue", "--open-mode=append"});
  ASSERT_FALSE(HasFatalFailure());
  WaitStable(1, 4, 14);
  ASSERT_FALSE(HasFatalFailure());
  Ran r = Slurm({"scontrol", "requeue", job_});
  ASSERT_EQ(r.code, 0) << r.out;
  // Every task of the first run ends; the job waits for its begin time.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::string state;
  while (std::chrono::steady_clock::now() < until) {
    state = Slurm({"squeue", "-h", "-j", job_, "-o", "%T"}).out;
    if (state.rfind("PENDING", 0) == 0 && Steps().empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_EQ(state.rfind("PENDING", 0), 0u) << state << Logs();
  fs::remove(dir_ / "morphrun.rc");
  StatusOr<CheckpointRef> latest = LatestCompleteCheckpoint(ckpt.string());
  ASSERT_TRUE(latest.ok()) << latest.status() << Logs();
  EXPECT_GE(latest->step, 8);
  r = Slurm({"scontrol", "update", "JobId=" + job_, "StartTime=now"});
  ASSERT_EQ(r.code, 0) << r.out;

  std::map<int, int> exits = Finish(0);
  EXPECT_EQ(exits.size(), 4u) << Logs();
  for (const auto& [index, code] : exits) EXPECT_EQ(code, 0) << "worker " << index << Logs();
  const fs::path second = dir_ / "run-1";
  const std::string resumed =
      "resumed at step " + std::to_string(latest->step) + " from checkpoint " + latest->path;
  for (int w = 0; w < 4; ++w) {
    const std::string log = ReadFile(second / ("worker-" + std::to_string(w) + ".log"));
    EXPECT_NE(log.find(resumed), std::string::npos) << "worker " << w << ": " << log;
    EXPECT_NE(log.find("finished at step"), std::string::npos) << log;
  }
  const std::string batch = ReadFile(dir_ / "batch.out");
  EXPECT_NE(batch.find("MORPH_RESUME=auto, SLURM_RESTART_COUNT=1"), std::string::npos) << batch;
  // Both runs' samples: the second run's generations come after the first's (its steps from
  // the checkpoint on supersede the first run's).
  const fs::path both = dir_ / "both";
  fs::create_directories(both);
  for (const auto& [folder, offset] : {std::pair{dir_ / "run-0", 0}, std::pair{second, 1000}}) {
    for (const auto& e : fs::directory_iterator(folder)) {
      if (e.path().extension() != ".samples") continue;
      std::ifstream in(e.path());
      std::ofstream out(both / (folder.filename().string() + "-" + e.path().filename().string()));
      for (std::string line; std::getline(in, line);) {
        std::istringstream l(line);
        int64_t step = 0, generation = 0;
        l >> step >> generation;
        std::string rest;
        std::getline(l, rest);
        out << step << " " << generation + offset << rest << "\n";
      }
    }
  }
  testing::CheckSamples(both, kSteps, /*retrained=*/true);
}

}  // namespace
}  // namespace morph
