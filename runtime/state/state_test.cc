#include "runtime/state/state.h"
#include "runtime/plan/manifest.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/testing.h"

namespace morph {
namespace {

ParallelConfig Config(int dp, int tp, int pp, int layers = 2) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(layers, pp);
  return c;
}

void Register(StateStore& s) {
  MORPH_ASSERT_OK(s.AddTensor("w1", {8, 6}, DType::kF32, Layout::Layer(0).SplitTP(1)));
  MORPH_ASSERT_OK(
      s.AddTensor("w1.m", {8, 6}, DType::kF32, Layout::Layer(0).SplitTP(1).ZeroShard()));
  MORPH_ASSERT_OK(s.AddTensor("ln", {7}, DType::kBF16, Layout::Layer(1)));
  MORPH_ASSERT_OK(s.AddScalar("step", 8));
  MORPH_ASSERT_OK(s.AddScalar("rng", 32));
}

TEST(StateTest, RegistrationErrorsNameWhatIsWrong) {
  StateStore s;
  Register(s);
  Status dup = s.AddTensor("w1", {8, 6}, DType::kF32, Layout());
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dup.message(), "tensor 'w1' is registered twice");
  Status bad = s.AddTensor("neg", {4, -1}, DType::kF32, Layout());
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "tensor 'neg': shape [4,-1] has negative dimension 1");
  Status dim = s.AddTensor("v", {4}, DType::kF32, Layout().SplitTP(1));
  EXPECT_EQ(dim.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dim.message(), "tensor 'v': tp_dim=1 is not a dimension of shape [4]");
  Status noalloc = s.AdoptTensor("a", {4}, DType::kF32, Layout(), TensorAllocator{});
  EXPECT_EQ(noalloc.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(noalloc.message(), "tensor 'a': allocator needs allocate and release");
  Status sdup = s.AddScalar("step", 8);
  EXPECT_EQ(sdup.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sdup.message(), "scalar 'step' is registered twice");
  Status big = s.AddScalar("huge", kMaxScalarBytes + 1);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(big.message(), "scalar 'huge': 1048577 bytes, must be in [0, 1048576]");
  EXPECT_EQ(s.AddScalar("", 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.tensors().size(), 3u);
  EXPECT_EQ(s.scalars().size(), 2u);

  s.Seal();
  Status late = s.AddTensor("late", {4}, DType::kF32, Layout());
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(late.message(), "tensor 'late' registered after Start");
  Status late_s = s.AddScalar("lr", 4);
  EXPECT_EQ(late_s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(late_s.message(), "scalar 'lr' registered after Start");
  EXPECT_EQ(s.tensors().size(), 3u);
}

#if !MORPH_WITH_CUDA
TEST(StateTest, CudaMemoryRefusedWithoutCuda) {
  StateStore s;
  Status st = s.AddTensor("w", {4}, DType::kF32, Layout(), MemoryKind::kCuda);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "tensor 'w': CUDA memory in a build without CUDA");
}
#endif

TEST(StateTest, LookupsOfUnknownNamesAreNotFound) {
  StateStore s;
  Register(s);
  EXPECT_EQ(s.tensor("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s.tensor("nope").status().message(), "no tensor 'nope' is registered");
  EXPECT_EQ(s.scalar("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s.scalar("nope").status().message(), "no scalar 'nope' is registered");
}

TEST(StateTest, MaterializeAllocatesZeroFilledShardsOfTheRank) {
  const ParallelConfig c = Config(2, 2, 2);
  JobManifest m;
  for (int rank = -1; rank < c.world(); ++rank) {
    StateStore s;
    Register(s);
    EXPECT_EQ(s.config(), nullptr);
    EXPECT_EQ(s.rank(), -1);
    MORPH_ASSERT_OK(s.Materialize(c, rank));
    EXPECT_TRUE(s.sealed());
    ASSERT_NE(s.config(), nullptr);
    EXPECT_EQ(*s.config(), c);
    EXPECT_EQ(s.rank(), rank);
    EXPECT_TRUE(s.intact());
    s.FillManifest(m);
    int64_t total = 0;
    for (const TensorSpec& spec : s.tensors()) {
      MORPH_ASSERT_OK_AND_ASSIGN(State::TensorRef r, s.tensor(spec.name));
      EXPECT_EQ(r.spec->name, spec.name);
      if (rank < 0) {
        EXPECT_TRUE(r.shard.empty());
        EXPECT_EQ(r.data.bytes, 0u);
        continue;
      }
      MORPH_ASSERT_OK_AND_ASSIGN(Shard want, ShardOf(spec, c, rank));
      EXPECT_EQ(r.shard, want) << spec.name << " rank " << rank;
      const size_t bytes = static_cast<size_t>(want.NumElements() * DTypeSize(spec.dtype));
      ASSERT_EQ(r.data.bytes, bytes) << spec.name;
      EXPECT_EQ(r.data.kind, MemoryKind::kHost);
      const auto* p = static_cast<const unsigned char*>(r.data.data);
      for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(p[i], 0) << spec.name << " byte " << i;
      total += static_cast<int64_t>(bytes);
    }
    EXPECT_EQ(s.local_bytes(), total);
    if (rank >= 0) {
      MORPH_ASSERT_OK_AND_ASSIGN(int64_t want, StateBytesOfRank(m, c, rank));
      EXPECT_EQ(s.local_bytes(), want);
    } else {
      EXPECT_EQ(s.local_bytes(), 0);
    }
    MORPH_ASSERT_OK_AND_ASSIGN(std::span<std::byte> step, s.scalar("step"));
    EXPECT_EQ(step.size(), 8u);
    for (std::byte b : step) EXPECT_EQ(b, std::byte{0});

    Status again = s.Materialize(c, rank);
    EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again;
  }
  EXPECT_EQ(m.tensors.size(), 3u);
  EXPECT_EQ(m.scalars[1], (ScalarSpec{"rng", 32}));
}

TEST(StateTest, MaterializeRefusesAConfigTheTensorsDoNotFit) {
  StateStore s;
  Register(s);
  Status st = s.Materialize(Config(1, 4, 1), 0);  // 6 columns do not divide by tp=4
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "tensor 'w1': dimension 1 of size 6 is not divisible by tp=4");
  EXPECT_EQ(s.config(), nullptr);
  EXPECT_EQ(s.Materialize(Config(1, 2, 1), 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.local_bytes(), 0);
}

// Adopted storage: allocate is called with each shard's bytes, release with what allocate
// returned, exactly once per buffer, also when a later allocation fails.
TEST(StateTest, AdoptedTensorsUseTheUsersAllocator) {
  std::map<void*, int64_t> live;
  int allocations = 0;
  int fail_at = -1;
  TensorAllocator a{.allocate = [&](int64_t bytes) -> StatusOr<BufferView> {
                      if (allocations++ == fail_at) return ResourceExhaustedError("pool is full");
                      void* p = std::malloc(static_cast<size_t>(bytes) + 16);
                      live[p] = bytes;
                      return BufferView{p, static_cast<size_t>(bytes) + 16, MemoryKind::kHost};
                    },
                    .release =
                        [&](BufferView v) {
                          ASSERT_EQ(live.count(v.data), 1u);
                          EXPECT_EQ(static_cast<int64_t>(v.bytes), live[v.data] + 16);
                          live.erase(v.data);
                          std::free(v.data);
                        }};
  {
    StateStore s;
    MORPH_ASSERT_OK(s.AdoptTensor("w", {8, 4}, DType::kF32, Layout().SplitTP(0), a));
    MORPH_ASSERT_OK(s.AdoptTensor("b", {5}, DType::kI64, Layout().ZeroShard(), a));
    MORPH_ASSERT_OK(s.Materialize(Config(2, 2, 1, 1), 3));  // d=1, t=1
    ASSERT_EQ(live.size(), 2u);
    MORPH_ASSERT_OK_AND_ASSIGN(State::TensorRef w, s.tensor("w"));
    EXPECT_EQ(w.data.bytes, 4u * 4 * 4);  // exactly the shard, not what allocate returned
    EXPECT_EQ(live.at(w.data.data), 64);
    MORPH_ASSERT_OK_AND_ASSIGN(State::TensorRef b, s.tensor("b"));
    EXPECT_EQ(b.data.bytes, 2u * 8);  // ZeRO range of 5 over dp 2, rank d=1: [3, 5)
  }
  EXPECT_TRUE(live.empty());

  allocations = 0;
  fail_at = 1;
  StateStore s;
  MORPH_ASSERT_OK(s.AdoptTensor("w", {8, 4}, DType::kF32, Layout(), a));
  MORPH_ASSERT_OK(s.AdoptTensor("b", {5}, DType::kI64, Layout(), a));
  Status st = s.Materialize(Config(1, 1, 1, 1), 0);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), "allocating 40 bytes for tensor 'b': pool is full");
  EXPECT_TRUE(live.empty()) << "the first tensor's buffer must be released";
  EXPECT_EQ(s.config(), nullptr);
}

// TensorAllocator::pad_dp_shards: a DP-sharded tensor's allocator is asked for its DP group's
// first (largest) shard, as FSDP2 pads every rank's shard to; morph's view is the shard itself.
// Replicated and TP-split tensors, and empty shards, are unaffected.
TEST(StateTest, PaddedDpShardsAskForTheFirstShardsBytes) {
  std::map<std::string, int64_t> asked;
  std::vector<std::unique_ptr<std::vector<char>>> blocks;
  auto allocator = [&](const std::string& name, bool pad) {
    TensorAllocator a{.allocate = [&, name](int64_t bytes) -> StatusOr<BufferView> {
                        asked[name] = bytes;
                        blocks.push_back(std::make_unique<std::vector<char>>(bytes));
                        return BufferView{blocks.back()->data(), static_cast<size_t>(bytes),
                                          MemoryKind::kHost};
                      },
                      .release = [](BufferView) {}};
    a.pad_dp_shards = pad;
    return a;
  };
  const auto materialize = [&](const ParallelConfig& config, int rank) {
    asked.clear();
    StateStore s;
    // Rows of [10, 4] f32 over dp 4: 3, 3, 3, 1 (torch.chunk), so rank d=3 holds one row.
    MORPH_ASSERT_OK(s.AdoptTensor("fsdp", {10, 4}, DType::kF32, Layout().ChunkDP(),
                                  allocator("fsdp", true)));
    MORPH_ASSERT_OK(s.AdoptTensor("same", {10, 4}, DType::kF32, Layout().ChunkDP(),
                                  allocator("same", false)));
    MORPH_ASSERT_OK(s.AdoptTensor("zero", {5}, DType::kI64, Layout().ZeroShard(),
                                  allocator("zero", true)));
    MORPH_ASSERT_OK(s.AdoptTensor("tp", {8, 4}, DType::kF32, Layout().SplitTP(0),
                                  allocator("tp", true)));
    // Rows of [4, 2] over dp 4: 1, 1, 1, 1; over dp 3: 2, 2, 0 (rank d=2 holds none).
    MORPH_ASSERT_OK(s.AdoptTensor("short", {4, 2}, DType::kF32, Layout().ChunkDP(),
                                  allocator("short", true)));
    MORPH_ASSERT_OK(s.Materialize(config, rank));
    EXPECT_EQ(s.tensor("fsdp")->data.bytes, s.tensor("same")->data.bytes);
  };
  materialize(Config(4, 1, 1, 1), 3);
  EXPECT_EQ(asked["fsdp"], 3 * 4 * 4) << "the first shard's three rows";
  EXPECT_EQ(asked["same"], 1 * 4 * 4) << "without the flag: the shard";
  EXPECT_EQ(asked.count("zero"), 0u) << "ZeRO ranges of 5 over dp 4: [0, 2) .. [4, 5), []";
  EXPECT_EQ(asked["tp"], 8 * 4 * 4) << "replicated over DP: its own size";
  EXPECT_EQ(asked["short"], 1 * 2 * 4);
  materialize(Config(4, 1, 1, 1), 0);
  EXPECT_EQ(asked["fsdp"], 3 * 4 * 4);
  materialize(Config(3, 1, 1, 1), 2);
  EXPECT_EQ(asked.count("short"), 0u) << "an empty shard is not allocated";
  EXPECT_EQ(asked["fsdp"], 4 * 4 * 4) << "rows 4, 4, 2: the first's four";
  EXPECT_EQ(asked["zero"], 2 * 8) << "ZeRO range [4, 5), the first [0, 2)";
  // With TP the first shard is that of DP rank 0 at the same TP place: ChunkTP(0) cuts the 10
  // rows 5, 5; ChunkDP over dp 2 then 3, 2.
  asked.clear();
  StateStore s;
  MORPH_ASSERT_OK(s.AdoptTensor("fsdp_tp", {10, 4}, DType::kF32, Layout().ChunkTP(0).ChunkDP(),
                                allocator("fsdp_tp", true)));
  MORPH_ASSERT_OK(s.Materialize(Config(2, 2, 1, 1), 3));  // d=1, t=1
  EXPECT_EQ(s.tensor("fsdp_tp")->data.bytes, 2u * 4 * 4);
  EXPECT_EQ(asked["fsdp_tp"], 3 * 4 * 4);
}

// An allocator that returns too little is the user's bug, named.
TEST(StateTest, AdoptedAllocatorReturningTooLittleIsRefused) {
  std::vector<char> small(8);
  bool released = false;
  StateStore s;
  MORPH_ASSERT_OK(s.AdoptTensor(
      "w", {4}, DType::kF32, Layout(),
      TensorAllocator{.allocate = [&](int64_t) -> StatusOr<BufferView> {
                        return BufferView{small.data(), small.size(), MemoryKind::kHost};
                      },
                      .release = [&](BufferView) { released = true; }}));
  Status st = s.Materialize(Config(1, 1, 1, 1), 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "allocating 16 bytes for tensor 'w': the allocator returned 8 bytes");
  EXPECT_TRUE(released);
}

#if MORPH_WITH_CUDA
// A CUDA build on a machine without a GPU: registration is accepted, the allocation fails and
// names the tensor. (On a GPU machine the shard is allocated and zero-filled.)
TEST(StateTest, CudaShardsWithoutAGpuFailNamingTheTensor) {
  StateStore s;
  MORPH_ASSERT_OK(s.AddTensor("w", {4}, DType::kF32, Layout(), MemoryKind::kCuda));
  Status st = s.Materialize(Config(1, 1, 1, 1), 0);
  if (st.ok()) {
    MORPH_ASSERT_OK_AND_ASSIGN(State::TensorRef r, s.tensor("w"));
    EXPECT_EQ(r.data.kind, MemoryKind::kCuda);
    GTEST_SKIP() << "a GPU is present: the CUDA shard was allocated";
  }
  EXPECT_TRUE(st.code() == StatusCode::kUnavailable || st.code() == StatusCode::kUnimplemented)
      << st;
  EXPECT_NE(st.message().find("allocating 16 bytes for tensor 'w'"), std::string::npos) << st;
}
#endif

// Mixed host and CUDA storage on one worker is refused (the executor moves one kind).
TEST(StateTest, MixedMemoryKindsAreRefused) {
  std::vector<char> fake(64);
  StateStore s;
  MORPH_ASSERT_OK(s.AddTensor("h", {4}, DType::kF32, Layout()));
  MORPH_ASSERT_OK(s.AdoptTensor(
      "d", {4}, DType::kF32, Layout(),
      TensorAllocator{.allocate = [&](int64_t) -> StatusOr<BufferView> {
                        return BufferView{fake.data(), fake.size(), MemoryKind::kCuda};
                      },
                      .release = [](BufferView) {}}));
  Status st = s.Materialize(Config(1, 1, 1, 1), 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "tensor 'd' is stored in cuda memory but 'h' in host: one memory kind per worker");
  EXPECT_EQ(s.local_bytes(), 0);
}

}  // namespace
}  // namespace morph
