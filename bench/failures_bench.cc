// Failure benchmark (issue 10, `make bench-failures`): a job of real worker processes (this
// binary in worker mode) launched by the Launcher (morphrun) trains 100 ms steps on `--bytes` of
// state (bench/reconfig_cases.h: parameters + Adam moments); one worker, chosen by a seeded
// draw, is killed with SIGKILL at a seeded moment inside a step, and the survivors recover in
// place. Cases (one JSON object per line):
//
//   hybrid    1 GiB, 4 -> 3 workers, moments in hybrid ZeRO (Layout::ZeroShard(2): sharded in
//             pairs, replicated across them): the lost ranges come from their live replicas;
//             the survivors go on at dp 2 (a group size must divide dp) with one standby.
//   snapshot  1 GiB, 4 -> 3 workers (dp 4 -> 3), plain ZeRO-1 with buddy snapshots every
//             --snapshot-every steps (MORPH_SNAPSHOT_EVERY): every rank rolls back to the
//             snapshot step; `lost_steps` counts the steps trained again.
//   stall     --stall-bytes (16 MiB, TorchFT's stall job's size), hybrid ZeRO, 4 -> 3: the
//             survivors' stall for a killed process on one host (target < 0.5 s).
//   heal      --heal-bytes (256 MiB), hybrid ZeRO: after the recovery one joiner is added
//             (Coordinator::Resize add 1, the Launcher starts it): its process start -> its first
//             completed step (target < 1 s), and the survivors' stall while it joins.
//   step_cost 4 workers, 1 GiB, 100 ms steps: mean step time without a consistency mechanism
//             (no vote), with Runtime::CommitUpdate (the runtime's commit vote: the default
//             mechanism), with the program's own vote + BeginUpdate + the undo copy
//             (MORPH_UNDO_COPY), and with CommitUpdate + buddy snapshots every
//             --snapshot-every steps; overhead_vs_plain (target < 0.05). --cost-variants
//             commit,undo,snapshot picks which run next to plain.
//
// Fields of a failure line: `seconds` = SIGKILL -> the first step completed by every survivor
// that holds a rank; phases (max over survivors): detect (SIGKILL -> the survivor's collective
// failed, or its BeginStep entered the recovery), abort (Reconfiguration::abort_seconds:
// failure seen -> the recovery's commit), communicators, plan, transfer, resume; stall_seconds
// (the survivors' last step completed before the kill -> their first after it, TorchFT's
// definition; step_seconds is one ordinary step), recovery source, resumed step, newest step,
// lost_steps, bytes moved, and `verified` (every survivor's and joiner's state holds exactly the
// values of the step training resumed from: a sampled element every 4 KiB of every shard, and
// the scalar). The checkpoint-restart baselines (C++ restart, PyTorch DCP) and TorchFT run in
// the same session in bench/peers/run_failures_bench.sh, which adds ratio_vs_baseline.
//
//   failures_bench [--cases hybrid,snapshot,stall,heal,step_cost] [--bytes 1GiB] [--seed 1]
//                  [--step-ms 100] [--snapshot-every 5] [--stall-bytes 16MiB] [--heal-bytes 256MiB]
//                  [--trials 3] [--cost-variants commit,undo,snapshot]
//
// Every wait is bounded (--timeout-s); the Launcher stops its workers when a case ends.
// MORPH_BENCH_KEEP=1 keeps each job's folder (<tmp>/morph-fbench-<case>-<pid>): the workers'
// logs and their fb-<worker>.jsonl lines (every step with begin_s and update_wait_s, what
// BeginStep and BeginUpdate waited; each recovery with its phases). MORPH_BENCH_VERBOSE=1 logs
// INFO too (GLOG_vmodule=switch_snapshot=1: a snapshot recovery's transfer, broken down).
#include <glog/logging.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/params.h"
#include "bench/reconfig_cases.h"
#include "morph/runtime.h"
#include "runtime/tools/launcher.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using morph::DType;
using morph::ParallelConfig;

// One sampled element every kStride elements (4 KiB of f32) of each shard carries the number of
// steps applied: cheap to update every step, enough to see a torn or mixed state.
constexpr int64_t kStride = 1024;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---- worker mode ----------------------------------------------------------------------------

