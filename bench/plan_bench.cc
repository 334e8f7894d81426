// plan_bench: the planner's cost for a GPT-3-175B-like model (96 layers, hidden 12288, 12
// tensors per layer plus two Adam moments each, ZeRO-1) for DP, TP and PP changes at 1,024,
// 4,096 and 16,384 ranks. One JSON object per line:
//   name, bytes (state bytes of the new config), seconds (per-participant plan time: the shared
//   assignment plus the slowest sampled participant's PlanFor; target < 0.05 at 16,384),
//   bytes_moved (Σ of every participant's recvs, or of the sampled ones with --quick),
//   bytes_lower_bound, ratio (moved / lower bound), bytes_moved_naive and ratio_vs_naive (the
//   lower bound when survivors keep their order instead of the optimized assignment).
//
//   plan_bench            every participant planned at 1,024 and 4,096 ranks, sampled above
//   plan_bench --quick    64 sampled participants everywhere (bytes_moved over the sample)
// Then (not with --quick) assign_quality_* lines: the structured assignment's resident bytes
// against the exact (Hungarian) assignment's at 128 ranks: ratio = structured / exact.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "reshard/plan.h"

namespace morph {
namespace {

constexpr int64_t kHidden = 12288;
constexpr int64_t kVocab = 51200;  // 50257 padded to a multiple of 1024
constexpr int kLayers = 96;

std::vector<TensorSpec> Gpt175B() {
  std::vector<TensorSpec> t;
  const int64_t h = kHidden;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, int layer, int tp_dim) {
    Layout l = Layout::Layer(layer).SplitTP(tp_dim);
    t.push_back({name, DType::kBF16, shape, l});
    t.push_back({name + ".adam_m", DType::kF32, shape, l.ZeroShard()});
    t.push_back({name + ".adam_v", DType::kF32, shape, l.ZeroShard()});
  };
  add("embed.weight", {kVocab, h}, 0, 0);
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn.qkv.weight", {3 * h, h}, l, 0);
    add(p + "attn.qkv.bias", {3 * h}, l, 0);
    add(p + "attn.proj.weight", {h, h}, l, 1);
    add(p + "attn.proj.bias", {h}, l, -1);
    add(p + "ln1.weight", {h}, l, -1);
    add(p + "ln1.bias", {h}, l, -1);
    add(p + "mlp.fc1.weight", {4 * h, h}, l, 0);
    add(p + "mlp.fc1.bias", {4 * h}, l, 0);
    add(p + "mlp.fc2.weight", {h, 4 * h}, l, 1);
    add(p + "mlp.fc2.bias", {h}, l, -1);
    add(p + "ln2.weight", {h}, l, -1);
    add(p + "ln2.bias", {h}, l, -1);
  }
  add("final_ln.weight", {h}, kLayers - 1, -1);
  return t;
}

ParallelConfig Config(int dp, int tp, int pp) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp, .zero_stage = 1};
  c.stage_of_layer = *ParallelConfig::EvenStages(kLayers, pp);
  return c;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Case {
  std::string name;
  ParallelConfig old_config, new_config;
  int leavers = 0;  // the last `leavers` old ranks leave gracefully
};

