// End-to-end reconfiguration benchmark (issue 9, `make bench-runtime`): a job of real worker
// processes (this binary in worker mode) launched by the Launcher (morphrun), holding
// `--bytes` of unique state (parameters + Adam moments, ZeRO-1: parameters replicated over DP,
// moments sharded), is resized; we measure the resize request -> the first step at the new size
// on every new rank, each worker's phases (communicators, plan, transfer, resume), the stall
// (BeginStep(S) entry to return), bytes moved, peak state bytes, and the transport's raw
// bandwidth in the same run (a Gloo send/recv between two of the new ranks).
//
//   runtime_bench [--bytes 1GiB] [--changes dp4to2,dp2to4,tp2to1,pp2to1,grow1] [--grow-bytes
//   256MiB] runtime_bench --step-cost    (BeginStep + EndStep in a one-worker job)
//   runtime_bench --worker-cmd "python bench/torch/reconfig_worker.py" --label python ...
//                 (the workers are that program, given --bytes and --out: the Python package's
//                 worker for `make bench-torch`; its lines carry "workers": LABEL, default "cpp")
//
// One JSON object per line: {"name": "reconfigure", "change": "dp4to2", "bytes": ..., "seconds":
// <request -> first step>, "stall_seconds", "transfer_seconds", ..., "bytes_moved",
// "raw_bandwidth_bytes_per_s", "transfer_vs_raw", "raw_all_ranks_bytes_per_s" (every old rank
// sending 64 MiB to the next at once), "transfer_vs_raw_all_ranks", "all_ranks_memcpy_seconds"
// (every new rank at once memcpys the bytes that landed in its new shards, received + copied,
// between resident buffers; the slowest rank), "transfer_vs_memcpy_all_ranks" (that / the
// slowest transfer phase: same-host reshards, where the bytes go by shared memory),
// "shm_mapped_bytes" / "shm_vm_readv_bytes" (same-host bytes received from the senders' host
// arena by memcpy / by process_vm_readv, all ranks; MORPH_HOST_ARENA), "memory": {by phase, max over
// workers: before_bytes (old state), prepare_bytes (old + new shards pre-allocated before the
// switch step), switch_peak_bytes, after_bytes (new state), bound_bytes (max(old, new) + largest
// batch + staging), workers_over_bound (any phase above its worker's bound), and measured:
// measured_rss_extra_bytes_max (peak resident set from steady state through the change, VmHWM
// after a reset, minus the steady one) and its ratio to what the bound allows beyond the old
// state}}. ratio_vs_dcp and
// ratio_vs_cpp_baseline are added by bench/peers/run_runtime_bench.sh, which runs the peers in the
// same session.
#include <glog/logging.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "base/params.h"
#include "bench/reconfig_cases.h"
#include "morph/runtime.h"
#include "runtime/tools/launcher.h"

namespace {

namespace fs = std::filesystem;
using morph::DType;
using morph::Layout;
using morph::ParallelConfig;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Change {
  std::string name;
  ParallelConfig from, to;
};

// The changes every contender runs (bench/reconfig_cases.h).
std::vector<Change> AllChanges() {
  std::vector<Change> out;
  for (const morph::bench::ReconfigChange& c : morph::bench::ReconfigChanges()) {
    out.push_back({c.name, c.old_config, c.new_config});
  }
  return out;
}

// ---- worker mode ----------------------------------------------------------------------------

// "VmRSS" or "VmHWM" of this process, bytes (0 if unreadable).
int64_t StatusBytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key) + 1) * 1024;
  }
  return 0;
}

// Resets VmHWM to the current RSS (Linux: "5" to /proc/self/clear_refs).
void ResetPeakRss() {
  std::ofstream c("/proc/self/clear_refs");
  c << "5";
}

