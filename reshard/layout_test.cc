#include "reshard/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

ParallelConfig Config(int dp, int tp, int pp, int layers) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(layers, pp);
  return c;
}

TEST(LayoutTest, Builder) {
  Layout l = Layout::Layer(3).SplitTP(1).ZeroShard();
  EXPECT_EQ(l.layer(), 3);
  EXPECT_EQ(l.tp_dim(), 1);
  EXPECT_TRUE(l.tp_split());
  EXPECT_TRUE(l.zero_sharded());
  EXPECT_EQ(l.ToString(), "layer=3 tp_dim=1 zero");
  EXPECT_EQ(Layout().ToString(), "layer=0 tp_dim=none replicated");
  EXPECT_FALSE(Layout::Layer(2).tp_split());
}

TEST(LayoutTest, ZeroRangePaddingRule) {
  // n=10, dp=4: chunk 3 -> [0,3) [3,6) [6,9) [9,10).
  EXPECT_EQ(ZeroRange(10, 4, 0), (Interval{0, 3}));
  EXPECT_EQ(ZeroRange(10, 4, 3), (Interval{9, 10}));
  // n=5, dp=4: chunk 2 -> [0,2) [2,4) [4,5) [5,5) (empty trailing range).
  EXPECT_EQ(ZeroRange(5, 4, 2), (Interval{4, 5}));
  EXPECT_TRUE(ZeroRange(5, 4, 3).empty());
  EXPECT_EQ(ZeroRange(5, 4, 3).begin, 5);
  // Exhaustive: ranges tile [0, n) in order, sizes differ by the rule.
  for (int64_t n = 0; n < 40; ++n) {
    for (int dp = 1; dp < 12; ++dp) {
      int64_t next = 0;
      for (int d = 0; d < dp; ++d) {
        Interval r = ZeroRange(n, dp, d);
        ASSERT_EQ(r.begin, next) << n << " " << dp << " " << d;
        ASSERT_LE(r.size(), (n + dp - 1) / dp);
        next = r.end;
        for (int64_t i = r.begin; i < r.end; ++i) {
          DpSpan s = ZeroRanksOf(n, dp, {i, i + 1});
          ASSERT_EQ(s.first, d);
          ASSERT_EQ(s.last, d);
        }
      }
      ASSERT_EQ(next, n);
    }
  }
  EXPECT_EQ(ZeroRanksOf(10, 4, {2, 7}).first, 0);
  EXPECT_EQ(ZeroRanksOf(10, 4, {2, 7}).last, 2);
  EXPECT_GT(ZeroRanksOf(10, 4, {3, 3}).first, ZeroRanksOf(10, 4, {3, 3}).last);
}

TEST(LayoutTest, ShardOfTpSplitReplicated) {
  ParallelConfig c = Config(2, 4, 2, 4);  // layers 0,1 on stage 0; 2,3 on stage 1
  TensorSpec w{"w", DType::kF32, {8, 16}, Layout::Layer(2).SplitTP(1)};
  for (int rank = 0; rank < c.world(); ++rank) {
    MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(w, c, rank));
    auto [p, d, t] = c.CoordsOf(rank);
    EXPECT_EQ(s.frame, (Box{{0, 8}, {4 * t, 4 * t + 4}})) << rank;
    if (p == 1) {
      EXPECT_EQ(s.flat_begin, 0);
      EXPECT_EQ(s.flat_end, 32);
    } else {
      EXPECT_TRUE(s.empty()) << rank;
    }
    (void)d;
  }
}

TEST(LayoutTest, ShardOfZeroFlatShardsTpLocalPiece) {
  ParallelConfig c = Config(3, 2, 1, 1);
  TensorSpec m{"m", DType::kBF16, {5, 4}, Layout::Layer(0).SplitTP(1).ZeroShard()};
  // TP-local piece: 5x2 = 10 elements; dp=3, chunk 4: [0,4) [4,8) [8,10).
  MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(m, c, c.RankOf({0, 2, 1})));
  EXPECT_EQ(s.frame, (Box{{0, 5}, {2, 4}}));
  EXPECT_EQ(s.flat_begin, 8);
  EXPECT_EQ(s.flat_end, 10);
  MORPH_ASSERT_OK_AND_ASSIGN(s, ShardOf(m, c, c.RankOf({0, 0, 0})));
  EXPECT_EQ(s, (Shard{Box{{0, 5}, {0, 2}}, 0, 4}));
}