struct WorkerArgs {
  int64_t bytes = int64_t{1} << 30;
  int zero_group = 0;  // 0: plain ZeRO-1
  int64_t step_ms = 100;
  // The consistency mechanism: "commit" (Runtime::CommitUpdate: the runtime's commit vote, the
  // default), "vote" (the program's own vote, a 1-element allreduce, then BeginUpdate: what the
  // undo copy goes with), "plain" (neither: the step without a mechanism).
  std::string consistency = "commit";
  int64_t steps = int64_t{1} << 40;
  std::string out = ".";
};

// Sets the sampled elements of every local shard and the "step" scalar to `value`, or checks
// them (returns false at the first mismatch, naming it in `why`). Only dp-only configs (the
// frame is the whole tensor, so a local offset + flat_begin is the global linear index).
bool StampState(morph::State& s, int64_t value, bool check, std::string* why) {
  const float v = static_cast<float>(value);
  for (const morph::TensorSpec& spec : s.tensors()) {
    auto t = s.tensor(spec.name);
    if (!t.ok() || t->shard.empty()) continue;
    float* data = reinterpret_cast<float*>(t->data.data);
    const int64_t b = t->shard.flat_begin, e = t->shard.flat_end;
    for (int64_t l = (b + kStride - 1) / kStride * kStride; l < e; l += kStride) {
      if (!check) {
        data[l - b] = v;
      } else if (data[l - b] != v) {
        if (why) {
          *why = spec.name + " element " + std::to_string(l) + " holds " +
                 std::to_string(data[l - b]) + ", expected " + std::to_string(value);
        }
        return false;
      }
    }
  }
  auto scalar = s.scalar("step");
  if (!scalar.ok() || scalar->size() < sizeof(int64_t)) return !check;
  if (!check) {
    std::memcpy(scalar->data(), &value, sizeof(value));
    return true;
  }
  int64_t held = 0;
  std::memcpy(&held, scalar->data(), sizeof(held));
  if (held != value && why) *why = "scalar step holds " + std::to_string(held);
  return held == value;
}

// Resident set of this process (VmRSS), bytes; 0 if unreadable.
int64_t RssBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  }
  return 0;
}