// The shared benchmark model (bench/reconfig_cases.h): parameters + Adam moments, ZeRO-1.
int Worker(int64_t unique_bytes, const std::string& out, int64_t steps) {
  const int64_t process_start_ns = NowNs();
  auto opts = morph::Options::FromEnv();
  if (!opts.ok()) return 4;
  opts->model = {.num_layers = morph::bench::kReconfigLayers, .tp_candidates = {1, 2},
                 .pp_candidates = {1, 2}, .global_batch = 16, .zero_stage = 1};
  opts->dataset_samples = 1 << 16;
  std::vector<morph::TensorSpec> model =
      morph::bench::ReconfigModel(static_cast<uint64_t>(unique_bytes));
  auto rt = morph::Runtime::Start(*opts, [&](morph::State& s) -> morph::Status {
    for (const morph::TensorSpec& t : model) {
      MORPH_RETURN_IF_ERROR(s.AddTensor(t.name, t.shape, t.dtype, t.layout));
    }
    return s.AddScalar("step", 8);
  });
  if (!rt.ok()) {
    std::fprintf(stderr, "worker: %s\n", std::string(rt.status().message()).c_str());
    return 4;
  }
  morph::Runtime& r = **rt;
  std::ofstream log(out + "/bench-" + std::to_string(r.worker_id()) + ".jsonl");
  int64_t steady_rss = 0;
  while (true) {
    auto step = r.BeginStep();
    if (!step.ok()) {
      std::fprintf(stderr, "worker: %s\n", std::string(step.status().message()).c_str());
      return 4;
    }
    if (step->done() || step->index() >= steps) break;
    // Raw bandwidth of the transport between ranks 0 and 1 (of the first generation at step 1,
    // of the new one at its first step), same run.
    auto raw_bandwidth = [&]() {
      double raw = 0;
      if (step->world_size() >= 2 && step->rank() < 2) {
        std::vector<char> buf(size_t{128} << 20);
        auto t = std::chrono::steady_clock::now();
        using K = morph::P2POp::Kind;
        morph::P2POp op{step->rank() == 0 ? K::kSend : K::kRecv, 1 - step->rank(), buf.data(),
                        buf.size()};
        morph::Status st = step->world().SendRecv({op}, std::chrono::milliseconds(60000));
        double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        if (st.ok()) raw = static_cast<double>(buf.size()) / sec;
      }
      return raw;
    };
    if (step->index() == 1 && step->generation() == 1) {
      double raw = raw_bandwidth();
      if (raw > 0) log << "{\"generation\":1,\"raw_bandwidth\":" << raw << "}\n";
      // Every rank at once: rank r sends 64 MiB to r+1 and receives 64 MiB from r-1 (Gloo p2p),
      // so that every process moves bytes concurrently on the shared cores, as in a reshard.
      if (step->world_size() >= 2) {
        const int w = step->world_size(), me = step->rank();
        std::vector<char> out(size_t{64} << 20), in(size_t{64} << 20);
        std::memset(out.data(), 1, out.size());
        std::memset(in.data(), 0, in.size());
        using K = morph::P2POp::Kind;
        (void)step->world().Barrier(std::chrono::milliseconds(60000));
        auto t = std::chrono::steady_clock::now();
        morph::Status st =
            step->world().SendRecv({morph::P2POp{K::kSend, (me + 1) % w, out.data(), out.size()},
                                    morph::P2POp{K::kRecv, (me + w - 1) % w, in.data(), in.size()}},
                                   std::chrono::milliseconds(60000));
        double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        if (st.ok()) {
          log << "{\"generation\":1,\"raw_ring_bytes\":" << in.size()
              << ",\"raw_ring_seconds\":" << sec << "}\n";
        }
      }
    }
    // Measured memory: the resident set at steady state (after the raw-bandwidth buffers of step
    // 1 are gone), and its peak from then through the change (prepare, switch), read at the first
    // step of the new generation.
    if (step->index() == 2 && step->generation() == 1) {
      ResetPeakRss();
      steady_rss = StatusBytes("VmRSS:");
    }
    if (step->reconfigured() && r.last_reconfiguration()) {
      const morph::Reconfiguration& last = *r.last_reconfiguration();
      const int64_t peak_rss = StatusBytes("VmHWM:"), after_rss = StatusBytes("VmRSS:");
      int64_t first_step_ns = NowNs();
      double raw = raw_bandwidth();
      // Every new rank at once: a memcpy of the bytes that landed in its new shards here
      // (received + copied locally) between two resident buffers, between barriers of the new
      // world: the copy a same-host reshard cannot beat, on the same shared cores.
      const int64_t landing = last.bytes_received + last.bytes_copied;
      double memcpy_sec = 0;
      {
        std::vector<char> src(static_cast<size_t>(landing), 1), dst(static_cast<size_t>(landing));
        std::memset(dst.data(), 0, dst.size());
        (void)step->world().Barrier(std::chrono::milliseconds(60000));
        auto t = std::chrono::steady_clock::now();
        if (landing > 0) std::memcpy(dst.data(), src.data(), src.size());
        memcpy_sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        (void)step->world().Barrier(std::chrono::milliseconds(60000));
      }
      log << "{\"worker\":" << r.worker_id() << ",\"generation\":" << last.generation
          << ",\"old_rank\":" << last.old_rank << ",\"process_start_ns\":" << process_start_ns
          << ",\"rank\":" << last.rank << ",\"first_step_ns\":" << first_step_ns
          << ",\"communicators\":" << last.communicators_seconds
          << ",\"plan\":" << last.plan_seconds << ",\"transfer\":" << last.transfer_seconds
          << ",\"resume\":" << last.resume_seconds << ",\"stall\":" << last.stall_seconds
          << ",\"bytes_received\":" << last.bytes_received << ",\"bytes_sent\":" << last.bytes_sent
          << ",\"landing_bytes\":" << landing << ",\"memcpy_seconds\":" << memcpy_sec
          << ",\"shm_mapped_bytes\":" << last.shm_mapped_bytes
          << ",\"shm_vm_readv_bytes\":" << last.shm_vm_readv_bytes
          << ",\"raw_bandwidth\":" << raw << ",\"local_bytes\":" << r.state().local_bytes()
          << ",\"peak_bytes\":" << last.peak_bytes << ",\"bound_bytes\":" << last.bound_bytes
          << ",\"old_state_bytes\":" << last.old_state_bytes
          << ",\"prepare_bytes\":" << last.prepare_bytes << ",\"new_state_bytes\":"
          << last.new_state_bytes
          // Resident bytes beyond steady state at the peak (survivors only: a joiner has none).
          << ",\"rss_extra_bytes\":" << (steady_rss > 0 ? peak_rss - steady_rss : 0)
          << ",\"rss_after_extra_bytes\":" << (steady_rss > 0 ? after_rss - steady_rss : 0)
          << "}\n";
      log.flush();
    }
    int64_t one = 1;
    (void)step->world().Allreduce(&one, 1, DType::kI64, morph::ReduceOp::kSum,
                                  std::chrono::milliseconds(60000));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!r.EndStep().ok()) return 4;
  }
  return r.Finish().ok() ? 0 : 4;
}

