// Randomized property tests of the planner: >= 10,000 random reconfigurations per run, seeded
// (MORPH_TEST_SEED reproduces a run; the seed is printed), each applied with the reference
// applier and checked bitwise, for bytes moved == lower bound, matching pair order, and (small
// cases) assignment optimality against a brute force over every assignment.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

#include "base/testing.h"
#include "reshard/plan.h"
#include "reshard/plan_testutil.h"

namespace morph {
namespace {

using Rng = std::mt19937_64;

int Uniform(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

ParallelConfig RandomConfig(Rng& rng, int layers, int max_world, int max_dim = 4) {
  while (true) {
    ParallelConfig c{.dp = Uniform(rng, 1, max_dim),
                     .tp = Uniform(rng, 1, max_dim),
                     .pp = Uniform(rng, 1, std::min(layers, 3))};
    if (c.world() > max_world) continue;
    c.stage_of_layer = testutil::RandomStageMap(rng, layers, c.pp);
    c.zero_stage = Uniform(rng, 0, 1);
    return c;
  }
}

struct Case {
  PlanInput in;
  bool small = false;
};

Case RandomCase(Rng& rng, int max_world = 12, int max_dim = 4) {
  const int layers = Uniform(rng, 1, 3);
  Case k;
  PlanInput& in = k.in;
  in.old_config = RandomConfig(rng, layers, max_world, max_dim);
  in.new_config = RandomConfig(rng, layers, max_world, max_dim);
  const int lcm = std::lcm(in.old_config.tp, in.new_config.tp);
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kI8, DType::kF64};
  const int num_tensors = Uniform(rng, 1, 4);
  for (int i = 0; i < num_tensors; ++i) {
    TensorSpec t;
    t.name = "t" + std::to_string(i);
    t.dtype = dtypes[Uniform(rng, 0, 3)];
    const int rank = Uniform(rng, 0, 3);
    for (int d = 0; d < rank; ++d) t.shape.push_back(Uniform(rng, 1, 5));
    Layout l = Layout::Layer(Uniform(rng, 0, layers - 1));
    // The layouts real checkpoints use (issue 7 §5), each in about a quarter of the tensors:
    // a second layer (tied embeddings), a block-interleaved or a padded split, hybrid ZeRO.
    if (layers > 1 && Uniform(rng, 0, 3) == 0) l = l.AlsoOnLayer(Uniform(rng, 0, layers - 1));
    if (rank > 0 && Uniform(rng, 0, 2) > 0) {
      const int dim = Uniform(rng, 0, rank - 1);
      const int kind = Uniform(rng, 0, 4);
      if (kind == 0) {
        const int blocks = Uniform(rng, 2, 3);
        t.shape[static_cast<size_t>(dim)] = blocks * lcm * Uniform(rng, 1, 2);
        l = l.SplitTPBlocks(dim, blocks);
      } else if (kind == 1) {
        t.shape[static_cast<size_t>(dim)] = Uniform(rng, 1, 9);
        l = l.SplitTP(dim).PadToMultiple(Uniform(rng, 1, 3));
      } else if (kind == 4) {  // torch.chunk: any length, tp need not divide it
        t.shape[static_cast<size_t>(dim)] = Uniform(rng, 0, 9);
        l = l.ChunkTP(dim);
      } else {
        t.shape[static_cast<size_t>(dim)] = lcm * Uniform(rng, 1, 3);
        l = l.SplitTP(dim);
      }
    }
    if (in.old_config.zero_stage || Uniform(rng, 0, 3) == 0) {
      const int g = std::gcd(in.old_config.dp, in.new_config.dp);
      if (g > 1 && Uniform(rng, 0, 2) == 0) {
        std::vector<int> divisors;
        for (int x = 1; x <= g; ++x) {
          if (g % x == 0) divisors.push_back(x);
        }
        l = l.ZeroShard(divisors[static_cast<size_t>(Uniform(rng, 0, int(divisors.size()) - 1))]);
      } else {
        l = l.ZeroShard(Uniform(rng, 0, 1) == 1);
      }
    }
    // FSDP2's dim-0 chunks (about a third of the DP-sharded tensors that have a dimension 0).
    const bool blocks_on_0 = l.tp_blocks() > 1 && l.tp_dim() == 0;
    if (l.zero_sharded() && rank > 0 && !blocks_on_0 && Uniform(rng, 0, 2) == 0) {
      l = l.ChunkDP(l.zero_group());
    }
    t.layout = l;
    in.tensors.push_back(std::move(t));
  }
  // Old ranks held by a random permutation of participants 0..W-1; some die, some leave.
  const int old_world = in.old_config.world();
  std::vector<int32_t> perm(static_cast<size_t>(old_world));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  in.old_participant_of_rank = perm;
  std::vector<int32_t> available;
  const int dead = Uniform(rng, 0, 3) == 0 ? Uniform(rng, 1, std::max(1, old_world / 3)) : 0;
  for (int i = 0; i < dead && i < old_world; ++i)
    in.old_participant_of_rank[static_cast<size_t>(i)] = -1;
  for (int r = 0; r < old_world; ++r) {
    const int32_t q = in.old_participant_of_rank[static_cast<size_t>(r)];
    if (q >= 0 && Uniform(rng, 0, 5) > 0) available.push_back(q);  // else it leaves
  }
  // Dead ranks' participants are gone: renumber participants densely afterwards is not needed,
  // a dead participant id just never appears; joiners get ids from old_world up.
  int32_t next = old_world;
  const int joiners =
      std::max(0, in.new_config.world() - static_cast<int>(available.size())) + Uniform(rng, 0, 2);
  for (int j = 0; j < joiners; ++j) available.push_back(next++);
  std::shuffle(available.begin(), available.end(), rng);
  in.available = available;
  in.num_participants = next;
  k.small = in.new_config.world() <= 6 && available.size() <= 7;
  return k;
}

TEST(PlanPropertyTest, RandomReconfigurations) {
  const unsigned long long seed = testing::TestSeed();
  std::printf("plan_property_test seed: %llu (rerun with MORPH_TEST_SEED=%llu)\n", seed, seed);
  Rng rng(seed);
  const int kCases = 10000;
  int applied = 0, data_loss = 0, brute = 0, dense = 0;
  int64_t moved_total = 0;
  for (int i = 0; i < kCases; ++i) {
    Case k = RandomCase(rng);
    const PlanInput& in = k.in;
    SCOPED_TRACE("case " + std::to_string(i) + ": old " + in.old_config.ToString() + ", new " +
                 in.new_config.ToString() + ", seed " + std::to_string(seed));
    MORPH_ASSERT_OK_AND_ASSIGN(Planner p, Planner::Create(in));
    // The assignment is optimal: the dense Hungarian on the element-by-element resident matrix
    // (shares nothing with the planner's weights) finds no better total.
    const auto m = testutil::BruteResidentMatrix(in);
    ASSERT_EQ(testutil::DenseBestResident(m), p.ComputeTotals().resident)
        << "the dense optimum differs from the planner's assignment";
    ++dense;
    if (k.small) {
      ASSERT_EQ(testutil::BruteBestResident(m), p.ComputeTotals().resident)
          << "an assignment keeps more bytes resident than the planner's";
      ++brute;
    }
    auto plans_or = p.PlanAll();
    // The recovery's coverage check, from the gone ranks' side only, agrees with every
    // participant's plan.
    const std::optional<Planner::LostPiece> first_lost = p.FirstLostPiece();
    ASSERT_EQ(first_lost.has_value(), !plans_or.ok())
        << "FirstLostPiece disagrees with PlanAll: " << plans_or.status();
    if (!plans_or.ok()) {
      ASSERT_EQ(plans_or.status().code(), StatusCode::kDataLoss) << plans_or.status();
      // Genuine: some needed element has no surviving old holder.
      bool lost = false;
      for (int s = 0; s < in.new_config.world() && !lost; ++s) {
        for (const TensorSpec& t : in.tensors) {
          const Shard need = *ShardOf(t, in.new_config, s);
          for (const Box& b : ShardBoxes(need)) {
            for (int r = 0; r < in.old_config.world(); ++r) {
              if (in.old_participant_of_rank[static_cast<size_t>(r)] >= 0) continue;
              if (!IntersectShard(*ShardOf(t, in.old_config, r), b).empty()) {
                // Lost if no live rank holds these elements either.
                bool held = false;
                for (const Box& x : IntersectShard(*ShardOf(t, in.old_config, r), b)) {
                  for (int r2 = 0; r2 < in.old_config.world(); ++r2) {
                    if (in.old_participant_of_rank[static_cast<size_t>(r2)] < 0) continue;
                    const auto y = IntersectShard(*ShardOf(t, in.old_config, r2), x);
                    int64_t n = 0;
                    for (const Box& z : y) n += *z.NumElements();
                    if (n == *x.NumElements()) held = true;
                  }
                  if (!held) lost = true;
                }
              }
            }
          }
        }
      }
      ASSERT_TRUE(lost) << "DataLoss without a lost element: " << plans_or.status();
      // With a `lost` list the plan covers the rest; the lost pieces are exactly unheld.
      std::vector<std::vector<PieceMove>> lost_pieces;
      MORPH_ASSERT_OK_AND_ASSIGN(auto partial, p.PlanAll(&lost_pieces));
      MORPH_ASSERT_OK(testutil::ApplyAndCheck(in, p.assignment(), partial, &lost_pieces));
      // FirstLostPiece's piece is one the participant it names finds lost in its own plan.
      ASSERT_GE(first_lost->participant, 0);
      ASSERT_EQ(p.assignment().participant_of_new_rank[static_cast<size_t>(first_lost->new_rank)],
                first_lost->participant);
      const auto& mine = lost_pieces[static_cast<size_t>(first_lost->participant)];
      ASSERT_TRUE(std::any_of(mine.begin(), mine.end(), [&](const PieceMove& m) {
        return m.tensor == first_lost->tensor && m.box == first_lost->box;
      })) << "tensor " << first_lost->tensor << " box " << first_lost->box.ToString()
          << " is not among participant " << first_lost->participant << "'s lost pieces";
      MORPH_ASSERT_OK_AND_ASSIGN(PlanSummary sum, p.Summarize(partial, &lost_pieces));
      ASSERT_GT(sum.bytes_lost, 0);
      ASSERT_EQ(sum.bytes_moved + sum.bytes_lost, sum.bytes_lower_bound);
      ++data_loss;
      continue;
    }
    const std::vector<LocalPlan>& plans = *plans_or;
    MORPH_ASSERT_OK(testutil::ApplyAndCheck(in, p.assignment(), plans));
    MORPH_ASSERT_OK_AND_ASSIGN(PlanSummary sum, p.Summarize(plans));
    ASSERT_EQ(sum.bytes_moved, sum.bytes_lower_bound);
    int64_t local = 0, needed = 0;
    for (const LocalPlan& lp : plans) {
      for (const PieceMove& m : lp.local_copies) local += PieceBytes(lp, m);
      for (size_t t = 0; t < lp.new_shards.size(); ++t) {
        if (lp.new_shards[t])
          needed +=
              StateElements(in.tensors[t], *lp.new_shards[t]) * DTypeSize(in.tensors[t].dtype);
      }
    }
    ASSERT_EQ(local, sum.bytes_resident);
    ASSERT_EQ(needed, sum.bytes_needed);
    moved_total += sum.bytes_moved;
    ++applied;
  }
  std::printf(
      "cases %d: applied %d, data loss %d, dense-optimum checked %d, brute-force checked %d, "
      "bytes moved %lld\n",
      kCases, applied, data_loss, dense, brute, static_cast<long long>(moved_total));
  EXPECT_GT(applied, kCases / 2);
  EXPECT_GT(brute, kCases / 10);
}

// Fewer, larger worlds (up to 64 ranks, dp and tp up to 8): the assignment against the dense
// optimum, the reference applier and the lower bound.
TEST(PlanPropertyTest, LargerWorlds) {
  const unsigned long long seed = testing::TestSeed() + 1;
  std::printf("plan_property_test LargerWorlds seed: %llu (MORPH_TEST_SEED=%llu)\n", seed,
              seed - 1);
  Rng rng(seed);
  int applied = 0;
  for (int i = 0; i < 300; ++i) {
    Case k = RandomCase(rng, 64, 8);
    const PlanInput& in = k.in;
    SCOPED_TRACE("case " + std::to_string(i) + ": old " + in.old_config.ToString() + ", new " +
                 in.new_config.ToString());
    MORPH_ASSERT_OK_AND_ASSIGN(Planner p, Planner::Create(in));
    ASSERT_EQ(testutil::DenseBestResident(testutil::BruteResidentMatrix(in)),
              p.ComputeTotals().resident);
    auto plans = p.PlanAll();
    if (!plans.ok()) {
      ASSERT_EQ(plans.status().code(), StatusCode::kDataLoss) << plans.status();
      continue;
    }
    MORPH_ASSERT_OK(testutil::ApplyAndCheck(in, p.assignment(), *plans));
    MORPH_ASSERT_OK_AND_ASSIGN(PlanSummary sum, p.Summarize(*plans));
    ASSERT_EQ(sum.bytes_moved, sum.bytes_lower_bound);
    ++applied;
  }
  std::printf("larger worlds: applied %d of 300\n", applied);
  EXPECT_GT(applied, 150);
}

// Worlds above the old dense limit (128 x 128), where the structured heuristic kept on average
// 91-93 % of the optimum (issue 7): 130-320 new ranks, ZeRO-heavy random models, every
// assignment equal to the dense optimum of the element-by-element matrix.
TEST(PlanPropertyTest, WorldsAbove128MatchTheDenseOptimum) {
  const unsigned long long seed = testing::TestSeed() + 2;
  Rng rng(seed);
  int checked = 0;
  for (int i = 0; i < 12; ++i) {
    PlanInput in;
    const int tp_o = 1 << Uniform(rng, 0, 2), tp_n = 1 << Uniform(rng, 0, 2);
    const int pp_o = Uniform(rng, 1, 2), pp_n = Uniform(rng, 1, 2);
    const int layers = 2;
    in.old_config = {.dp = Uniform(rng, 130, 320) / (tp_o * pp_o) + 1, .tp = tp_o, .pp = pp_o};
    in.new_config = {.dp = Uniform(rng, 130, 320) / (tp_n * pp_n) + 1, .tp = tp_n, .pp = pp_n};
    in.old_config.stage_of_layer = *ParallelConfig::EvenStages(layers, pp_o);
    in.new_config.stage_of_layer = *ParallelConfig::EvenStages(layers, pp_n);
    const int lcm = std::lcm(tp_o, tp_n);
    for (int t = 0; t < 4; ++t) {
      TensorSpec spec{"t" + std::to_string(t), t % 2 ? DType::kF32 : DType::kBF16, {}, {}};
      Layout l = Layout::Layer(t % layers).ZeroShard(t != 3);
      if (t == 1) {
        spec.shape = {lcm * Uniform(rng, 1, 4), Uniform(rng, 20, 90)};
        l = l.SplitTP(0);
      } else if (t == 2) {
        spec.shape = {Uniform(rng, 3, 9), lcm * Uniform(rng, 20, 60)};
        l = l.SplitTP(1);
      } else {
        spec.shape = {Uniform(rng, 300, 2000)};
      }
      spec.layout = l;
      in.tensors.push_back(spec);
    }
    const int old_world = in.old_config.world();
    for (int r = 0; r < old_world; ++r) in.old_participant_of_rank.push_back(r);
    for (int r = 0; r < old_world; ++r) {
      if (Uniform(rng, 0, 9) > 0) in.available.push_back(r);
    }
    int32_t next = old_world;
    while (static_cast<int>(in.available.size()) < in.new_config.world()) {
      in.available.push_back(next++);
    }
    in.num_participants = next;
    SCOPED_TRACE("case " + std::to_string(i) + ": old " + in.old_config.ToString() + ", new " +
                 in.new_config.ToString() + ", seed " + std::to_string(seed));
    MORPH_ASSERT_OK_AND_ASSIGN(Planner p, Planner::Create(in));
    ASSERT_EQ(testutil::DenseBestResident(testutil::BruteResidentMatrix(in)),
              p.ComputeTotals().resident);
    ++checked;
  }
  EXPECT_EQ(checked, 12);
}

// Hybrid ZeRO only (no plain ZeRO class): the assignment shares one list per new cell
// (p', t', d' mod lcm of the group sizes) instead of per-rank direct entries (plan_assign.cc).
// Against the dense optimum of the element-by-element matrix, and applied.
TEST(PlanPropertyTest, HybridZeroWorldsMatchTheDenseOptimum) {
  const unsigned long long seed = testing::TestSeed() + 3;
  Rng rng(seed);
  for (int i = 0; i < 60; ++i) {
    const int g = Uniform(rng, 1, 3), layers = 2;
    PlanInput in;
    const int tp_o = Uniform(rng, 1, 4), tp_n = Uniform(rng, 1, 4);
    in.old_config = {.dp = g * Uniform(rng, 1, 4), .tp = tp_o, .pp = Uniform(rng, 1, 2)};
    in.new_config = {.dp = g * Uniform(rng, 1, 4), .tp = tp_n, .pp = Uniform(rng, 1, 2)};
    in.old_config.stage_of_layer = *ParallelConfig::EvenStages(layers, in.old_config.pp);
    in.new_config.stage_of_layer = *ParallelConfig::EvenStages(layers, in.new_config.pp);
    const int lcm = std::lcm(tp_o, tp_n);
    const int g2 = Uniform(rng, 0, 1) ? g : 1;  // a second group size dividing g
    in.tensors = {
        {"w", DType::kBF16, {lcm * Uniform(rng, 1, 3), 3}, Layout::Layer(0).SplitTP(0)},
        {"m",
         DType::kF32,
         {lcm * Uniform(rng, 1, 3), Uniform(rng, 1, 5)},
         Layout::Layer(0).SplitTP(0).ZeroShard(g)},
        {"ln", DType::kF32, {Uniform(rng, 1, 40)}, Layout::Layer(Uniform(rng, 0, 1)).ZeroShard(g2)},
        {"e",
         DType::kF32,
         {Uniform(rng, 1, 11), 2},
         Layout::Layers({0, 1}).SplitTP(0).PadToMultiple(Uniform(rng, 1, 2)).ZeroShard(g)},
        {"qkv", DType::kF32, {3 * lcm, 2}, Layout::Layer(1).SplitTPBlocks(0, 3).ZeroShard(g2)}};
    const int old_world = in.old_config.world();
    for (int r = 0; r < old_world; ++r) in.old_participant_of_rank.push_back(r);
    for (int r = 0; r < old_world; ++r) {
      if (Uniform(rng, 0, 7) > 0) in.available.push_back(r);
    }
    int32_t next = old_world;
    while (static_cast<int>(in.available.size()) < in.new_config.world()) {
      in.available.push_back(next++);
    }
    in.num_participants = next;
    SCOPED_TRACE("case " + std::to_string(i) + ": old " + in.old_config.ToString() + ", new " +
                 in.new_config.ToString() + ", g " + std::to_string(g) + ", seed " +
                 std::to_string(seed));
    MORPH_ASSERT_OK_AND_ASSIGN(Planner p, Planner::Create(in));
    ASSERT_EQ(testutil::DenseBestResident(testutil::BruteResidentMatrix(in)),
              p.ComputeTotals().resident);
    MORPH_ASSERT_OK_AND_ASSIGN(auto plans, p.PlanAll());
    MORPH_ASSERT_OK(testutil::ApplyAndCheck(in, p.assignment(), plans));
    MORPH_ASSERT_OK_AND_ASSIGN(PlanSummary sum, p.Summarize(plans));
    ASSERT_EQ(sum.bytes_moved, sum.bytes_lower_bound);
  }
}

}  // namespace
}  // namespace morph