int Worker(const WorkerArgs& a) {
  const int64_t process_start_ns = NowNs();
  auto opts = morph::Options::FromEnv();
  if (!opts.ok()) return 4;
  opts->model = {.num_layers = morph::bench::kReconfigLayers,
                 .tp_candidates = {1},
                 .pp_candidates = {1},
                 .global_batch = 12,
                 .zero_stage = 1};
  opts->dataset_samples = 1 << 16;
  std::vector<morph::TensorSpec> model =
      morph::bench::ReconfigModel(static_cast<uint64_t>(a.bytes));
  for (morph::TensorSpec& t : model) {
    if (t.layout.zero_sharded() && a.zero_group > 0) t.layout = t.layout.ZeroShard(a.zero_group);
  }
  auto rt = morph::Runtime::Start(*opts, [&](morph::State& s) -> morph::Status {
    for (const morph::TensorSpec& t : model) {
      MORPH_RETURN_IF_ERROR(s.AddTensor(t.name, t.shape, t.dtype, t.layout));
    }
    return s.AddScalar("step", sizeof(int64_t));
  });
  if (!rt.ok()) {
    std::fprintf(stderr, "worker: %s\n", rt.status().ToString().c_str());
    return 4;
  }
  morph::Runtime& r = **rt;
  std::ofstream log(a.out + "/fb-" + std::to_string(r.worker_id()) + ".jsonl");
  auto put = [&](json j) {
    j["w"] = r.worker_id();
    log << j.dump() << "\n";
    log.flush();
  };
  std::vector<float> grad(size_t{1} << 18);  // 1 MiB of gradients, allreduced over DP
  const auto timeout = std::chrono::milliseconds(60000);
  bool first = true;
  while (true) {
    const int64_t enter_ns = NowNs();
    auto step = r.BeginStep();
    if (!step.ok()) {
      put({{"ev", "error"}, {"t", NowNs()}, {"why", step.status().ToString()}});
      std::fprintf(stderr, "worker: %s\n", step.status().ToString().c_str());
      return 4;
    }
    const int64_t return_ns = NowNs();
    if (step->done() || step->index() >= a.steps) break;
    const std::optional<morph::Reconfiguration>& last = r.last_reconfiguration();
    if ((step->reconfigured() || first) && last && (last->recovery || last->old_rank < 0)) {
      std::string why;
      bool ok = StampState(r.state(), step->index(), /*check=*/true, &why);
      put({{"ev", last->recovery ? "recovered" : "joined"},
           {"generation", last->generation},
           {"rank", step->rank()},
           {"old_rank", last->old_rank},
           {"step", step->index()},
           {"newest_step", last->newest_step},
           {"lost_steps", last->lost_steps()},
           {"source", static_cast<int>(last->source)},
           {"stale", last->stale},
           {"enter_ns", enter_ns},
           {"return_ns", return_ns},
           {"process_start_ns", process_start_ns},
           {"abort", last->abort_seconds},
           {"communicators", last->communicators_seconds},
           {"plan", last->plan_seconds},
           {"transfer", last->transfer_seconds},
           {"resume", last->resume_seconds},
           {"stall", last->stall_seconds},
           {"bytes_received", last->bytes_received},
           {"verified", ok},
           {"why", why}});
    }
    first = false;
    if (step->rank() < 0) {  // a standby spare: nothing to train
      std::this_thread::sleep_for(std::chrono::milliseconds(a.step_ms));
      if (!r.EndStep().ok()) return 4;
      continue;
    }
    // Forward/backward: device compute, during which the host's cores are free.
    std::this_thread::sleep_for(std::chrono::milliseconds(a.step_ms));
    std::fill(grad.begin(), grad.end(), 1.0f);
    morph::Status st = step->dp().Allreduce(grad.data(), static_cast<int64_t>(grad.size()),
                                            DType::kF32, morph::ReduceOp::kSum, timeout);
    if (st.ok() && a.consistency == "vote") {
      // The program's own commit vote: every rank got its gradients, so every rank will
      // update. After it the update is local (BeginUpdate: after the last collective).
      int64_t one = 1;
      st = step->dp().Allreduce(&one, 1, DType::kI64, morph::ReduceOp::kSum, timeout);
    }
    if (!st.ok()) {
      put({{"ev", "fail"}, {"t", NowNs()}, {"step", step->index()}, {"why", st.ToString()}});
      morph::Status ab = r.AbortStep(st);
      if (!ab.ok()) std::fprintf(stderr, "worker: AbortStep: %s\n", ab.ToString().c_str());
      continue;
    }
    const int64_t update_ns = NowNs();  // CommitUpdate / BeginUpdate wait for a copy's rest
    if (a.consistency == "commit") {
      // The runtime's commit vote (it ends the step itself when it fails).
      st = r.CommitUpdate();
      if (!st.ok()) {
        put({{"ev", "fail"}, {"t", NowNs()}, {"step", step->index()}, {"why", st.ToString()}});
        continue;
      }
    } else if (a.consistency == "vote") {
      r.BeginUpdate();
    }
    const int64_t updated_ns = NowNs();
    StampState(r.state(), step->index() + 1, /*check=*/false, nullptr);  // the optimizer step
    if (!r.EndStep().ok()) return 4;
    // Where a step's time went beyond its compute: BeginStep (a snapshot round's start waits
    // for the previous round) and BeginUpdate (the copy's rest).
    put({{"ev", "step"},
         {"t", NowNs()},
         {"step", step->index()},
         {"rank", step->rank()},
         {"begin_s", (return_ns - enter_ns) / 1e9},
         {"update_wait_s", (updated_ns - update_ns) / 1e9}});
    if (step->index() % 10 == 9) {  // memory: the state's shards, and everything (snapshots)
      put({{"ev", "mem"},
           {"step", step->index()},
           {"rss", RssBytes()},
           {"local_bytes", r.state().local_bytes()}});
    }
  }
  return r.Finish().ok() ? 0 : 4;
}

// ---- driver mode ----------------------------------------------------------------------------

struct Case {
  std::string name;
  int64_t bytes = 0;
  int zero_group = 0;
  int64_t snapshot_every = 0;
  bool heal = false;
  ParallelConfig after;  // the survivors' config (3 workers)
};

struct Events {
  std::vector<json> all;
  std::vector<json> Of(const std::string& ev) const {
    std::vector<json> v;
    for (const json& j : all) {
      if (j.value("ev", "") == ev) v.push_back(j);
    }
    return v;
  }
};