// ---- driver mode ----------------------------------------------------------------------------

struct Parsed {
  std::map<std::string, double> max;  // per field, over workers
  double sum_received = 0;
  // Same-host bytes received by path (mapped from the sender's host arena / process_vm_readv).
  double sum_shm_mapped = 0, sum_shm_vm_readv = 0;
  int64_t last_first_step_ns = 0;
  int64_t joiner_start_to_first_step_ns = 0;  // the slowest joiner's
  int workers = 0;
  double raw = 0;
  // All old ranks at once (ring of Gloo p2p): bytes received in all / the slowest rank's time.
  double ring_bytes = 0, ring_seconds = 0;
  // Workers whose accounted state in some phase (prepare, switch, after) exceeded their bound,
  // and the largest measured resident growth over what the bound allows beyond the old state
  // (rss_extra / (bound - old state): above 1 means more resident memory than the accounting).
  int over_bound = 0;
  double rss_extra_vs_allowed = 0;
};

Parsed ReadLogs(const fs::path& dir, int64_t generation) {
  Parsed p;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".jsonl") continue;
    std::ifstream in(e.path());
    std::string line;
    while (std::getline(in, line)) {
      auto field = [&](const std::string& k) {
        size_t at = line.find("\"" + k + "\":");
        return at == std::string::npos ? 0.0 : std::atof(line.c_str() + at + k.size() + 3);
      };
      p.raw = std::max(p.raw, field("raw_bandwidth"));  // any generation
      if (line.find("raw_ring_bytes") != std::string::npos) {
        p.ring_bytes += field("raw_ring_bytes");
        p.ring_seconds = std::max(p.ring_seconds, field("raw_ring_seconds"));
        continue;
      }
      if (static_cast<int64_t>(field("generation")) != generation) continue;
      ++p.workers;
      for (const char* k :
           {"communicators", "plan", "transfer", "resume", "stall", "raw_bandwidth", "local_bytes",
            "peak_bytes", "bound_bytes", "old_state_bytes", "prepare_bytes", "new_state_bytes",
            "rss_extra_bytes", "rss_after_extra_bytes", "memcpy_seconds"}) {
        p.max[k] = std::max(p.max[k], field(k));
      }
      p.sum_received += field("bytes_received");
      p.sum_shm_mapped += field("shm_mapped_bytes");
      p.sum_shm_vm_readv += field("shm_vm_readv_bytes");
      const double bound = field("bound_bytes");
      if (std::max({field("prepare_bytes"), field("peak_bytes"), field("new_state_bytes")}) >
          bound) {
        ++p.over_bound;
      }
      if (bound > field("old_state_bytes") && field("old_state_bytes") > 0) {
        p.rss_extra_vs_allowed = std::max(
            p.rss_extra_vs_allowed, field("rss_extra_bytes") / (bound - field("old_state_bytes")));
      }
      p.last_first_step_ns =
          std::max(p.last_first_step_ns, static_cast<int64_t>(field("first_step_ns")));
      if (field("old_rank") < 0) {
        p.joiner_start_to_first_step_ns =
            std::max(p.joiner_start_to_first_step_ns,
                     static_cast<int64_t>(field("first_step_ns") - field("process_start_ns")));
      }
    }
  }
  return p;
}

