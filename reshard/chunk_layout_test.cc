// The torch.chunk layouts (ChunkTP: DTensor's Shard(d) on TP; ChunkDP: FSDP2's Shard(0) on DP,
// composing with TP as torch's _StridedShard). Element ownership is checked against an oracle
// that shares nothing with ShardOf: it builds the global tensor as an array of its own indices
// and cuts it the way torch does (torch.chunk along the TP dimension, then FSDP2's
// _chunk_with_empty of the TP-local tensor along dimension 0), padding missing chunks with empty
// tensors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "base/testing.h"
#include "reshard/layout.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

// A dense row-major array of global element indices (the oracle's tensor).
struct IndexArray {
  std::vector<int64_t> shape;
  std::vector<int64_t> data;
};

IndexArray Iota(const std::vector<int64_t>& shape) {
  IndexArray a{shape, {}};
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  for (int64_t i = 0; i < n; ++i) a.data.push_back(i);
  return a;
}

// Rows [begin, end) of dimension `dim` (a narrow()).
IndexArray Narrow(const IndexArray& a, int dim, int64_t begin, int64_t end) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; ++i) outer *= a.shape[size_t(i)];
  for (size_t i = size_t(dim) + 1; i < a.shape.size(); ++i) inner *= a.shape[i];
  const int64_t len = a.shape[size_t(dim)];
  IndexArray out{a.shape, {}};
  out.shape[size_t(dim)] = end - begin;
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t x = 0; x < inner; ++x)
        out.data.push_back(a.data[size_t((o * len + r) * inner + x)]);
    }
  }
  return out;
}

// torch.chunk(a, chunks, dim) followed by empty tensors up to `chunks` (FSDP2's
// _chunk_with_empty; DTensor's Shard._split_tensor does the same): chunk size ceil(len/chunks),
// so the list torch.chunk returns may be shorter than `chunks`.
std::vector<IndexArray> TorchChunk(const IndexArray& a, int chunks, int dim) {
  const int64_t len = a.shape[size_t(dim)];
  const int64_t size = (len + chunks - 1) / chunks;
  std::vector<IndexArray> out;
  for (int64_t begin = 0; begin < len; begin += size) {
    out.push_back(Narrow(a, dim, begin, std::min(begin + size, len)));
  }
  while (static_cast<int>(out.size()) < chunks) out.push_back(Narrow(a, dim, 0, 0));
  return out;
}

// What the oracle says `rank` holds, in local storage order; empty off-stage.
std::vector<int64_t> OracleLocal(const TensorSpec& spec, const ParallelConfig& c, int rank) {
  const auto [p, d, t] = c.CoordsOf(rank);
  bool on = false;
  for (int l : spec.layout.layers())
    on |= c.stage_of_layer.empty() ? p == 0 : c.stage_of_layer[size_t(l)] == p;
  if (!on) return {};
  IndexArray local = Iota(spec.shape);
  const int k = spec.layout.tp_dim();
  if (k >= 0) local = TorchChunk(local, c.tp, k)[size_t(t)];
  if (!spec.layout.zero_sharded()) return local.data;
  const int g = spec.layout.zero_group() > 0 ? spec.layout.zero_group() : c.dp;
  return TorchChunk(local, g, 0)[size_t(d % g)].data;
}

// What ShardOf says `rank` holds, in local storage order (global row-major indices).
std::vector<int64_t> ShardLocal(const TensorSpec& spec, const ParallelConfig& c, int rank) {
  auto s = ShardOf(spec, c, rank);
  EXPECT_TRUE(s.ok()) << s.status();
  std::vector<int64_t> out;
  if (!s.ok()) return out;
  for (const Box& b : ShardBoxes(*s)) {
    std::vector<int64_t> idx = b.origin();
    if (b.empty()) continue;
    while (true) {
      int64_t l = 0;
      for (size_t i = 0; i < idx.size(); ++i) l = l * spec.shape[i] + idx[i];
      out.push_back(l);
      int dd = b.rank() - 1;
      for (; dd >= 0; --dd) {
        if (++idx[size_t(dd)] < b.dim(dd).end) break;
        idx[size_t(dd)] = b.dim(dd).begin;
      }
      if (dd < 0) break;
    }
  }
  return out;
}

ParallelConfig Config(int dp, int tp) { return ParallelConfig{.dp = dp, .tp = tp, .pp = 1}; }