Events ReadLogs(const fs::path& dir) {
  Events e;
  for (const auto& f : fs::directory_iterator(dir)) {
    if (f.path().extension() != ".jsonl") continue;
    std::ifstream in(f.path());
    std::string line;
    while (std::getline(in, line)) {
      json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) e.all.push_back(std::move(j));
    }
  }
  return e;
}

// A job of `workers` processes for one case; kills them when destroyed (what they would do
// next is not measured, and a graceful end would wait for every worker's leave).
struct Job {
  fs::path dir;
  std::unique_ptr<morph::Launcher> launcher;
  ~Job() {
    if (!launcher) return;
    launcher->Signal(SIGKILL);
    (void)launcher->Wait(morph::Deadline::AfterMs(30000));
    launcher.reset();
    if (!std::getenv("MORPH_BENCH_KEEP")) fs::remove_all(dir);
  }
};

struct DriverArgs {
  std::string self;
  int64_t step_ms = 100;
  int64_t timeout_s = 300;
  std::mt19937_64 rng{1};
};

morph::Status StartJob(Job& job, const DriverArgs& d, const std::string& tag, int workers,
                       const WorkerArgs& w, int64_t snapshot_every,
                       std::map<int, ParallelConfig> configs, bool undo_copy = false) {
  job.dir = fs::temp_directory_path() / ("morph-fbench-" + tag + "-" + std::to_string(getpid()));
  fs::remove_all(job.dir);
  fs::create_directories(job.dir);
  morph::LauncherOptions o;
  o.workers = workers;
  o.argv = {d.self,          "--worker",
            "--bytes",       std::to_string(w.bytes),
            "--zero-group",  std::to_string(w.zero_group),
            "--step-ms",     std::to_string(w.step_ms),
            "--consistency", w.consistency,
            "--steps",       std::to_string(w.steps),
            "--out",         job.dir.string()};
  o.log_dir = job.dir.string();
  if (snapshot_every > 0) o.env["MORPH_SNAPSHOT_EVERY"] = std::to_string(snapshot_every);
  if (undo_copy) o.env["MORPH_UNDO_COPY"] = "1";
  o.coordinator.serve_http = false;
  if (auto watch = morph::params::LocalWatchMs(); watch.ok()) o.coordinator.local_watch_ms = *watch;
  o.coordinator.policy = [configs](
                             int n, const ParallelConfig*,
                             const morph::ModelConstraints&) -> std::optional<ParallelConfig> {
    auto it = configs.upper_bound(n);
    if (it == configs.begin()) return std::nullopt;
    return std::prev(it)->second;
  };
  MORPH_ASSIGN_OR_RETURN(job.launcher, morph::Launcher::Start(std::move(o)));
  return morph::Status();
}

template <typename Pred>
bool WaitFor(Pred pred, int64_t timeout_s) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Why a job stopped making progress, from its workers' logs (an "error" line), for the message.
std::string ErrorsOf(const Events& e) {
  std::string s;
  for (const json& j : e.Of("error")) s += " worker " + j["w"].dump() + ": " + j.value("why", "");
  return s.empty() ? " (no worker reported an error; logs: MORPH_BENCH_KEEP=1)" : s;
}