void Run(const Case& c, const std::vector<TensorSpec>& tensors, bool quick) {
  PlanInput in;
  in.tensors = tensors;
  in.old_config = c.old_config;
  in.new_config = c.new_config;
  const int old_world = c.old_config.world();
  for (int r = 0; r < old_world; ++r) in.old_participant_of_rank.push_back(r);
  // A node (8 consecutive ranks = one TP group of stage 0... spread) leaves: the first DP
  // replica's ranks of stage 0, so the survivors' numbering shifts.
  for (int r = 0; r < old_world; ++r) {
    const auto co = c.old_config.CoordsOf(r);
    const bool leaves = c.leavers > 0 && co.p == 0 && co.d == 0 && co.t < c.leavers;
    if (!leaves) in.available.push_back(r);
  }
  int32_t next = old_world;
  while (static_cast<int>(in.available.size()) < c.new_config.world())
    in.available.push_back(next++);
  in.num_participants = next;

  const double t0 = Now();
  auto planner = Planner::Create(in);
  const double create_s = Now() - t0;
  if (!planner.ok()) {
    std::fprintf(stderr, "%s: %s\n", c.name.c_str(), planner.status().ToString().c_str());
    return;
  }
  const int n = in.num_participants;
  const bool all = !quick && old_world <= 4096;
  std::vector<int32_t> sample;
  if (all) {
    for (int q = 0; q < n; ++q) sample.push_back(q);
  } else {
    for (int i = 0; i < 64; ++i) sample.push_back(static_cast<int32_t>((int64_t{i} * n) / 64));
  }
  double max_s = 0, sum_s = 0;
  int64_t moved = 0, max_pieces = 0;
  for (int32_t q : sample) {
    const double t1 = Now();
    auto lp = planner->PlanFor(q);
    const double dt = Now() - t1;
    if (!lp.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name.c_str(), lp.status().ToString().c_str());
      return;
    }
    max_s = std::max(max_s, dt);
    sum_s += dt;
    for (const PieceMove& m : lp->recvs) moved += PieceBytes(*lp, m);
    max_pieces =
        std::max<int64_t>(max_pieces, static_cast<int64_t>(lp->sends.size() + lp->recvs.size()));
  }
  const Planner::Totals totals = planner->ComputeTotals();
  int64_t lower_bound = totals.needed - totals.resident;
  if (!all) {  // the lower bound of the sampled participants only
    lower_bound = 0;
    for (int32_t q : sample) {
      const int32_t s = planner->assignment().new_rank_of_participant[static_cast<size_t>(q)];
      if (s < 0) continue;
      int64_t need = 0;
      for (const TensorSpec& t : tensors) {
        need += ShardOf(t, c.new_config, s)->NumElements() * DTypeSize(t.dtype);
      }
      lower_bound += need - planner->ResidentBytes(q, s);
    }
  }
  // Naive baseline: available participants take new ranks in order.
  std::vector<int32_t> avail = in.available;
  std::sort(avail.begin(), avail.end());
  int64_t naive_resident = 0;
  for (int s = 0; s < c.new_config.world(); ++s) {
    naive_resident += planner->ResidentBytes(avail[static_cast<size_t>(s)], s);
  }
  const int64_t naive = totals.needed - naive_resident;
  const int64_t full_lb = totals.needed - totals.resident;
  std::printf(
      "{\"name\": \"%s\", \"ranks_old\": %d, \"ranks_new\": %d, \"tensors\": %zu, "
      "\"bytes\": %lld, \"seconds\": %.6f, \"assignment_seconds\": %.6f, "
      "\"local_plan_seconds_max\": %.6f, \"local_plan_seconds_mean\": %.6f, "
      "\"participants_planned\": %zu, \"bytes_moved\": %lld, \"bytes_lower_bound\": %lld, "
      "\"ratio\": %.6f, \"bytes_lower_bound_all\": %lld, \"bytes_moved_naive\": %lld, "
      "\"ratio_vs_naive\": %.6f, \"assignment_exact\": %s, \"max_pieces\": %lld, "
      "\"target_seconds\": 0.05}\n",
      c.name.c_str(), old_world, c.new_config.world(), tensors.size(),
      static_cast<long long>(totals.needed), create_s + max_s, create_s, max_s,
      sum_s / static_cast<double>(sample.size()), sample.size(), static_cast<long long>(moved),
      static_cast<long long>(lower_bound), lower_bound ? double(moved) / double(lower_bound) : 1.0,
      static_cast<long long>(full_lb), static_cast<long long>(naive),
      full_lb ? double(full_lb) / double(naive ? naive : 1) : 1.0,
      planner->assignment().exact ? "true" : "false", static_cast<long long>(max_pieces));
  std::fflush(stdout);
}

