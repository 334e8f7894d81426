#include "runtime/state/state_testutil.h"

#include <gtest/gtest.h>

#include <cstring>

#include "reshard/layout.h"

namespace morph::state_testutil {

ParallelConfig Config(int dp, int tp, int pp) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(4, pp);
  return c;
}

namespace {

Status AddScalars(StateStore& s) {
  MORPH_RETURN_IF_ERROR(s.AddScalar("step", 8));
  return s.AddScalar("rng", 16);
}

// The global linear index (planning shape) of storage element `l` of `shard`, or -1 for padding.
int64_t GlobalIndex(const Shard& shard, const std::vector<int64_t>& plan_shape, int64_t l) {
  const auto& dims = shard.frame.dims();
  int64_t rem = shard.flat_begin + l;
  std::vector<int64_t> coord(dims.size());
  for (size_t d = dims.size(); d-- > 0;) {
    const int64_t len = dims[d].end - dims[d].begin;
    coord[d] = dims[d].begin + rem % len;
    rem /= len;
  }
  int64_t g = 0;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (coord[d] >= plan_shape[d]) return -1;
    g = g * plan_shape[d] + coord[d];
  }
  return g;
}

}  // namespace

uint8_t ElementByte(uint64_t seed, size_t tensor, int64_t global_index, int byte) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (tensor + 1) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(global_index) * 0x165667B19E3779F9ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x >> (8 * (byte % 8)));
}

StatusOr<std::unique_ptr<StateStore>> MakeState(const ParallelConfig& config, int rank, bool hybrid,
                                           bool scalars) {
  auto s = std::make_unique<StateStore>();
  MORPH_RETURN_IF_ERROR(
      s->AddTensor("emb", {6, 6}, DType::kF32, Layout::Layers({0, 3}).SplitTP(1)));
  MORPH_RETURN_IF_ERROR(s->AddTensor("w1", {6, 12}, DType::kF32, Layout::Layer(1).SplitTP(1)));
  MORPH_RETURN_IF_ERROR(
      s->AddTensor("w1.m", {6, 12}, DType::kF32, Layout::Layer(1).SplitTP(1).ZeroShard()));
  MORPH_RETURN_IF_ERROR(s->AddTensor("norm", {10}, DType::kF32, Layout::Layer(2)));
  MORPH_RETURN_IF_ERROR(
      s->AddTensor("qkv", {18, 4}, DType::kBF16, Layout::Layer(2).SplitTPBlocks(0, 3)));
  MORPH_RETURN_IF_ERROR(
      s->AddTensor("vocab", {10, 4}, DType::kF32, Layout::Layer(3).SplitTP(0).PadToMultiple(4)));
  MORPH_RETURN_IF_ERROR(s->AddTensor("flat", {7}, DType::kF64, Layout::Layer(0).ZeroShard()));
  if (hybrid) {
    MORPH_RETURN_IF_ERROR(s->AddTensor("hz", {20}, DType::kF32, Layout::Layer(0).ZeroShard(2)));
  }
  if (scalars) {
    MORPH_RETURN_IF_ERROR(AddScalars(*s));
  }
  MORPH_RETURN_IF_ERROR(s->Materialize(config, rank));
  return s;
}

StatusOr<std::unique_ptr<StateStore>> MakeBigState(const ParallelConfig& config, int rank,
                                              int64_t bytes) {
  auto s = std::make_unique<StateStore>();
  const int64_t rows = std::max<int64_t>(config.tp, bytes / 4 / 1024 / config.tp * config.tp);
  MORPH_RETURN_IF_ERROR(
      s->AddTensor("big", {rows, 1024}, DType::kF32, Layout::Layer(0).SplitTP(0)));
  MORPH_RETURN_IF_ERROR(AddScalars(*s));
  MORPH_RETURN_IF_ERROR(s->Materialize(config, rank));
  return s;
}

void Fill(StateStore& state, uint64_t seed) {
  for (size_t i = 0; i < state.tensors().size(); ++i) {
    State::TensorRef r = state.TensorAt(i);
    const std::vector<int64_t> plan = PlanShape(*r.spec);
    const int es = DTypeSize(r.spec->dtype);
    auto* out = static_cast<uint8_t*>(r.data.data);
    if (state.tensors().size() == 1) {  // the big state: cheap, still seed- and rank-dependent
      const int64_t n = r.shard.NumElements() * es;
      for (int64_t b = 0; b < n; b += 4096) out[b] = ElementByte(seed, i, b, 0);
      continue;
    }
    for (int64_t l = 0; l < r.shard.NumElements(); ++l) {
      const int64_t g = GlobalIndex(r.shard, plan, l);
      for (int b = 0; b < es; ++b) out[l * es + b] = g < 0 ? 0 : ElementByte(seed, i, g, b);
    }
  }
  for (size_t k = 0; k < state.scalars().size(); ++k) {
    std::span<std::byte> blob = *state.scalar(state.scalars()[k].name);
    for (size_t b = 0; b < blob.size(); ++b) {
      blob[b] = static_cast<std::byte>(ElementByte(seed, 1000 + k, static_cast<int64_t>(b), 3));
    }
  }
}

int64_t CountDifferences(const StateStore& state, uint64_t seed, std::string* first) {
  int64_t diffs = 0;
  auto note = [&](const std::string& what) {
    if (diffs++ == 0 && first != nullptr) *first = what;
  };
  for (size_t i = 0; i < state.tensors().size(); ++i) {
    const State::TensorRef r = state.TensorAt(i);
    const std::vector<int64_t> plan = PlanShape(*r.spec);
    const int es = DTypeSize(r.spec->dtype);
    const auto* in = static_cast<const uint8_t*>(r.data.data);
    for (int64_t l = 0; l < r.shard.NumElements(); ++l) {
      const int64_t g = GlobalIndex(r.shard, plan, l);
      for (int b = 0; b < es; ++b) {
        const uint8_t want = g < 0 ? 0 : ElementByte(seed, i, g, b);
        if (in[l * es + b] != want) {
          note("tensor '" + r.spec->name + "' element " + std::to_string(l) + " of shard " +
               r.shard.ToString() + " (global " + std::to_string(g) + ")");
        }
      }
    }
  }
  for (size_t k = 0; k < state.scalars().size(); ++k) {
    const std::span<const std::byte> blob = state.ScalarAt(k);
    for (size_t b = 0; b < blob.size(); ++b) {
      if (blob[b] !=
          static_cast<std::byte>(ElementByte(seed, 1000 + k, static_cast<int64_t>(b), 3))) {
        note("scalar '" + state.scalars()[k].name + "' byte " + std::to_string(b));
      }
    }
  }
  return diffs;
}

void ExpectFilled(const StateStore& state, uint64_t seed) {
  std::string first;
  EXPECT_EQ(CountDifferences(state, seed, &first), 0)
      << "rank " << state.rank() << ": first difference: " << first;
}

}  // namespace morph::state_testutil