int RunFailure(DriverArgs& d, const Case& c) {
  Job job;
  WorkerArgs w{.bytes = c.bytes, .zero_group = c.zero_group, .step_ms = d.step_ms};
  std::map<int, ParallelConfig> configs = {{3, c.after},
                                           {4, morph::bench::ReconfigConfig(4, 1, 1)}};
  morph::Status s = StartJob(job, d, c.name, 4, w, c.snapshot_every, configs);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", c.name.c_str(), s.ToString().c_str());
    return 1;
  }
  // Warm up past a snapshot (when there are any) and into the next interval, so that the
  // rollback loses steps.
  const int64_t warm = c.snapshot_every > 0 ? 2 * c.snapshot_every + 3 : 10;
  Events e;
  if (!WaitFor(
          [&] {
            e = ReadLogs(job.dir);
            int64_t done = 0;
            for (const json& j : e.Of("step")) done = std::max<int64_t>(done, j["step"]);
            return done >= warm;
          },
          d.timeout_s)) {
    std::fprintf(stderr, "%s: the job did not reach step %lld:%s\n", c.name.c_str(),
                 static_cast<long long>(warm), ErrorsOf(ReadLogs(job.dir)).c_str());
    return 1;
  }
  std::vector<double> gaps;
  {
    std::map<int64_t, std::vector<int64_t>> by_worker;
    for (const json& j : e.Of("step")) by_worker[j["w"]].push_back(j["t"]);
    for (auto& [wid, ts] : by_worker) {
      for (size_t i = 1; i < ts.size(); ++i) gaps.push_back((ts[i] - ts[i - 1]) / 1e9);
    }
  }
  const double step_s = Median(gaps);
  int64_t rss_before = 0, local_before = 0;
  for (const json& j : e.Of("mem")) {
    rss_before = std::max(rss_before, j["rss"].get<int64_t>());
    local_before = std::max(local_before, j["local_bytes"].get<int64_t>());
  }
  std::vector<morph::ChildInfo> kids = job.launcher->children();
  const morph::ChildInfo victim = kids[d.rng() % kids.size()];
  const double offset_s = std::uniform_real_distribution<double>(0, step_s)(d.rng);
  std::this_thread::sleep_for(std::chrono::duration<double>(offset_s));
  const int64_t kill_ns = NowNs();
  if (::kill(victim.pid, SIGKILL) != 0) {
    std::fprintf(stderr, "%s: kill %d: %s\n", c.name.c_str(), victim.pid, std::strerror(errno));
    return 1;
  }
  // Every survivor that holds a rank in the recovered config recovered and completed a step.
  std::vector<json> rec;
  bool gave_up = false;
  auto recovered = [&] {
    e = ReadLogs(job.dir);
    gave_up = e.Of("error").size() >= 3;  // every survivor's BeginStep failed
    if (gave_up) return true;
    rec.clear();
    for (const json& j : e.Of("recovered")) {
      if (j["return_ns"].get<int64_t>() > kill_ns) rec.push_back(j);
    }
    // Survivors with a rank in the new config; a standby waits inside BeginStep for one.
    if (static_cast<int>(rec.size()) < c.after.world()) return false;
    for (const json& r : rec) {
      if (r["rank"].get<int>() < 0) continue;
      bool stepped = false;
      for (const json& st : e.Of("step")) {
        stepped |= st["w"] == r["w"] && st["t"].get<int64_t>() > r["return_ns"].get<int64_t>();
      }
      if (!stepped) return false;
    }
    return true;
  };
  if (!WaitFor(recovered, d.timeout_s) || gave_up) {
    std::fprintf(stderr, "%s: the survivors did not recover (recovered: %zu of %d; %s):%s\n",
                 c.name.c_str(), rec.size(), c.after.world(),
                 gave_up ? "every survivor's BeginStep failed after the kill"
                         : ("no progress within " + std::to_string(d.timeout_s) + " s").c_str(),
                 ErrorsOf(e).c_str());
    return 1;
  }
  // Per survivor with a rank: last step before the kill, first after; phases.
  std::map<std::string, double> mx;
  int64_t last_first_ns = 0;
  double stall = 0;
  bool verified = true;
  int64_t moved = 0;
  json first_rec = rec[0];
  std::string why;
  json per_survivor = json::array();
  for (const json& r : rec) {
    per_survivor.push_back({{"rank", r["rank"]},
                            {"communicators", r["communicators"]},
                            {"transfer", r["transfer"]},
                            {"resume", r["resume"]},
                            {"stall", r["stall"]}});
    verified = verified && r["verified"].get<bool>();
    if (!r["verified"].get<bool>() && why.empty()) why = r.value("why", "");
    moved += r["bytes_received"].get<int64_t>();
    for (const char* k : {"abort", "communicators", "plan", "transfer", "resume", "stall"}) {
      mx[k] = std::max(mx[k], r[k].get<double>());
    }
    int64_t seen_ns = r["enter_ns"].get<int64_t>();  // failure seen: BeginStep entered ...
    for (const json& f : e.Of("fail")) {             // ... or a collective failed before it
      if (f["w"] == r["w"] && f["t"].get<int64_t>() > kill_ns) {
        seen_ns = std::min(seen_ns, f["t"].get<int64_t>());
      }
    }
    mx["detect"] = std::max(mx["detect"], std::max<int64_t>(0, seen_ns - kill_ns) / 1e9);
    if (r["rank"].get<int>() < 0) continue;
    // The longest interval between this survivor's completed steps, from its last step before
    // the kill through its third after (a step past its collectives when the kill came may
    // still complete; the stall then comes a step later), as torchft_failover.py measures it.
    std::vector<int64_t> ts;
    for (const json& st : e.Of("step")) {
      if (st["w"] == r["w"]) ts.push_back(st["t"]);
    }
    std::sort(ts.begin(), ts.end());
    auto after = std::upper_bound(ts.begin(), ts.end(), kill_ns);
    auto resumed = std::upper_bound(ts.begin(), ts.end(), r["return_ns"].get<int64_t>());
    if (after == ts.end() || resumed == ts.end()) continue;
    last_first_ns = std::max(last_first_ns, *resumed);
    for (auto it = after; it != ts.end() && it != after + 3; ++it) {
      if (it != ts.begin()) stall = std::max(stall, (*it - *(it - 1)) / 1e9);
    }
  }
  json out = {
      {"name", "failure/" + c.name},
      {"bytes", c.bytes},
      {"seconds", (last_first_ns - kill_ns) / 1e9},  // kill -> first step after recovery
      {"workers", "4to3"},
      {"config_after", c.after.ToString()},
      {"redundancy", c.zero_group > 0 ? "hybrid_zero/" + std::to_string(c.zero_group)
                                      : "buddy_snapshot/every_" + std::to_string(c.snapshot_every)},
      {"stall_seconds", stall},
      {"per_survivor", per_survivor},  // phases of each (rank -1: a standby now)
      {"step_seconds", step_s},
      {"stall_excess_seconds", stall - step_s},
      {"detect_seconds", mx["detect"]},
      {"abort_seconds", mx["abort"]},
      {"communicators_seconds", mx["communicators"]},
      {"plan_seconds", mx["plan"]},
      {"transfer_seconds", mx["transfer"]},
      {"resume_seconds", mx["resume"]},
      {"recovery_stall_seconds", mx["stall"]},
      {"source", first_rec["source"].get<int>() == 0   ? "replicas"
                 : first_rec["source"].get<int>() == 1 ? "snapshot"
                                                       : "checkpoint"},
      {"resumed_step", first_rec["step"]},
      {"newest_step", first_rec["newest_step"]},
      {"lost_steps", first_rec["lost_steps"]},
      {"bytes_moved", moved},
      {"victim_worker_index", victim.index},
      {"kill_offset_seconds", offset_s},
      {"worker_state_bytes_max", local_before},
      {"worker_rss_max_bytes", rss_before},
      {"verified", verified}};
  if (!why.empty()) out["verify_error"] = why;
  if (c.name == "stall") out["target_seconds"] = 0.5;

  if (c.heal) {
    // A replacement joins: the Launcher starts it when the coordinator grows the job.
    morph::ResizeRequest req;
    req.add = 1;
    req.reason = "bench: replace the killed worker";
    const int64_t req_ns = NowNs();
    s = job.launcher->coordinator().Resize(req, morph::Deadline::AfterMs(10000));
    json joined;
    bool ok = s.ok() && WaitFor(
                            [&] {
                              e = ReadLogs(job.dir);
                              for (const json& j : e.Of("joined")) {
                                if (j["process_start_ns"].get<int64_t>() < req_ns)
                                  continue;  // a standby given a rank
                                for (const json& st : e.Of("step")) {
                                  if (st["w"] == j["w"]) {
                                    joined = j;
                                    joined["first_step_ns"] = st["t"];
                                    return true;
                                  }
                                }
                              }
                              return false;
                            },
                            d.timeout_s);
    if (!ok) {
      std::fprintf(stderr, "heal: the joiner did not complete a step (%s):%s\n",
                   s.ToString().c_str(), ErrorsOf(e).c_str());
      return 1;
    }
    const int64_t start_ns = joined["process_start_ns"], first_ns = joined["first_step_ns"];
    // The survivors' longest step interval around the join, less an ordinary step.
    double gap = 0;
    std::map<int64_t, std::vector<int64_t>> by_worker;
    for (const json& st : e.Of("step")) {
      int64_t t = st["t"];
      if (st["w"] != joined["w"] && t >= req_ns - static_cast<int64_t>(step_s * 1e9) &&
          t <= first_ns + static_cast<int64_t>(2 * step_s * 1e9)) {
        by_worker[st["w"]].push_back(t);
      }
    }
    for (auto& [wid, ts] : by_worker) {
      std::sort(ts.begin(), ts.end());
      for (size_t i = 1; i < ts.size(); ++i) gap = std::max(gap, (ts[i] - ts[i - 1]) / 1e9);
    }
    json h = {{"name", "heal/" + std::to_string(c.bytes >> 20) + "MiB"},
              {"bytes", c.bytes},
              {"seconds", (first_ns - start_ns) / 1e9},
              {"request_to_first_step_seconds", (first_ns - req_ns) / 1e9},
              {"transfer_seconds", joined["transfer"]},
              {"bytes_received", joined["bytes_received"]},
              {"survivor_stall_on_join_seconds", gap - step_s},
              {"step_seconds", step_s},
              {"target_seconds", 1.0},
              {"verified", joined["verified"]}};
    std::printf("%s\n%s\n", out.dump().c_str(), h.dump().c_str());
  } else {
    std::printf("%s\n", out.dump().c_str());
  }
  std::fflush(stdout);
  return verified ? 0 : 1;
}