// The structured assignment against the exact one on a world small enough for Hungarian.
void Quality(const Case& c, const std::vector<TensorSpec>& tensors) {
  PlanInput in;
  in.tensors = tensors;
  in.old_config = c.old_config;
  in.new_config = c.new_config;
  const int old_world = c.old_config.world();
  for (int r = 0; r < old_world; ++r) in.old_participant_of_rank.push_back(r);
  for (int r = 0; r < old_world; ++r) {
    const auto co = c.old_config.CoordsOf(r);
    if (!(c.leavers > 0 && co.p == 0 && co.d == 0 && co.t < c.leavers)) in.available.push_back(r);
  }
  int32_t next = old_world;
  while (static_cast<int>(in.available.size()) < c.new_config.world())
    in.available.push_back(next++);
  in.num_participants = next;
  double t0 = Now();
  auto fast = Planner::Create(in);
  const double fast_s = Now() - t0;
  t0 = Now();
  auto exact = Planner::Create(in);
  const double exact_s = Now() - t0;
  if (!fast.ok() || !exact.ok()) {
    std::fprintf(stderr, "%s: %s %s\n", c.name.c_str(), fast.status().ToString().c_str(),
                 exact.status().ToString().c_str());
    return;
  }
  const Planner::Totals f = fast->ComputeTotals(), e = exact->ComputeTotals();
  std::printf(
      "{\"name\": \"%s\", \"ranks_old\": %d, \"ranks_new\": %d, \"bytes\": %lld, "
      "\"seconds\": %.6f, \"seconds_exact\": %.6f, \"bytes_resident\": %lld, "
      "\"bytes_resident_exact\": %lld, \"ratio\": %.6f, \"bytes_lower_bound\": %lld, "
      "\"bytes_lower_bound_exact\": %lld}\n",
      c.name.c_str(), old_world, c.new_config.world(), static_cast<long long>(f.needed), fast_s,
      exact_s, static_cast<long long>(f.resident), static_cast<long long>(e.resident),
      e.resident ? double(f.resident) / double(e.resident) : 1.0,
      static_cast<long long>(f.needed - f.resident), static_cast<long long>(e.needed - e.resident));
  std::fflush(stdout);
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  bool quick = false;
  std::vector<int> worlds = {1024, 4096, 16384};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strncmp(argv[i], "--world=", 8)) worlds = {std::atoi(argv[i] + 8)};
  }
  using morph::Config;
  const auto tensors = morph::Gpt175B();
  for (int world : worlds) {
    const int tp = 8, pp = 16, dp = world / (tp * pp);
    const std::string w = std::to_string(world);
    const morph::Case cases[] = {
        // One node (8 GPUs) leaves: dp shrinks by one, 120 ranks become standby.
        {"plan_gpt175b_dp_shrink_" + w, Config(dp, tp, pp), Config(dp - 1, tp, pp), 8},
        // TP 8 -> 4 at the same world: dp doubles.
        {"plan_gpt175b_tp_8to4_" + w, Config(dp, tp, pp), Config(dp * 2, tp / 2, pp), 0},
        // PP 16 -> 8 at the same world: dp doubles.
        {"plan_gpt175b_pp_16to8_" + w, Config(dp, tp, pp), Config(dp * 2, tp, pp / 2), 0},
    };
    for (const auto& c : cases) morph::Run(c, tensors, quick);
  }
  // Assignment quality: structured vs exact (Hungarian) at 128 ranks (tp 8, pp 4, dp 4).
  const morph::Case small[] = {
      {"assign_quality_dp_shrink_128", Config(4, 8, 4), Config(3, 8, 4), 8},
      {"assign_quality_tp_8to4_128", Config(4, 8, 4), Config(8, 4, 4), 0},
      {"assign_quality_pp_4to2_128", Config(4, 8, 4), Config(8, 8, 2), 0},
      {"assign_quality_dp_grow_96_128", Config(3, 8, 4), Config(4, 8, 4), 0},
  };
  if (!quick) {
    for (const auto& c : small) morph::Quality(c, tensors);
  }
  return 0;
}