TEST(LayoutTest, ShardsCoverEveryElementExactlyOncePerReplica) {
  // For every config and layout, each element is held by exactly
  // (tp if not split else 1) * (dp if not zero else 1) ranks.
  TensorSpec base{"x", DType::kF32, {6, 12, 5}, Layout::Layer(1)};
  for (int dp = 1; dp <= 4; ++dp) {
    for (int tp : {1, 2, 3, 6}) {
      for (int pp = 1; pp <= 2; ++pp) {
        for (int split = -1; split < 2; ++split) {
          for (bool zero : {false, true}) {
            ParallelConfig c = Config(dp, tp, pp, 3);
            TensorSpec s = base;
            s.layout = Layout::Layer(1).SplitTP(split).ZeroShard(zero);
            std::vector<int> count(6 * 12 * 5, 0);
            for (int r = 0; r < c.world(); ++r) {
              MORPH_ASSERT_OK_AND_ASSIGN(Shard sh, ShardOf(s, c, r));
              for (const Box& b : ShardBoxes(sh)) {
                for (int64_t i = b.dim(0).begin; i < b.dim(0).end; ++i)
                  for (int64_t j = b.dim(1).begin; j < b.dim(1).end; ++j)
                    for (int64_t k = b.dim(2).begin; k < b.dim(2).end; ++k)
                      ++count[static_cast<size_t>((i * 12 + j) * 5 + k)];
              }
            }
            const int want = (split >= 0 ? 1 : tp) * (zero ? 1 : dp);
            for (int v : count) ASSERT_EQ(v, want) << c.ToString() << " " << s.layout.ToString();
          }
        }
      }
    }
  }
}

TEST(LayoutTest, ScalarAndEmptyTensors) {
  ParallelConfig c = Config(3, 2, 1, 1);
  TensorSpec step{"step", DType::kI64, {}, Layout::Layer(0)};
  MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(step, c, 5));
  EXPECT_EQ(s.NumElements(), 1);
  step.layout = step.layout.ZeroShard();
  MORPH_ASSERT_OK_AND_ASSIGN(s, ShardOf(step, c, c.RankOf({0, 0, 1})));
  EXPECT_EQ(s.NumElements(), 1);
  MORPH_ASSERT_OK_AND_ASSIGN(s, ShardOf(step, c, c.RankOf({0, 1, 1})));
  EXPECT_TRUE(s.empty());
  TensorSpec none{"none", DType::kF32, {0, 4}, Layout::Layer(0).SplitTP(1).ZeroShard()};
  MORPH_ASSERT_OK_AND_ASSIGN(s, ShardOf(none, c, 0));
  EXPECT_TRUE(s.empty());
}