// Mean step time of rank 0's steps 5..steps (whole snapshot intervals) in a 4-worker job.
double StepTime(DriverArgs& d, int64_t bytes, const std::string& consistency,
                int64_t snapshot_every, int64_t steps, int64_t* rss_max, bool undo_copy = false) {
  Job job;
  WorkerArgs w{.bytes = bytes, .step_ms = d.step_ms, .consistency = consistency};
  const std::string tag = snapshot_every > 0 ? "cost-snap"
                          : undo_copy        ? "cost-undo"
                                             : "cost-" + consistency;
  morph::Status s = StartJob(job, d, tag, 4, w, snapshot_every,
                             {{4, morph::bench::ReconfigConfig(4, 1, 1)}}, undo_copy);
  if (!s.ok()) return -1;
  Events e;
  if (!WaitFor(
          [&] {
            e = ReadLogs(job.dir);
            for (const json& j : e.Of("step")) {
              if (j["rank"] == 0 && j["step"].get<int64_t>() >= steps) return true;
            }
            return false;
          },
          d.timeout_s)) {
    std::fprintf(stderr, "step_cost: the job did not finish %lld steps:%s\n",
                 static_cast<long long>(steps), ErrorsOf(e).c_str());
    return -1;
  }
  // Rank 0's steps, skipping the first 5 (warm-up); a whole number of snapshot intervals.
  std::vector<int64_t> ts;
  for (const json& j : e.Of("step")) {
    int64_t i = j["step"];
    if (j["rank"] == 0 && i >= 5 && i <= steps) ts.push_back(j["t"]);
  }
  std::sort(ts.begin(), ts.end());
  if (ts.size() < 2) return -1;
  for (const json& j : e.Of("mem")) *rss_max = std::max(*rss_max, j["rss"].get<int64_t>());
  return (ts.back() - ts.front()) / 1e9 / static_cast<double>(ts.size() - 1);
}

