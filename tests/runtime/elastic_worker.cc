// The worker program of the multi-process runtime tests (elastic_test.cc) and of morphrun's
// tests: registers tensors whose every element is a known function of its global index and of
// the steps trained, trains by adding 1 to every element each step, and checks at every step
// that its shards hold exactly the expected slice, that the scalar state equals the step, and
// that the world communicator spans the generation. It logs the samples it consumed so the test
// can check the sequence against the fixed global order.
//
//   elastic_worker --steps N --out DIR [--step-ms MS] [--exit-at-step K] [--variant V]
//                  [--configs W:DPxTPxPP,...]
//
// --configs: the config policy of a coordinator this worker hosts (mpirun rank 0): for W workers
// the config listed for the largest W' <= W (none listed: the planner's default), as the
// Launcher-driven tests give their Launcher (Options::config_policy, the user callback).
// --variant big adds a 1 MiB ZeRO tensor (the host arena test); --variant shape registers l1.b
// with another shape (the registration-agreement test: such a
// worker is refused at Start); --variant hybrid2 shards the ZeRO tensors in DP groups of 2
// (hybrid ZeRO: every piece has a replica while dp >= 4; the failures tests).
// --drop-vote-at S [--fault-rank R] (default rank 0): the worker holding rank R at step S of
// the job's first generation loses the result of its commit vote of S although every rank voted
// (testing_hooks::DropCommitVoteResult); --die-before-vote-at S: that worker exits (code 9)
// right before its vote of S.
//
// Failures (the failures tests kill workers with SIGKILL at random moments): a step's collective
// that fails ends the step with AbortStep and the loop goes on at the step BeginStep returns
// (the recovery's). Runtime::CommitUpdate is the step's commit vote; the update after it is
// local. A step's samples are logged once consumed (after the first
// collective), with the generation (a step trained again after a recovery appears again, in a
// later one); a step that any worker completed was logged by every DP rank (the vote needs
// them all).
//
// Exit codes: 0 done (or left the job), 2 usage, 3 wrong data, 4 runtime error.
#include <glog/logging.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "morph/runtime.h"
#include "runtime/api/test_hooks.h"

namespace {

using morph::DType;
using morph::Layout;

struct TensorDef {
  const char* name;
  std::vector<int64_t> shape;
  Layout layout;
};

// `zero_group` > 0: the ZeRO tensors are hybrid-sharded in DP groups of that size (replicated
// across groups), so that a worker's death loses no piece.
std::vector<TensorDef> Tensors(bool other_shape, int zero_group) {
  auto zero = [&](Layout l) { return zero_group > 0 ? l.ZeroShard(zero_group) : l.ZeroShard(); };
  return {
      {"l0.w", {8, 12}, Layout::Layer(0).SplitTP(1)},
      {"l0.adam_m", {8, 12}, zero(Layout::Layer(0).SplitTP(1))},
      {"l1.w", {12, 8}, Layout::Layer(1).SplitTP(0)},
      {"l1.b", {other_shape ? 10 : 8}, Layout::Layer(1)},
      {"l1.adam_v", {12, 8}, zero(Layout::Layer(1).SplitTP(0))},
      {"l3.w", {6, 10}, zero(Layout::Layer(3).SplitTP(0))},
  };
}

// Value of global flat element `i` of tensor `k` after `steps` steps.
float Expected(size_t k, int64_t i, int64_t steps) {
  return static_cast<float>(static_cast<int64_t>(k) * 1000 + i + steps);
}

// Calls fn(local index, global flat index) for every element of the shard.
template <typename Fn>
void ForEach(const morph::State::TensorRef& t, Fn fn) {
  const morph::Box& frame = t.shard.frame;
  const std::vector<int64_t>& shape = t.spec->shape;
  const int rank = frame.rank();
  std::vector<int64_t> extent(rank);
  for (int d = 0; d < rank; ++d) extent[d] = frame.dim(d).size();
  for (int64_t j = 0; j < t.shard.NumElements(); ++j) {
    int64_t f = t.shard.flat_begin + j;  // row-major within the frame
    int64_t global = 0;
    int64_t rest = f;
    std::vector<int64_t> idx(rank);
    for (int d = rank - 1; d >= 0; --d) {
      idx[d] = rest % extent[d] + frame.dim(d).begin;
      rest /= extent[d];
    }
    for (int d = 0; d < rank; ++d) global = global * shape[d] + idx[d];
    fn(j, global);
  }
}

// "4:2x2x1,8:8x1x1" -> {4: dp 2 tp 2 pp 1, 8: ...} (4 layers, evenly staged); nullopt when
// malformed.
std::optional<std::map<int, morph::ParallelConfig>> ParseConfigs(const std::string& text) {
  std::map<int, morph::ParallelConfig> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    int world = 0;
    morph::ParallelConfig c;
    char colon = 0, x1 = 0, x2 = 0;
    std::istringstream i(item);
    if (!(i >> world >> colon >> c.dp >> x1 >> c.tp >> x2 >> c.pp) || colon != ':' || x1 != 'x' ||
        x2 != 'x' || !i.eof()) {
      return std::nullopt;
    }
    auto stages = morph::ParallelConfig::EvenStages(4, c.pp);
    if (!stages.ok()) return std::nullopt;
    c.stage_of_layer = *stages;
    out[world] = c;
  }
  return out;
}