TEST(LayoutTest, BadSpecsNameTheTensor) {
  ParallelConfig c = Config(2, 4, 2, 4);
  EXPECT_THAT(ShardOf({"a.w", DType::kF32, {8, 6}, Layout::Layer(0).SplitTP(1)}, c, 0),
              StatusIs(StatusCode::kInvalidArgument,
                       "tensor 'a.w': dimension 1 of size 6 is not divisible by tp=4"));
  EXPECT_THAT(
      ShardOf({"b", DType::kF32, {8, 6}, Layout::Layer(4)}, c, 0),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'b': layer=4 is not in [0, 4)")));
  EXPECT_THAT(
      ShardOf({"c", DType::kF32, {8, -6}, Layout::Layer(0)}, c, 0),
      StatusIs(StatusCode::kInvalidArgument, "tensor 'c': shape [8,-6] has negative dimension 1"));
  EXPECT_THAT(ShardOf({"d", DType::kF32, {8}, Layout::Layer(0).SplitTP(1)}, c, 0),
              StatusIs(StatusCode::kInvalidArgument,
                       "tensor 'd': tp_dim=1 is not a dimension of shape [8]"));
  EXPECT_THAT(ShardOf({"e", DType::kF32, {8}, Layout::Layer(-1)}, c, 0),
              StatusIs(StatusCode::kInvalidArgument, "tensor 'e': layer=-1 must be >= 0"));
  EXPECT_THAT(ShardOf({"f", DType::kF32, {1LL << 40, 1LL << 30}, Layout::Layer(0)}, c, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'f': shape")));
  EXPECT_THAT(ShardOf({"", DType::kF32, {8}, Layout::Layer(0)}, c, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("empty name")));
  EXPECT_THAT(ShardOf({"g", DType::kF32, {8}, Layout::Layer(0)}, c, 16),
              StatusIs(StatusCode::kInvalidArgument, "rank=16 is not in [0, world=16)"));
  ParallelConfig bad = c;
  bad.tp = 0;
  EXPECT_THAT(ShardOf({"g", DType::kF32, {8}, Layout::Layer(0)}, bad, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tp=0")));
}

TEST(TensorRegistryTest, AddFindAndValidate) {
  TensorRegistry reg;
  MORPH_ASSERT_OK(reg.Add({"a", DType::kF32, {8, 8}, Layout::Layer(0).SplitTP(0)}));
  MORPH_ASSERT_OK(reg.Add({"b", DType::kF16, {6}, Layout::Layer(1).SplitTP(0)}));
  EXPECT_THAT(reg.Add({"a", DType::kF32, {8}, Layout::Layer(0)}),
              StatusIs(StatusCode::kAlreadyExists, "tensor 'a' is already registered"));
  EXPECT_THAT(reg.Add({"z", DType::kF32, {-1}, Layout::Layer(0)}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'z'")));
  EXPECT_EQ(reg.size(), 2);
  MORPH_ASSERT_OK_AND_ASSIGN(int i, reg.IndexOf("b"));
  EXPECT_EQ(i, 1);
  EXPECT_THAT(reg.IndexOf("nope"), StatusIs(StatusCode::kNotFound, "unknown tensor 'nope'"));
  MORPH_ASSERT_OK_AND_ASSIGN(const TensorSpec* b, reg.Find("b"));
  EXPECT_EQ(b->dtype, DType::kF16);
  MORPH_EXPECT_OK(reg.ValidateFor(Config(2, 2, 2, 2)));
  EXPECT_THAT(reg.ValidateFor(Config(1, 4, 1, 2)),
              StatusIs(StatusCode::kInvalidArgument,
                       "tensor 'b': dimension 0 of size 6 is not divisible by tp=4"));
  EXPECT_THAT(reg.ValidateFor(Config(1, 1, 1, 1)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'b': layer=1")));
}

// ---------------------------------------------------------------------------------------------
// The real-model layouts (issue 7 §5).

TEST(LayoutTest, RealModelBuilders) {
  const Layout l = Layout::Layers({0, 23}).SplitTP(0).PadToMultiple(128).ZeroShard(8);
  EXPECT_EQ(l.layers(), (std::vector<int>{0, 23}));
  EXPECT_EQ(l.pad_multiple(), 128);
  EXPECT_EQ(l.zero_group(), 8);
  EXPECT_TRUE(l.extended());
  EXPECT_EQ(l.ToString(), "layer=0,23 tp_dim=0 pad_multiple=128 zero zero_group=8");
  EXPECT_EQ(Layout::Layer(0).AlsoOnLayer(23), Layout::Layers({0, 23}));
  EXPECT_EQ(Layout::Layer(1).SplitTPBlocks(0, 3).ToString(),
            "layer=1 tp_dim=0 blocks=3 replicated");
  EXPECT_EQ(Layout::Layer(1).ZeroShard(0), Layout::Layer(1).ZeroShard());
  EXPECT_FALSE(Layout::Layer(3).SplitTP(1).ZeroShard().extended());
}

TEST(LayoutTest, RealModelValidationNamesTheField) {
  auto bad = [](Layout l, std::vector<int64_t> shape, const std::string& want) {
    const TensorSpec t{"w", DType::kF32, std::move(shape), l};
    EXPECT_THAT(ValidateTensorSpec(t),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'w': " + want)))
        << l.ToString();
  };
  bad(Layout::Layer(0).SplitTPBlocks(0, 0), {6, 4}, "blocks=0 must be >= 1");
  bad(Layout::Layer(0).SplitTPBlocks(-1, 3), {6, 4}, "blocks=3 needs a TP split");
  bad(Layout::Layer(0).SplitTPBlocks(0, 4), {6, 4},
      "dimension 0 of size 6 is not divisible by blocks=4");
  bad(Layout::Layer(0).SplitTP(0).PadToMultiple(-2), {6, 4}, "pad_multiple=-2 must be >= 0");
  bad(Layout::Layer(0).PadToMultiple(8), {6, 4},
      "pad_multiple=8 pads the TP-split dimension and needs a TP split");
  bad(Layout::Layer(0).SplitTPBlocks(0, 3).PadToMultiple(8), {6, 4}, "pad_multiple with blocks=3");
  bad(Layout::Layer(0).ZeroShard(-1), {6}, "zero_group=-1 must be >= 0");
  bad(Layout::Layers({0, -1}), {6}, "layer=-1 must be >= 0");
}

TEST(LayoutTest, RealModelValidationAgainstAConfig) {
  const ParallelConfig c = Config(4, 4, 2, 4);
  auto check = [&](Layout l, std::vector<int64_t> shape, const std::string& want) {
    const TensorSpec t{"w", DType::kF32, std::move(shape), l};
    MORPH_ASSERT_OK(ValidateTensorSpec(t));
    if (want.empty()) {
      MORPH_EXPECT_OK(ValidateTensorForConfig(t, c));
    } else {
      EXPECT_THAT(ValidateTensorForConfig(t, c),
                  StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'w': " + want)));
    }
  };
  check(Layout::Layer(0).SplitTPBlocks(0, 3), {24, 2}, "");
  check(Layout::Layer(0).SplitTPBlocks(0, 3), {18, 2},
        "block size 6 of dimension 0 (3 blocks) is not divisible by tp=4");
  check(Layout::Layer(0).SplitTP(0).PadToMultiple(8), {50257, 2}, "");  // any size
  check(Layout::Layer(0).ZeroShard(2), {6}, "");
  check(Layout::Layer(0).ZeroShard(3), {6}, "zero_group=3 does not divide dp=4");
  check(Layout::Layer(0).ZeroShard(8), {6}, "zero_group=8 does not divide dp=4");
  check(Layout::Layer(0).AlsoOnLayer(4), {6}, "layer=4 is not in [0, 4)");
}

// Element by element: ShardOf in planning coordinates holds exactly the real elements the layout
// definition gives each rank (fused QKV: the t-th slice of each block; padding: t*P/tp on).
TEST(LayoutTest, BlockInterleavedShardHoldsTheTthSliceOfEachBlock) {
  const TensorSpec qkv{"qkv", DType::kF32, {3 * 8, 2}, Layout::Layer(0).SplitTPBlocks(0, 3)};
  const ParallelConfig c = Config(1, 4, 1, 1);
  EXPECT_EQ(PlanShape(qkv), (std::vector<int64_t>{3, 8, 2}));
  for (int t = 0; t < 4; ++t) {
    MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(qkv, c, t));
    EXPECT_EQ(s.frame, (Box{{0, 3}, {2 * t, 2 * t + 2}, {0, 2}}));
    // Real rows held, in local order: block j, rows j*8 + 2t, j*8 + 2t + 1.
    std::vector<Box> real = RealBoxes(qkv, s.frame);
    ASSERT_EQ(real.size(), 3u);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(real[size_t(j)], (Box{{8 * j + 2 * t, 8 * j + 2 * t + 2}, {0, 2}}));
    }
  }
  // A whole-block box maps to one real box.
  EXPECT_EQ(RealBoxes(qkv, Box{{1, 3}, {0, 8}, {0, 2}}), (std::vector<Box>{Box{{8, 24}, {0, 2}}}));
}

TEST(LayoutTest, PaddedShardReachesIntoPaddingAndHybridZeroRepeatsRanges) {
  // Vocabulary 10 padded to a multiple of 2 * tp = 6: P = 12, slices of 4; rank 2 holds rows
  // [8, 12) of which 10 and 11 are padding.
  const TensorSpec emb{
      "e", DType::kF32, {10, 3}, Layout::Layers({0, 1}).SplitTP(0).PadToMultiple(2)};
  const ParallelConfig c = Config(1, 3, 2, 2);
  EXPECT_EQ(SplitLength(emb, c), 12);
  MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(emb, c, 2));
  EXPECT_EQ(s.frame, (Box{{8, 12}, {0, 3}}));
  EXPECT_EQ(s.NumElements(), 12);
  EXPECT_EQ(StateElements(emb, s), 6);
  // Tied: the last stage holds the same replica (rank 3 + 2 = stage 1, t 2).
  MORPH_ASSERT_OK_AND_ASSIGN(Shard last, ShardOf(emb, c, 5));
  EXPECT_EQ(last, s);
  EXPECT_EQ(StagesOfUnchecked(emb, c), (std::vector<int>{0, 1}));
  // Hybrid ZeRO, groups of 2 in dp 4: DP ranks d and d + 2 hold the same range.
  const TensorSpec m{"m", DType::kF32, {9}, Layout::Layer(0).ZeroShard(2)};
  const ParallelConfig z = Config(4, 1, 1, 1);
  for (int d = 0; d < 4; ++d) {
    MORPH_ASSERT_OK_AND_ASSIGN(Shard sd, ShardOf(m, z, d));
    EXPECT_EQ(sd.flat_begin, d % 2 == 0 ? 0 : 5);
    EXPECT_EQ(sd.flat_end, d % 2 == 0 ? 5 : 9);
  }
}

}  // namespace
}  // namespace morph