// The workers' command (argv before --bytes/--out): this binary's worker mode, or --worker-cmd.
struct WorkerCommand {
  std::vector<std::string> argv;
  std::string label = "cpp";
};

int Drive(const WorkerCommand& cmd, const Change& c, int64_t bytes) {
  fs::path dir = fs::temp_directory_path() / ("morph-rtbench-" + c.name + "-" +
                                              std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  morph::LauncherOptions o;
  o.workers = c.from.world();
  o.argv = cmd.argv;
  for (const std::string& a : {std::string("--bytes"), std::to_string(bytes), std::string("--out"),
                               dir.string()}) {
    o.argv.push_back(a);
  }
  o.log_dir = dir.string();
  o.env = {{"MORPH_HEARTBEAT_MS", "20"}};
  o.coordinator.serve_http = false;
  std::map<int, ParallelConfig> configs = {{c.from.world(), c.from}, {c.to.world(), c.to}};
  o.coordinator.policy = [configs](int n, const ParallelConfig*,
                                   const morph::ModelConstraints&) -> std::optional<ParallelConfig> {
    auto it = configs.upper_bound(n);
    if (it == configs.begin()) return std::nullopt;
    return std::prev(it)->second;
  };
  auto launcher = morph::Launcher::Start(std::move(o));
  if (!launcher.ok()) {
    std::fprintf(stderr, "%s\n", std::string(launcher.status().message()).c_str());
    return 1;
  }
  morph::Coordinator& coord = (*launcher)->coordinator();
  auto wait = [&](auto pred, int64_t ms) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < until) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  };
  if (!wait([&] { return coord.Snapshot().step >= 3; }, 300000)) {
    std::fprintf(stderr, "%s: the job did not reach step 3\n", c.name.c_str());
    return 1;
  }
  morph::ResizeRequest req;
  if (c.to.world() > c.from.world()) {
    req.add = c.to.world() - c.from.world();
  } else {
    req.world_size = c.to.world();
  }
  req.reason = "bench";
  int64_t t0 = NowNs();
  morph::Status s = coord.Resize(req, morph::Deadline::AfterMs(10000));
  if (!s.ok()) {
    std::fprintf(stderr, "%s: resize: %s\n", c.name.c_str(), std::string(s.message()).c_str());
    return 1;
  }
  Parsed p;
  bool ok = wait([&] {
    p = ReadLogs(dir, 2);
    return p.workers >= c.to.world();
  }, 300000);
  (void)coord.Resize(morph::ResizeRequest{.world_size = c.to.world(), .reason = "end"},
                     morph::Deadline::AfterMs(100));
  (*launcher)->Signal(SIGTERM);
  (void)(*launcher)->Wait(morph::Deadline::AfterMs(30000));
  launcher->reset();
  if (!ok) {
    std::fprintf(stderr, "%s: the new generation did not start\n", c.name.c_str());
    return 1;
  }
  double total = static_cast<double>(p.last_first_step_ns - t0) / 1e9;
  if (c.name == "grow1") {
    std::printf("{\"name\":\"grow_one_joiner\",\"change\":\"dp2to3\",\"bytes\":%lld,"
                "\"seconds\":%.4f,\"request_to_first_step_seconds\":%.4f,\"target_seconds\":1.0,"
                "\"torchft_heal_seconds_reported\":\"3.7-5.9\"}\n",
                static_cast<long long>(bytes),
                static_cast<double>(p.joiner_start_to_first_step_ns) / 1e9, total);
    std::fflush(stdout);
    if (!std::getenv("MORPH_BENCH_KEEP")) fs::remove_all(dir);
    return 0;
  }
  double transfer_bw = p.max["transfer"] > 0 ? p.sum_received / p.max["transfer"] : 0;
  const double ring = p.ring_seconds > 0 ? p.ring_bytes / p.ring_seconds : 0;
  std::printf(
      "{\"name\":\"reconfigure\",\"workers\":\"%s\",\"change\":\"%s\",\"bytes\":%lld,\"seconds\":%.4f,"
      "\"stall_seconds\":%.4f,\"communicators_seconds\":%.4f,\"plan_seconds\":%.4f,"
      "\"transfer_seconds\":%.4f,\"resume_seconds\":%.4f,\"stall_minus_transfer_seconds\":%.4f,"
      "\"bytes_moved\":%.0f,\"raw_bandwidth_bytes_per_s\":%.0f,\"transfer_bandwidth_bytes_per_s\":"
      "%.0f,\"transfer_vs_raw\":%.3f,\"raw_all_ranks_bytes_per_s\":%.0f,"
      "\"transfer_vs_raw_all_ranks\":%.3f,\"all_ranks_memcpy_seconds\":%.4f,"
      "\"transfer_vs_memcpy_all_ranks\":%.3f,\"shm_mapped_bytes\":%.0f,\"shm_vm_readv_bytes\":%.0f,"
      "\"peak_bytes_max\":%.0f,\"bound_bytes_max\":%.0f,"
      "\"memory\":{\"before_bytes_max\":%.0f,\"prepare_bytes_max\":%.0f,\"switch_peak_bytes_max\":"
      "%.0f,\"after_bytes_max\":%.0f,\"bound_bytes_max\":%.0f,\"workers_over_bound\":%d,"
      "\"measured_rss_extra_bytes_max\":%.0f,\"measured_rss_extra_vs_bound_allowance\":%.3f}}\n",
      cmd.label.c_str(), c.name.c_str(), static_cast<long long>(bytes), total, p.max["stall"],
      p.max["communicators"],
      p.max["plan"], p.max["transfer"], p.max["resume"], p.max["stall"] - p.max["transfer"],
      p.sum_received, p.raw, transfer_bw, p.raw > 0 ? transfer_bw / p.raw : 0.0, ring,
      ring > 0 ? transfer_bw / ring : 0.0, p.max["memcpy_seconds"],
      p.max["transfer"] > 0 ? p.max["memcpy_seconds"] / p.max["transfer"] : 0.0, p.sum_shm_mapped,
      p.sum_shm_vm_readv, p.max["peak_bytes"], p.max["bound_bytes"],
      p.max["old_state_bytes"], p.max["prepare_bytes"], p.max["peak_bytes"],
      p.max["new_state_bytes"], p.max["bound_bytes"], p.over_bound, p.max["rss_extra_bytes"],
      p.rss_extra_vs_allowed);
  std::fflush(stdout);
  if (!std::getenv("MORPH_BENCH_KEEP")) fs::remove_all(dir);  // keep: logs for a look
  return 0;
}