int Fail(int code, const std::string& why) {
  std::fprintf(stderr, "elastic_worker %d: %s\n", getpid(), why.c_str());
  std::fflush(stderr);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  int64_t steps = 20, step_ms = 20, exit_at = -1, drop_vote_at = -1, die_before_vote_at = -1;
  int fault_rank = 0;
  std::string out = ".", variant, configs;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    // clang-format off
    if (a == "--steps") steps = std::atoll(argv[i + 1]);
    else if (a == "--out") out = argv[i + 1];
    else if (a == "--step-ms") step_ms = std::atoll(argv[i + 1]);
    else if (a == "--exit-at-step") exit_at = std::atoll(argv[i + 1]);
    else if (a == "--variant") variant = argv[i + 1];
    else if (a == "--drop-vote-at") drop_vote_at = std::atoll(argv[i + 1]);
    else if (a == "--die-before-vote-at") die_before_vote_at = std::atoll(argv[i + 1]);
    else if (a == "--fault-rank") fault_rank = std::atoi(argv[i + 1]);
    else if (a == "--configs") configs = argv[i + 1];
    else return Fail(2, "unknown flag " + a);
    // clang-format on
  }
  auto opts = morph::Options::FromEnv();
  if (!opts.ok()) return Fail(4, std::string(opts.status().message()));
  opts->model = {.num_layers = 4, .num_heads = 0, .tp_candidates = {1, 2}, .pp_candidates = {1, 2},
                 .global_batch = 12, .micro_batches = 1};
  opts->dataset_samples = 48;  // an epoch every 4 steps
  opts->dataset_seed = 7;
  opts->micro_batch = 2;
  if (!variant.empty() && variant != "shape" && variant != "hybrid2" && variant != "big") {
    return Fail(2, "unknown --variant " + variant);
  }
  if (!configs.empty()) {
    auto table = ParseConfigs(configs);
    if (!table) return Fail(2, "bad --configs " + configs);
    opts->config_policy =
        [table = *table](int n, const morph::ParallelConfig*,
                         const morph::ModelConstraints&) -> std::optional<morph::ParallelConfig> {
      auto it = table.upper_bound(n);
      if (it == table.begin()) return std::nullopt;
      return std::prev(it)->second;
    };
  }
  std::vector<TensorDef> defs = Tensors(variant == "shape", variant == "hybrid2" ? 2 : 0);
  // --variant big: one more tensor of 1 MiB, ZeRO-sharded, whose pieces travel as single
  // contiguous messages straight from the old shards where messages are smaller than its
  // pieces (MORPH_RESHARD_CHUNK_BYTES; the small tensors' pieces are packed into staging).
  if (variant == "big") defs.push_back({"big.adam_m", {512, 512}, Layout::Layer(2).ZeroShard()});
  auto rt = morph::Runtime::Start(*opts, [&](morph::State& s) -> morph::Status {
    for (const TensorDef& d : defs) {
      MORPH_RETURN_IF_ERROR(s.AddTensor(d.name, d.shape, DType::kF32, d.layout));
    }
    return s.AddScalar("counter", sizeof(int64_t));
  });
  if (!rt.ok()) return Fail(4, "Start: " + rt.status().ToString());
  morph::Runtime& r = **rt;
  morph::State& state = r.state();
  auto fill = [&](int64_t done_steps) {
    for (size_t k = 0; k < defs.size(); ++k) {
      auto t = state.tensor(defs[k].name);
      if (!t.ok()) return false;
      float* p = static_cast<float*>(t->data.data);
      ForEach(*t, [&](int64_t j, int64_t g) { p[j] = Expected(k, g, done_steps); });
    }
    auto c = state.scalar("counter");
    if (!c.ok()) return false;
    std::memcpy(c->data(), &done_steps, sizeof(done_steps));
    return true;
  };
  if (r.fresh_start() && !fill(r.next_step())) return Fail(4, "cannot fill the state");
  if (const auto& first = r.last_reconfiguration(); first && first->resumed) {
    // A restarted job (MORPH_RESUME): the state came from a checkpoint; checked below.
    std::fprintf(stderr, "elastic_worker %ld: resumed at step %ld from checkpoint %s\n",
                 static_cast<long>(r.worker_id()), static_cast<long>(r.next_step()),
                 first->checkpoint.c_str());
  }
  std::ofstream log(out + "/worker-" + std::to_string(r.worker_id()) + ".samples");
  int64_t generations = 0, aborted_steps = 0, recoveries = 0, lost_steps = 0;
  r.OnReconfigure([&](const morph::Reconfiguration& c) {
    ++generations;
    if (c.recovery) {
      ++recoveries;
      lost_steps += c.lost_steps();
      std::fprintf(stderr,
                   "elastic_worker %ld: recovered at step %ld from %s (newest %ld, %ld steps "
                   "lost, %s state), abort %.3f s\n",
                   static_cast<long>(r.worker_id()), static_cast<long>(c.step),
                   c.source == morph::RecoverySource::kCheckpoint ? "checkpoint"
                   : c.source == morph::RecoverySource::kSnapshot ? "snapshots"
                                                                             : "replicas",
                   static_cast<long>(c.newest_step), static_cast<long>(c.lost_steps()),
                   c.stale ? "stale" : "own", c.abort_seconds);
    }
    std::fprintf(stderr,
                 "elastic_worker %ld: gen %ld rank %d %s at step %ld stall %.3f s received %ld "
                 "shm_mapped %ld shm_vm_readv %ld\n",
                 static_cast<long>(r.worker_id()), static_cast<long>(c.generation), c.rank,
                 c.config.ToString().c_str(), static_cast<long>(c.step), c.stall_seconds,
                 static_cast<long>(c.bytes_received), static_cast<long>(c.shm_mapped_bytes),
                 static_cast<long>(c.shm_vm_readv_bytes));
  });
  while (true) {
    auto step = r.BeginStep();
    if (!step.ok()) return Fail(4, "BeginStep: " + step.status().ToString());
    if (step->done()) break;
    const int64_t s = step->index();
    if (s >= steps) {
      (void)r.EndStep();
      break;
    }
    // The state is exactly the slice of the step's values.
    for (size_t k = 0; k < defs.size(); ++k) {
      auto t = state.tensor(defs[k].name);
      if (!t.ok()) return Fail(3, std::string(t.status().message()));
      const float* p = static_cast<const float*>(t->data.data);
      std::string bad;
      ForEach(*t, [&](int64_t j, int64_t g) {
        if (bad.empty() && p[j] != Expected(k, g, s)) {
          bad = std::string(defs[k].name) + " element " + std::to_string(g) + " = " +
                std::to_string(p[j]) + ", expected " + std::to_string(Expected(k, g, s));
        }
      });
      if (!bad.empty()) return Fail(3, "step " + std::to_string(s) + ": " + bad);
    }
    auto c = state.scalar("counter");
    int64_t counter = 0;
    std::memcpy(&counter, c->data(), sizeof(counter));
    if (counter != s) {
      return Fail(3, "step " + std::to_string(s) + ": scalar counter " + std::to_string(counter));
    }
    // The world spans the generation; every rank is at the same step.
    int64_t vals[2] = {1, s};
    morph::Status st = step->world().Allreduce(vals, 2, DType::kI64, morph::ReduceOp::kSum,
                                               std::chrono::milliseconds(60000));
    if (!st.ok()) {
      // A peer failed (or the runtime aborted the collective for a recovery): this step did
      // not happen; BeginStep recovers.
      morph::Status a = r.AbortStep(st);
      if (!a.ok()) return Fail(4, "AbortStep: " + a.ToString());
      ++aborted_steps;
      continue;
    }
    if (vals[0] != step->world_size() || vals[1] != s * step->world_size()) {
      return Fail(3, "step " + std::to_string(s) + ": world allreduce " + std::to_string(vals[0]) +
                         "/" + std::to_string(vals[1]));
    }
    auto coords = step->coords();
    if (coords.t == 0 && coords.p == 0) {
      log << s << " " << step->generation() << " " << step->config().dp << " " << coords.d;
      for (int64_t x : step->samples()) log << " " << x;
      log << "\n";
      log.flush();
    }
    if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
    // The commit vote (TorchFT's should_commit): every rank is ready to update. Only after it
    // does the state change, locally. A vote that failed here but passed elsewhere returns OK
    // after the recovery decided (the update is applied, and the recovery resumes after it).
    const bool faulty = step->generation() == 1 && step->rank() == fault_rank;
    if (faulty && s == drop_vote_at) morph::testing_hooks::DropCommitVoteResult(s);
    if (faulty && s == die_before_vote_at) _exit(9);
    st = r.CommitUpdate();
    if (!st.ok()) {
      if (st.code() != morph::StatusCode::kAborted)
        return Fail(4, "CommitUpdate: " + st.ToString());
      ++aborted_steps;
      continue;
    }
    // "Train": every element and the counter advance by one.
    for (size_t k = 0; k < defs.size(); ++k) {
      auto t = state.tensor(defs[k].name);
      float* p = static_cast<float*>(t->data.data);
      for (int64_t j = 0; j < t->shard.NumElements(); ++j) p[j] += 1;
    }
    ++counter;
    std::memcpy(c->data(), &counter, sizeof(counter));
    if (exit_at >= 0 && s == exit_at) _exit(9);  // dies without a word (the failures tests)
    morph::Status e = r.EndStep();
    if (!e.ok()) return Fail(4, std::string(e.message()));
  }
  morph::Status f = r.Finish();
  if (!f.ok()) return Fail(4, "Finish: " + std::string(f.message()));
  std::fprintf(stderr,
               "elastic_worker %ld: finished at step %ld after %ld reconfigurations (%ld "
               "recoveries, %ld steps aborted, %ld lost)\n",
               static_cast<long>(r.worker_id()), static_cast<long>(r.next_step()),
               static_cast<long>(generations), static_cast<long>(recoveries),
               static_cast<long>(aborted_steps), static_cast<long>(lost_steps));
  return 0;
}