int RunStepCost(DriverArgs& d, int64_t bytes, int64_t snapshot_every, int trials,
                const std::string& variants) {
  const int64_t steps = 5 + 6 * std::max<int64_t>(snapshot_every, 10);  // last step timed
  std::vector<double> plain, bu, undo, snap;
  int64_t rss[4] = {0, 0, 0, 0};
  auto want = [&](const char* v) {
    return ("," + variants + ",").find(std::string(",") + v + ",") != std::string::npos;
  };
  for (int t = 0; t < trials; ++t) {  // interleaved, so that the load drifts over all of them
    plain.push_back(StepTime(d, bytes, "plain", 0, steps, &rss[0]));
    if (want("commit")) bu.push_back(StepTime(d, bytes, "commit", 0, steps, &rss[1]));
    if (want("undo")) undo.push_back(StepTime(d, bytes, "vote", 0, steps, &rss[3], true));
    if (want("snapshot")) {
      snap.push_back(StepTime(d, bytes, "commit", snapshot_every, steps, &rss[2]));
    }
  }
  for (const std::vector<double>* v : {&plain, &bu, &undo, &snap}) {
    if (std::any_of(v->begin(), v->end(), [](double x) { return x <= 0; })) return 1;
  }
  const double p = Median(plain), b = Median(bu), u = Median(undo), s = Median(snap);
  auto line = [&](const std::string& variant, double sec, json extra) {
    json j = {{"name", "consistency_cost/" + variant},
              {"bytes", bytes},
              {"seconds", sec},
              {"step_ms", d.step_ms},
              {"plain_step_seconds", p},
              {"overhead_vs_plain", sec / p - 1},
              {"target_overhead", 0.05},
              {"trials", trials}};
    j.update(extra);
    std::printf("%s\n", j.dump().c_str());
  };
  line("plain", p, {{"per_trial", plain}, {"worker_rss_max_bytes", rss[0]}});
  if (!bu.empty()) {
    line("commit_update", b, {{"per_trial", bu}, {"worker_rss_max_bytes", rss[1]}});
  }
  if (!undo.empty()) {
    line("begin_update+undo_copy", u,
         {{"per_trial", undo},
          {"worker_rss_max_bytes", rss[3]},
          {"rss_vs_plain", rss[0] > 0 ? static_cast<double>(rss[3]) / rss[0] : 0.0}});
  }
  if (!snap.empty()) {
    line("commit_update+snapshot", s,
         {{"snapshot_every", snapshot_every},
          {"per_trial", snap},
          {"worker_rss_max_bytes", rss[2]},
          {"rss_vs_plain", rss[0] > 0 ? static_cast<double>(rss[2]) / rss[0] : 0.0}});
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = std::getenv("MORPH_BENCH_VERBOSE") ? 0 : 1;
  bool worker = false;
  WorkerArgs w;
  DriverArgs d;
  int64_t bytes = int64_t{1} << 30, stall_bytes = int64_t{16} << 20,
          heal_bytes = int64_t{256} << 20, snapshot_every = 5;
  int trials = 3;
  std::string cases = "hybrid,snapshot,stall,heal,step_cost";
  std::string cost_variants = "commit,undo,snapshot";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    auto size = [&](int64_t& v) {
      auto b = morph::params::ParseBytes(a, next());
      if (!b.ok()) return false;
      v = static_cast<int64_t>(*b);
      return true;
    };
    bool ok = true;
    if (a == "--worker")
      worker = true;
    else if (a == "--bytes")
      ok = size(bytes);
    else if (a == "--stall-bytes")
      ok = size(stall_bytes);
    else if (a == "--heal-bytes")
      ok = size(heal_bytes);
    else if (a == "--zero-group")
      w.zero_group = std::atoi(next().c_str());
    else if (a == "--step-ms")
      w.step_ms = d.step_ms = std::atoll(next().c_str());
    else if (a == "--consistency")
      w.consistency = next();
    else if (a == "--steps")
      w.steps = std::atoll(next().c_str());
    else if (a == "--out")
      w.out = next();
    else if (a == "--cases")
      cases = next();
    else if (a == "--seed")
      d.rng.seed(std::strtoull(next().c_str(), nullptr, 10));
    else if (a == "--snapshot-every")
      snapshot_every = std::atoll(next().c_str());
    else if (a == "--cost-variants")
      cost_variants = next();
    else if (a == "--trials")
      trials = std::atoi(next().c_str());
    else if (a == "--timeout-s")
      d.timeout_s = std::atoll(next().c_str());
    else
      ok = false;
    if (!ok) {
      std::fprintf(stderr, "failures_bench: bad flag %s (see the header of failures_bench.cc)\n",
                   a.c_str());
      return 2;
    }
  }
  if (worker) {
    w.bytes = bytes;
    return Worker(w);
  }
  d.self = fs::canonical("/proc/self/exe").string();
  auto want = [&](const std::string& c) {
    return ("," + cases + ",").find("," + c + ",") != std::string::npos;
  };
  const ParallelConfig dp2 = morph::bench::ReconfigConfig(2, 1, 1);  // + 1 standby
  const ParallelConfig dp3 = morph::bench::ReconfigConfig(3, 1, 1);
  int rc = 0;
  if (want("hybrid")) rc |= RunFailure(d, {"hybrid", bytes, 2, 0, false, dp2});
  if (want("snapshot")) rc |= RunFailure(d, {"snapshot", bytes, 0, snapshot_every, false, dp3});
  if (want("stall")) rc |= RunFailure(d, {"stall", stall_bytes, 2, 0, false, dp2});
  if (want("heal")) rc |= RunFailure(d, {"heal", heal_bytes, 2, 0, true, dp2});
  if (want("step_cost")) rc |= RunStepCost(d, bytes, snapshot_every, trials, cost_variants);
  return rc;
}