TEST(ChunkLayoutTest, BuildersAndToString) {
  const Layout a = Layout::Layer(2).ChunkTP(1).ChunkDP();
  EXPECT_TRUE(a.tp_chunked());
  EXPECT_TRUE(a.dp_chunked());
  EXPECT_TRUE(a.zero_sharded());
  EXPECT_EQ(a.tp_dim(), 1);
  EXPECT_TRUE(a.extended());
  EXPECT_EQ(a.ToString(), "layer=2 tp_dim=1 tp_chunk dp_chunk");
  EXPECT_EQ(Layout().ChunkDP(2).ToString(), "layer=0 tp_dim=none dp_chunk zero_group=2");
  // Later builders replace earlier choices of the same part.
  EXPECT_FALSE(a.SplitTP(0).tp_chunked());
  EXPECT_FALSE(a.ZeroShard().dp_chunked());
  EXPECT_FALSE(a.ZeroShard(false).zero_sharded());
  EXPECT_TRUE(Layout().ZeroShard().ChunkDP().dp_chunked());
  EXPECT_FALSE(Layout().SplitTP(0).ZeroShard(2).chunked());
  EXPECT_NE(Layout().ChunkDP(), Layout().ZeroShard());
}

// Hand-computed torch.chunk cases: the last chunks short or empty.
TEST(ChunkLayoutTest, TorchChunkSizes) {
  // ChunkTP: 10 rows over tp=4 -> chunk 3: 3,3,3,1; 9 rows -> 3,3,3,0.
  TensorSpec w{"w", DType::kF32, {10, 2}, Layout().ChunkTP(0)};
  const int64_t want10[] = {6, 6, 6, 2}, want9[] = {6, 6, 6, 0};
  for (int t = 0; t < 4; ++t) {
    MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(w, Config(1, 4), t));
    EXPECT_EQ(s.NumElements(), want10[t]) << t;
  }
  w.shape = {9, 2};
  for (int t = 0; t < 4; ++t) {
    MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(w, Config(1, 4), t));
    EXPECT_EQ(s.NumElements(), want9[t]) << t;
    if (t == 3) {
      EXPECT_EQ(s.frame, (Box{{9, 9}, {0, 2}}));
    }
  }
  // ChunkDP: 5 rows of 3 over dp=4 -> rows 2,2,1,0 (not ZeRO's flat 4,4,4,3).
  TensorSpec m{"m", DType::kF32, {5, 3}, Layout().ChunkDP()};
  const int64_t rows[] = {2, 2, 1, 0};
  for (int d = 0; d < 4; ++d) {
    MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(m, Config(4, 1), d));
    EXPECT_EQ(s.NumElements(), 3 * rows[d]) << d;
  }
  // FSDP2 + TP on dim 0 (_StridedShard): TP chunks 10 rows into 5 + 5, DP chunks each TP-local
  // piece into 2,2,1: DP rank 2 of TP rank 1 holds global row 9 only.
  TensorSpec st{"st", DType::kF32, {10, 2}, Layout().ChunkTP(0).ChunkDP()};
  const ParallelConfig c = Config(3, 2);
  MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(st, c, c.RankOf({0, 2, 1})));
  EXPECT_EQ(s.frame, (Box{{5, 10}, {0, 2}}));
  EXPECT_EQ(s.flat_begin, 8);
  EXPECT_EQ(s.flat_end, 10);
}

TEST(ChunkLayoutTest, OwnershipMatchesTorchOracle) {
  std::mt19937_64 rng(24);
  int cases = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int rank = 1 + int(rng() % 3);
    std::vector<int64_t> shape;
    for (int i = 0; i < rank; ++i) shape.push_back(int64_t(rng() % 8));
    const int dp = 1 + int(rng() % 5), tp = 1 + int(rng() % 5);
    Layout l;
    const int k = int(rng() % (rank + 1)) - 1;  // -1: not split
    if (k >= 0)
      l = rng() % 3 ? l.ChunkTP(k) : (shape[size_t(k)] % tp ? l.ChunkTP(k) : l.SplitTP(k));
    const int dpmode = int(rng() % 4);
    int g = 0;
    if (dpmode >= 2 && rng() % 2) {
      for (int x = dp; x >= 1; --x) {
        if (dp % x == 0 && rng() % 2) g = x;
      }
    }
    if (dpmode == 1) l = l.ZeroShard(g);
    if (dpmode >= 2) l = l.ChunkDP(g);
    if (dpmode == 1) continue;  // ZeRO is layout_test's; keep the oracle to torch's layouts
    const TensorSpec spec{"t", DType::kF32, shape, l};
    const ParallelConfig c = Config(dp, tp);
    for (int r = 0; r < c.world(); ++r) {
      ASSERT_EQ(ShardLocal(spec, c, r), OracleLocal(spec, c, r))
          << l.ToString() << " shape " << ::testing::PrintToString(shape) << " dp=" << dp
          << " tp=" << tp << " rank " << r;
    }
    ++cases;
  }
  EXPECT_GT(cases, 1000);
}