// BeginStep + EndStep in a one-worker job: the steady-state cost.
int StepCost() {
  auto opts = morph::Options::FromEnv();
  if (!opts.ok()) return 4;
  opts->model.global_batch = 8;
  opts->bootstrap = morph::Bootstrap::kHost;
  opts->initial_world = 1;
  auto rt = morph::Runtime::Start(*opts, [](morph::State& s) {
    return s.AddTensor("w", {64, 64}, DType::kF32, Layout::Layer(0));
  });
  if (!rt.ok()) {
    std::fprintf(stderr, "%s\n", std::string(rt.status().message()).c_str());
    return 4;
  }
  const int64_t n = 2000000;
  auto t = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    auto step = (*rt)->BeginStep();
    if (!step.ok() || !(*rt)->EndStep().ok()) return 4;
  }
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  std::printf("{\"name\":\"step_cost\",\"bytes\":0,\"seconds\":%.6f,\"steps\":%lld,"
              "\"ns_per_step\":%.1f,\"target_ns\":2000}\n",
              sec, static_cast<long long>(n), sec / static_cast<double>(n) * 1e9);
  return (*rt)->Finish().ok() ? 0 : 4;
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = std::getenv("MORPH_BENCH_VERBOSE") ? 0 : 1;
  bool worker = false, step_cost = false;
  int64_t bytes = int64_t{1} << 30, steps = 1 << 30, grow_bytes = int64_t{256} << 20;
  std::string out = ".", changes = "dp4to2,dp2to4,tp2to1,pp2to1,grow1";
  WorkerCommand cmd;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--worker") worker = true;
    else if (a == "--step-cost") step_cost = true;
    else if (a == "--bytes") {
      auto b = morph::params::ParseBytes("--bytes", next());
      if (!b.ok()) return 2;
      bytes = static_cast<int64_t>(*b);
    } else if (a == "--grow-bytes") {
      auto b = morph::params::ParseBytes("--grow-bytes", next());
      if (!b.ok()) return 2;
      grow_bytes = static_cast<int64_t>(*b);
    } else if (a == "--out") out = next();
    else if (a == "--changes") changes = next();
    else if (a == "--worker-cmd") {
      std::istringstream words(next());
      for (std::string w; words >> w;) cmd.argv.push_back(w);
    } else if (a == "--label") cmd.label = next();
    else if (a == "--steps") steps = std::atoll(next().c_str());
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (worker) return Worker(bytes, out, steps);
  if (step_cost) return StepCost();
  if (cmd.argv.empty()) cmd.argv = {fs::canonical("/proc/self/exe").string(), "--worker"};
  int rc = 0;
  std::vector<Change> all = AllChanges();
  // Grow by one joiner (issue 9: joiner process start -> first step at the new size).
  all.push_back({"grow1", morph::bench::ReconfigConfig(2, 1, 1),
                 morph::bench::ReconfigConfig(3, 1, 1)});
  for (const Change& c : all) {
    if (("," + changes + ",").find("," + c.name + ",") == std::string::npos) continue;
    int64_t b = c.name == "grow1" ? grow_bytes : bytes;
    rc |= Drive(cmd, c, b);
  }
  return rc;
}