TEST(ChunkLayoutTest, StagesAndHybridGroupsFollowTheLayers) {
  ParallelConfig c{.dp = 4, .tp = 3, .pp = 2, .stage_of_layer = {0, 1}};
  const TensorSpec spec{"e", DType::kBF16, {7, 5}, Layout::Layers({0, 1}).ChunkTP(1).ChunkDP(2)};
  for (int r = 0; r < c.world(); ++r) {
    ASSERT_EQ(ShardLocal(spec, c, r), OracleLocal(spec, c, r)) << r;
  }
}

TEST(ChunkLayoutTest, BadSpecsNameTheTensorAndTheField) {
  auto bad = [](const std::vector<int64_t>& shape, const Layout& l, const std::string& want) {
    EXPECT_THAT(ValidateTensorSpec(TensorSpec{"w", DType::kF32, shape, l}),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'w': " + want)))
        << l.ToString();
  };
  bad({6, 4}, Layout().ChunkTP(0).PadToMultiple(4),
      "tp_chunk (ChunkTP) with pad_multiple=4 is not supported");
  bad({6, 4}, Layout().SplitTPBlocks(0, 2).ChunkTP(0),
      "tp_chunk (ChunkTP) with blocks=2 is not supported");
  bad({6, 4}, Layout().ChunkTP(2), "tp_dim=2 is not a dimension of shape [6,4]");
  bad({6, 4}, Layout().ChunkTP(-1), "tp_chunk (ChunkTP) needs a TP split (tp_dim)");
  bad({}, Layout().ChunkDP(),
      "dp_chunk (ChunkDP) cuts dimension 0 and needs a tensor of rank >= 1");
  bad({6, 4}, Layout().SplitTPBlocks(0, 2).ChunkDP(),
      "dp_chunk (ChunkDP) with blocks=2 on dimension 0 is not supported");
  bad({6, 4}, Layout().ChunkDP(-1), "zero_group=-1 must be >= 0");
  EXPECT_FALSE(Layout().ChunkTP(0).SplitTPBlocks(0, 2).tp_chunked());
  // Block interleave of another dimension composes with ChunkDP.
  EXPECT_TRUE(ValidateTensorSpec(
                  TensorSpec{"w", DType::kF32, {6, 4}, Layout().SplitTPBlocks(1, 2).ChunkDP()})
                  .ok());
}

TEST(ChunkLayoutTest, ConfigChecks) {
  // ChunkTP needs no divisibility; SplitTP still does.
  const ParallelConfig c = Config(3, 4);
  EXPECT_TRUE(
      ValidateTensorForConfig(TensorSpec{"w", DType::kF32, {6, 5}, Layout().ChunkTP(1)}, c).ok());
  EXPECT_THAT(ValidateTensorForConfig(TensorSpec{"w", DType::kF32, {6, 5}, Layout().SplitTP(1)}, c),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("not divisible by tp=4")));
  // Fewer rows than ranks: the trailing ranks hold nothing, which is allowed (as in torch).
  EXPECT_TRUE(ValidateTensorForConfig(
                  TensorSpec{"w", DType::kF32, {2, 5}, Layout().ChunkTP(0).ChunkDP()}, c)
                  .ok());
  EXPECT_THAT(
      ValidateTensorForConfig(TensorSpec{"m", DType::kF32, {6, 5}, Layout().ChunkDP(2)}, c),
      StatusIs(StatusCode::kInvalidArgument,
               "tensor 'm': zero_group=2 does not divide dp=3 (hybrid ChunkDP needs dp to be a "
               "multiple of its group size)"));
}

}  // namespace
}  // namespace morph
