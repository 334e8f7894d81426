// End to end: the planner's LocalPlans (plan.h) run by the executor over the in-process
// transport, one thread per participant, on random reconfigurations (DP/TP/PP/ZeRO changes,
// leavers, joiners). Every new shard must equal the reference bitwise.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <random>
#include <thread>

#include "base/testing.h"
#include "reshard/checkpoint.h"
#include "reshard/executor.h"
#include "reshard/inproc_transport.h"
#include "reshard/plan.h"
#include "reshard/plan_testutil.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

using Rng = std::mt19937_64;
int Uniform(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

ParallelConfig RandomConfig(Rng& rng, int layers) {
  while (true) {
    ParallelConfig c{.dp = Uniform(rng, 1, 4),
                     .tp = Uniform(rng, 1, 4),
                     .pp = Uniform(rng, 1, std::min(layers, 3))};
    if (c.world() > 10) continue;
    c.stage_of_layer = testutil::RandomStageMap(rng, layers, c.pp);
    return c;
  }
}

PlanInput RandomInput(Rng& rng) {
  const int layers = Uniform(rng, 1, 3);
  PlanInput in;
  in.old_config = RandomConfig(rng, layers);
  in.new_config = RandomConfig(rng, layers);
  const int lcm = std::lcm(in.old_config.tp, in.new_config.tp);
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kU8, DType::kF64};
  for (int i = 0, n = Uniform(rng, 1, 4); i < n; ++i) {
    TensorSpec t{"t" + std::to_string(i),
                 dtypes[Uniform(rng, 0, 3)],
                 {},
                 Layout::Layer(Uniform(rng, 0, layers - 1))};
    const int rank = Uniform(rng, 0, 3);
    for (int d = 0; d < rank; ++d) t.shape.push_back(Uniform(rng, 1, 24));
    if (rank > 0 && Uniform(rng, 0, 2) > 0) {
      const int dim = Uniform(rng, 0, rank - 1);
      t.shape[static_cast<size_t>(dim)] = lcm * Uniform(rng, 1, 6);
      t.layout = t.layout.SplitTP(dim);
    }
    t.layout = t.layout.ZeroShard(Uniform(rng, 0, 1) == 1);
    in.tensors.push_back(std::move(t));
  }
  const int old_world = in.old_config.world();
  std::vector<int32_t> perm(static_cast<size_t>(old_world));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  in.old_participant_of_rank = perm;
  std::vector<int32_t> available;
  for (int32_t q : perm) {
    if (Uniform(rng, 0, 5) > 0) available.push_back(q);  // else it leaves
  }
  int32_t next = old_world;
  const int joiners =
      std::max(0, in.new_config.world() - static_cast<int>(available.size())) + Uniform(rng, 0, 1);
  for (int j = 0; j < joiners; ++j) available.push_back(next++);
  std::shuffle(available.begin(), available.end(), rng);
  in.available = available;
  in.num_participants = next;
  return in;
}

TEST(ReshardE2ETest, PlannerPlansRunByExecutorMatchReference) {
  const unsigned long long seed = morph::testing::TestSeed();
  std::printf("reshard_e2e_test seed: %llu (rerun with MORPH_TEST_SEED=%llu)\n", seed, seed);
  Rng rng(seed);
  const int kCases = 1000;
  int64_t moved = 0;
  for (int i = 0; i < kCases; ++i) {
    const PlanInput in = RandomInput(rng);
    SCOPED_TRACE("case " + std::to_string(i) + ": old " + in.old_config.ToString() + ", new " +
                 in.new_config.ToString() + ", seed " + std::to_string(seed));
    MORPH_ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(in));
    MORPH_ASSERT_OK_AND_ASSIGN(std::vector<LocalPlan> plans, planner.PlanAll());
    const int n = in.num_participants;
    ASSERT_EQ(static_cast<int>(plans.size()), n);
    std::vector<std::vector<char>> ref;
    for (size_t t = 0; t < plans[0].tensors.size(); ++t) {
      ref.push_back(testutil::ReferenceTensor(plans[0].tensors[t], static_cast<int>(t)));
    }
    std::vector<testutil::ParticipantData> data;
    for (const LocalPlan& p : plans) data.push_back(testutil::MakeParticipantData(p, ref));
    std::vector<StatusOr<ExecutorStats>> stats(static_cast<size_t>(n), InternalError("not run"));
    auto hub = std::make_shared<InProcHub>(n);
    ExecutorOptions opts;
    opts.chunk_bytes = 64 << Uniform(rng, 0, 6);
    opts.staging_bytes = opts.chunk_bytes * static_cast<uint64_t>(Uniform(rng, 1, 32));
    std::vector<std::thread> threads;
    for (int p = 0; p < n; ++p) {
      threads.emplace_back([&, p] {
        const size_t i = static_cast<size_t>(p);
        InProcTransport t(hub, p);
        stats[i] =
            ExecutePlan(plans[i], data[i].olds, data[i].news, t, opts, Deadline::AfterMs(30000));
      });
    }
    for (auto& t : threads) t.join();
    for (int p = 0; p < n; ++p) {
      const size_t pi = static_cast<size_t>(p);
      MORPH_ASSERT_OK(stats[pi]);
      moved += stats[pi]->bytes_received;
      for (size_t t = 0; t < plans[pi].tensors.size(); ++t) {
        if (!plans[pi].new_shards[t]) continue;
        ASSERT_EQ(data[pi].new_data[t],
                  testutil::ExtractShard(plans[pi].tensors[t], *plans[pi].new_shards[t], ref[t]))
            << "participant " << p << " tensor " << plans[pi].tensors[t].name;
      }
    }
    // The executor moved exactly what the planner said it would.
    MORPH_ASSERT_OK_AND_ASSIGN(PlanSummary summary, planner.Summarize(plans));
    int64_t received = 0;
    for (const auto& s : stats) received += s->bytes_received;
    ASSERT_EQ(received, summary.bytes_moved);
  }
  std::printf("reshard_e2e_test: %d reconfigurations, %lld bytes moved\n", kCases,
              static_cast<long long>(moved));
}

// Checkpoints through the same layouts: every rank of config A saves the pieces ShardOf gives it
// (each element once: DP replicas are saved by d == 0, TP replicas by t == 0), then every rank of
// config B loads ShardOf(B) from them.
TEST(ReshardE2ETest, CheckpointSavedUnderOneConfigLoadsUnderAnother) {
  const unsigned long long seed = morph::testing::TestSeed();
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  char tmpl[] = "/tmp/morph_e2e_ckpt_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  for (int i = 0; i < 40; ++i) {
    const PlanInput in = RandomInput(rng);
    SCOPED_TRACE("case " + std::to_string(i) + ": old " + in.old_config.ToString() + ", new " +
                 in.new_config.ToString());
    const std::string dir = root + "/case-" + std::to_string(i);
    std::vector<std::vector<char>> ref;
    for (size_t t = 0; t < in.tensors.size(); ++t) {
      const TensorInfo info{in.tensors[t].name, in.tensors[t].dtype, in.tensors[t].shape};
      ref.push_back(testutil::ReferenceTensor(info, static_cast<int>(t)));
    }
    const ParallelConfig& a = in.old_config;
    std::vector<std::vector<char>> keep;
    keep.reserve(static_cast<size_t>(a.world()) * in.tensors.size());
    for (int r = 0; r < a.world(); ++r) {
      const ParallelConfig::Coords c = a.CoordsOf(r);
      std::vector<CheckpointPiece> pieces;
      for (size_t t = 0; t < in.tensors.size(); ++t) {
        const TensorSpec& spec = in.tensors[t];
        if (!(spec.layout.zero_sharded() || c.d == 0) || !(spec.layout.tp_split() || c.t == 0)) {
          continue;
        }
        MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(spec, a, r));
        if (s.empty()) continue;
        const TensorInfo info{spec.name, spec.dtype, spec.shape};
        keep.push_back(testutil::ExtractShard(info, s, ref[t]));
        pieces.push_back(
            {info, s, ConstBufferView(keep.back().data(), keep.back().size(), MemoryKind::kHost)});
      }
      MORPH_ASSERT_OK_AND_ASSIGN(auto save, SaveCheckpointAsync(dir, r, a.world(), 7, {}, pieces));
      MORPH_ASSERT_OK(save->Wait(Deadline::AfterMs(60000)));
    }
    MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir));
    const ParallelConfig& b = in.new_config;
    for (int r = 0; r < b.world(); ++r) {
      for (size_t t = 0; t < in.tensors.size(); ++t) {
        const TensorSpec& spec = in.tensors[t];
        MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(spec, b, r));
        const TensorInfo info{spec.name, spec.dtype, spec.shape};
        std::vector<char> got(static_cast<size_t>(s.NumElements() * DTypeSize(spec.dtype)));
        MORPH_ASSERT_OK(ckpt.Read(spec.name, spec.dtype, s,
                                  BufferView{got.data(), got.size(), MemoryKind::kHost}));
        ASSERT_EQ(got, testutil::ExtractShard(info, s, ref[t])) << spec.name << " rank " << r;
      }
    }
  }
  std::filesystem::remove_all(root);
}

// ---------------------------------------------------------------------------------------------
// The layouts real checkpoints use (issue 7 §5), end to end through the executor, checked slot by
// slot against testutil::ReferenceSlots (built from the layout definition element by element,
// sharing no code with ShardOf or the planner). Old padding slots hold garbage (never moved),
// new buffers start as garbage (padding must come back zero-filled).

constexpr char kGarbage = 0x5A;

// Runs every participant's plan over the in-process transport and checks the new buffers.
// `lost` pieces, if any, are filled from the reference first (a checkpoint would).
void RunAndCheckSlots(const PlanInput& in, uint64_t chunk_bytes) {
  MORPH_ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(in));
  MORPH_ASSERT_OK_AND_ASSIGN(std::vector<LocalPlan> plans, planner.PlanAll());
  const int n = in.num_participants;
  const auto& a = planner.assignment();
  const size_t nt = in.tensors.size();
  const size_t np = static_cast<size_t>(n);
  std::vector<std::vector<std::vector<char>>> old_data(np), new_data(np);
  std::vector<std::vector<OldShardData>> olds(np);
  std::vector<std::vector<NewShardData>> news(np);
  for (int q = 0; q < n; ++q) {
    const size_t qi = size_t(q);
    old_data[qi].resize(nt);
    new_data[qi].resize(nt);
    const int32_t r = a.old_rank_of_participant[qi], s = a.new_rank_of_participant[qi];
    for (size_t t = 0; t < nt; ++t) {
      const TensorSpec& spec = in.tensors[t];
      const int es = DTypeSize(spec.dtype);
      if (r >= 0 && plans[qi].old_shards[t]) {
        const std::vector<int64_t> slots = testutil::ReferenceSlots(spec, in.old_config, r);
        ASSERT_EQ(int64_t(slots.size()), plans[qi].old_shards[t]->NumElements()) << spec.name;
        std::vector<char>& b = old_data[qi][t];
        for (int64_t e : slots) {
          for (int k = 0; k < es; ++k) {
            b.push_back(e < 0 ? kGarbage
                              : static_cast<char>(testutil::ReferenceByte(int(t), e, k)));
          }
        }
        olds[qi].push_back(
            {spec.name, spec.dtype, ConstBufferView(b.data(), b.size(), MemoryKind::kHost)});
      }
      if (s >= 0 && plans[qi].new_shards[t]) {
        std::vector<char>& b = new_data[qi][t];
        b.assign(size_t(plans[qi].new_shards[t]->NumElements() * es), kGarbage);
        news[qi].push_back(
            {spec.name, spec.dtype, BufferView{b.data(), b.size(), MemoryKind::kHost}});
      }
    }
  }
  std::vector<StatusOr<ExecutorStats>> stats(size_t(n), InternalError("not run"));
  auto hub = std::make_shared<InProcHub>(n);
  ExecutorOptions opts;
  opts.chunk_bytes = chunk_bytes;
  opts.staging_bytes = chunk_bytes * 8;
  std::vector<std::thread> threads;
  for (int p = 0; p < n; ++p) {
    threads.emplace_back([&, p] {
      InProcTransport tr(hub, p);
      stats[size_t(p)] = ExecutePlan(plans[size_t(p)], olds[size_t(p)], news[size_t(p)], tr, opts,
                                     Deadline::AfterMs(30000));
    });
  }
  for (auto& t : threads) t.join();
  for (int q = 0; q < n; ++q) {
    MORPH_ASSERT_OK(stats[size_t(q)]);
    const int32_t s = a.new_rank_of_participant[size_t(q)];
    if (s < 0) continue;
    for (size_t t = 0; t < nt; ++t) {
      const TensorSpec& spec = in.tensors[t];
      const std::vector<int64_t> slots = testutil::ReferenceSlots(spec, in.new_config, s);
      const std::vector<char>& b = new_data[size_t(q)][t];
      const int es = DTypeSize(spec.dtype);
      ASSERT_EQ(b.size(), slots.size() * size_t(es)) << spec.name << " new rank " << s;
      for (size_t e = 0; e < slots.size(); ++e) {
        for (int k = 0; k < es; ++k) {
          const char want =
              slots[e] < 0 ? 0 : static_cast<char>(testutil::ReferenceByte(int(t), slots[e], k));
          ASSERT_EQ(b[e * size_t(es) + size_t(k)], want)
              << spec.name << " new rank " << s << " slot " << e << " element " << slots[e];
        }
      }
    }
  }
  MORPH_ASSERT_OK_AND_ASSIGN(PlanSummary sum, planner.Summarize(plans));
  ASSERT_EQ(sum.bytes_moved, sum.bytes_lower_bound);
}

ParallelConfig Cfg(int dp, int tp, int pp, int layers = 4) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(layers, pp);
  return c;
}

// Old ranks held by participants 0..W-1 in order, every one available, joiners after them.
PlanInput Change(std::vector<TensorSpec> tensors, ParallelConfig from, ParallelConfig to) {
  PlanInput in;
  in.tensors = std::move(tensors);
  in.old_config = std::move(from);
  in.new_config = std::move(to);
  for (int r = 0; r < in.old_config.world(); ++r) in.old_participant_of_rank.push_back(r);
  const int n = std::max(in.old_config.world(), in.new_config.world());
  for (int q = 0; q < n; ++q) in.available.push_back(q);
  in.num_participants = n;
  return in;
}

// A GPT-like block with each new layout: fused QKV with grouped-query attention as 6 equal
// blocks (4 query groups, k, v), a fused gate/up projection
// (2 blocks on dim 1), a tied embedding on the first and last layer with a vocabulary padded to
// a multiple of 4 * tp, and optimizer moments under hybrid ZeRO (groups of 2).
std::vector<TensorSpec> RealModel(int lcm) {
  return {
      {"qkv", DType::kBF16, {6 * 2 * lcm, 5}, Layout::Layer(1).SplitTPBlocks(0, 6)},
      {"qkv.adam_m",
       DType::kF32,
       {6 * 2 * lcm, 5},
       Layout::Layer(1).SplitTPBlocks(0, 6).ZeroShard(2)},
      {"gate_up", DType::kF32, {3, 2 * 3 * lcm}, Layout::Layer(2).SplitTPBlocks(1, 2)},
      {"embed", DType::kF32, {37, 3}, Layout::Layers({0, 3}).SplitTP(0).PadToMultiple(4)},
      {"embed.adam_v",
       DType::kF64,
       {37, 3},
       Layout::Layer(0).AlsoOnLayer(3).SplitTP(0).PadToMultiple(4).ZeroShard(2)},
      {"norm", DType::kF32, {7}, Layout::Layer(2).ZeroShard(2)},
  };
}

TEST(ReshardE2ETest, RealModelLayoutsAcrossTpPpDpChanges) {
  struct Step {
    const char* what;
    ParallelConfig from, to;
  };
  const std::vector<Step> steps = {
      {"tp 4 -> 2", Cfg(2, 4, 1), Cfg(2, 2, 1)},
      {"tp 2 -> 4", Cfg(2, 2, 1), Cfg(2, 4, 1)},
      {"tp 1 -> 3 (padding 4 -> 12)", Cfg(2, 1, 2), Cfg(2, 3, 2)},
      {"pp 2 -> 4", Cfg(2, 1, 2), Cfg(2, 1, 4)},
      {"pp 4 -> 1", Cfg(2, 1, 4), Cfg(2, 1, 1)},
      {"dp 4 -> 2", Cfg(4, 1, 1), Cfg(2, 1, 1)},
      {"dp 2 -> 6", Cfg(2, 2, 1), Cfg(6, 1, 1)},
      {"tp, pp and dp at once", Cfg(4, 2, 2), Cfg(2, 3, 1)},
  };
  for (const Step& st : steps) {
    SCOPED_TRACE(st.what);
    const int lcm = std::lcm(st.from.tp, st.to.tp);
    RunAndCheckSlots(Change(RealModel(lcm), st.from, st.to), 256);
  }
}

// Hybrid ZeRO keeps a live copy of every shard in the other groups: a dead worker's ZeRO range
// comes from its replica, where plain ZeRO (one copy) has nothing to recover it from.
TEST(ReshardE2ETest, HybridZeroShardSurvivesTheLossOfAWorker) {
  const std::vector<TensorSpec> hybrid = {
      {"m", DType::kF32, {6, 10}, Layout::Layer(0).SplitTP(1).ZeroShard(2)}};
  PlanInput in = Change(hybrid, Cfg(4, 2, 1), Cfg(2, 2, 1));
  in.old_participant_of_rank[1] = -1;  // (d 0, t 1) died
  in.available = {0, 2, 3, 4, 5, 6, 7};
  RunAndCheckSlots(in, 128);
  PlanInput plain = in;
  plain.tensors[0].layout = Layout::Layer(0).SplitTP(1).ZeroShard();
  MORPH_ASSERT_OK_AND_ASSIGN(Planner p, Planner::Create(plain));
  EXPECT_EQ(p.PlanAll().status().code(), StatusCode::kDataLoss);
}

// A hybrid ZeRO group size that does not divide the new dp is refused up front, naming the
// tensor and the group size (no implicit regrouping).
TEST(ReshardE2ETest, HybridZeroGroupMustDivideDp) {
  const std::vector<TensorSpec> hybrid = {
      {"m", DType::kF32, {6, 10}, Layout::Layer(0).ZeroShard(2)}};
  const auto p = Planner::Create(Change(hybrid, Cfg(4, 1, 1), Cfg(3, 1, 1)));
  ASSERT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), ::testing::HasSubstr("tensor 'm'"));
  EXPECT_THAT(p.status().message(), ::testing::HasSubstr("zero_group=2 does not divide dp=3"));
  EXPECT_THAT(p.status().message(), ::testing::HasSubstr("new config"));
}

// Random reconfigurations whose tensors use the new layouts.
TEST(ReshardE2ETest, RandomRealModelLayouts) {
  const unsigned long long seed = morph::testing::TestSeed() + 7;
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed - 7));
  Rng rng(seed);
  for (int i = 0; i < 150; ++i) {
    const int layers = 4;
    ParallelConfig from = Cfg(Uniform(rng, 1, 4), Uniform(rng, 1, 3), Uniform(rng, 1, 2), layers);
    ParallelConfig to = Cfg(Uniform(rng, 1, 4), Uniform(rng, 1, 3), Uniform(rng, 1, 2), layers);
    const int lcm = std::lcm(from.tp, to.tp), g = std::gcd(from.dp, to.dp);
    std::vector<TensorSpec> ts;
    ts.push_back({"blocks",
                  DType::kF32,
                  {Uniform(rng, 2, 3) * lcm * Uniform(rng, 1, 2) * 2, 3},
                  Layout::Layer(Uniform(rng, 0, 3)).SplitTPBlocks(0, 2)});
    ts.push_back({"padded",
                  DType::kBF16,
                  {3, Uniform(rng, 1, 20)},
                  Layout::Layers({0, layers - 1}).SplitTP(1).PadToMultiple(Uniform(rng, 1, 3))});
    Layout hz = Layout::Layer(Uniform(rng, 0, 3)).ZeroShard(g % 2 == 0 ? 2 : 1);
    if (Uniform(rng, 0, 1)) hz = hz.AlsoOnLayer(Uniform(rng, 0, 3));
    ts.push_back({"hybrid", DType::kF64, {Uniform(rng, 1, 30)}, hz});
    ts.push_back({"mix",
                  DType::kU8,
                  {4 * lcm, 5},
                  Layout::Layers({1, 2}).SplitTPBlocks(0, 4).ZeroShard(Uniform(rng, 0, 1) == 1)});
    // Torch's layouts (issue 24): uneven torch.chunk splits and FSDP2/HSDP dim-0 chunks.
    const int k = Uniform(rng, 0, 1);
    ts.push_back({"fsdp_tp",
                  DType::kF32,
                  {Uniform(rng, 0, 9), Uniform(rng, 1, 7)},
                  Layout::Layer(Uniform(rng, 0, 3)).ChunkTP(k).ChunkDP(g % 2 == 0 ? 2 : 0)});
    SCOPED_TRACE("case " + std::to_string(i) + ": " + from.ToString() + " -> " + to.ToString());
    RunAndCheckSlots(Change(ts, from, to), 64 << Uniform(rng, 0, 4));
  }
}

// Saves `model`'s state under config `a` into `dir` (each element once: the first stage holding
// a tensor, d < G, t == 0 for unsplit tensors; padding never saved), old buffers from the
// reference with garbage padding.
void SaveModel(const std::vector<TensorSpec>& model, const ParallelConfig& a,
               const std::string& dir) {
  std::vector<std::vector<char>> keep;
  keep.reserve(size_t(a.world()) * model.size());
  for (int r = 0; r < a.world(); ++r) {
    const ParallelConfig::Coords c = a.CoordsOf(r);
    std::vector<CheckpointPiece> pieces;
    for (size_t t = 0; t < model.size(); ++t) {
      const TensorSpec& spec = model[t];
      const int g = spec.layout.zero_sharded() ? ZeroGroupSize(spec.layout, a) : 1;
      if (c.d >= g || (!spec.layout.tp_split() && c.t != 0) ||
          c.p != StagesOfUnchecked(spec, a).front()) {
        continue;
      }
      MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(spec, a, r));
      if (s.empty()) continue;
      const std::vector<int64_t> slots = testutil::ReferenceSlots(spec, a, r);
      const int es = DTypeSize(spec.dtype);
      keep.emplace_back();
      for (int64_t e : slots) {
        for (int k = 0; k < es; ++k) {
          keep.back().push_back(e < 0 ? kGarbage
                                      : static_cast<char>(testutil::ReferenceByte(int(t), e, k)));
        }
      }
      TensorInfo info{spec.name, spec.dtype, PlanShape(spec), {}};
      if (spec.layout.pad_multiple() > 0) {
        info.padded_shape = info.shape;
        info.padded_shape[size_t(spec.layout.tp_dim())] = SplitLength(spec, a);
      }
      pieces.push_back(
          {info, s, ConstBufferView(keep.back().data(), keep.back().size(), MemoryKind::kHost)});
    }
    MORPH_ASSERT_OK_AND_ASSIGN(auto save, SaveCheckpointAsync(dir, r, a.world(), 3, {}, pieces));
    MORPH_ASSERT_OK(save->Wait(Deadline::AfterMs(60000)));
  }
}

// Loads every shard of `model` under config `b` from the checkpoint in `dir` through
// Read(TensorInfo) and checks it slot by slot (padding zero-filled). `model` may lay the tensors
// out differently from the saved model (same names, dtypes and shapes).
void LoadAndCheckModel(const std::vector<TensorSpec>& model, const ParallelConfig& b,
                       const std::string& dir) {
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir));
  for (const TensorInfo& saved : ckpt.tensors()) {
    for (const TensorSpec& spec : model) {
      if (spec.name == saved.name) {
        EXPECT_EQ(saved.shape, PlanShape(spec)) << "no padding saved";
      }
    }
  }
  for (int r = 0; r < b.world(); ++r) {
    for (size_t t = 0; t < model.size(); ++t) {
      const TensorSpec& spec = model[t];
      MORPH_ASSERT_OK_AND_ASSIGN(Shard s, ShardOf(spec, b, r));
      TensorInfo info{spec.name, spec.dtype, PlanShape(spec), {}};
      if (spec.layout.pad_multiple() > 0) {
        info.padded_shape = info.shape;
        info.padded_shape[size_t(spec.layout.tp_dim())] = SplitLength(spec, b);
      }
      const int es = DTypeSize(spec.dtype);
      std::vector<char> got(size_t(s.NumElements() * es), kGarbage);
      MORPH_ASSERT_OK(ckpt.Read(info, s, BufferView{got.data(), got.size(), MemoryKind::kHost}));
      const std::vector<int64_t> slots = testutil::ReferenceSlots(spec, b, r);
      ASSERT_EQ(got.size(), slots.size() * size_t(es));
      for (size_t e = 0; e < slots.size(); ++e) {
        for (int k = 0; k < es; ++k) {
          const char want =
              slots[e] < 0 ? 0 : static_cast<char>(testutil::ReferenceByte(int(t), slots[e], k));
          ASSERT_EQ(got[e * size_t(es) + size_t(k)], want)
              << spec.name << " rank " << r << " slot " << e;
        }
      }
    }
  }
}

std::string TempDir() {
  char tmpl[] = "/tmp/morph_e2e_layouts_XXXXXX";
  EXPECT_NE(::mkdtemp(tmpl), nullptr);
  return tmpl;
}

// Checkpoints of the new layouts: saved under one config, loaded under another.
TEST(ReshardE2ETest, RealModelCheckpointLoadsIntoAnotherConfig) {
  const std::string root = TempDir();
  struct Step {
    ParallelConfig from, to;
  };
  const std::vector<Step> steps = {
      {Cfg(2, 4, 2), Cfg(4, 2, 4)}, {Cfg(4, 1, 1), Cfg(2, 3, 2)}, {Cfg(2, 3, 4), Cfg(2, 1, 1)}};
  for (size_t i = 0; i < steps.size(); ++i) {
    const ParallelConfig& a = steps[i].from;
    const ParallelConfig& b = steps[i].to;
    SCOPED_TRACE(a.ToString() + " -> " + b.ToString());
    const std::vector<TensorSpec> model = RealModel(std::lcm(a.tp, b.tp));
    const std::string dir = root + "/step-" + std::to_string(i);
    SaveModel(model, a, dir);
    LoadAndCheckModel(model, b, dir);
  }
  std::filesystem::remove_all(root);
}

// FSDP2 + TP as torch lays parameters out: DTensor's Shard(d) with torch.chunk sizes
// (ColwiseParallel cuts dim 0, RowwiseParallel dim 1; tp need not divide them) and FSDP2's
// Shard(0) of each TP-local piece (torch's _StridedShard when both cut dim 0), FSDP-only norms,
// HSDP moments (groups of 2, when `hybrid`). Every size is uneven somewhere.
std::vector<TensorSpec> TorchModel(bool hybrid) {
  const Layout moment =
      hybrid ? Layout::Layer(1).ChunkTP(1).ChunkDP(2) : Layout::Layer(1).ChunkTP(1).ChunkDP();
  return {
      {"wq", DType::kBF16, {11, 6}, Layout::Layer(1).ChunkTP(0).ChunkDP()},
      {"wo", DType::kF32, {6, 11}, Layout::Layer(1).ChunkTP(1).ChunkDP()},
      {"wo.adam_m", DType::kF32, {6, 11}, moment},
      {"embed", DType::kF32, {13, 3}, Layout::Layers({0, 3}).ChunkTP(0).ChunkDP()},
      {"norm", DType::kF32, {7}, Layout::Layer(2).ChunkDP()},
      {"bias", DType::kF64, {5}, Layout::Layer(3).ChunkTP(0)},
      {"gate_up", DType::kF32, {3, 2 * 60}, Layout::Layer(2).SplitTPBlocks(1, 2).ChunkDP()},
  };
}

TEST(ReshardE2ETest, TorchChunkLayoutsAcrossTpPpDpChanges) {
  struct Step {
    const char* what;
    ParallelConfig from, to;
    bool hybrid;
  };
  const std::vector<Step> steps = {
      {"tp 4 -> 2", Cfg(2, 4, 1), Cfg(2, 2, 1), true},
      {"tp 2 -> 3", Cfg(2, 2, 1), Cfg(2, 3, 1), true},
      {"tp 1 -> 5 (empty chunks)", Cfg(2, 1, 2), Cfg(2, 5, 2), true},
      {"pp 2 -> 4", Cfg(2, 1, 2), Cfg(2, 1, 4), true},
      {"dp 4 -> 2", Cfg(4, 1, 1), Cfg(2, 1, 1), true},
      {"dp 2 -> 6", Cfg(2, 2, 1), Cfg(6, 1, 1), true},
      {"dp 3 -> 5 (more ranks than rows)", Cfg(3, 2, 1), Cfg(5, 1, 1), false},
      {"tp, pp and dp at once", Cfg(4, 2, 2), Cfg(2, 3, 1), true},
  };
  for (const Step& st : steps) {
    SCOPED_TRACE(st.what);
    RunAndCheckSlots(Change(TorchModel(st.hybrid), st.from, st.to), 256);
  }
}

// A checkpoint saved in torch's layouts loads re-sliced into flat ZeRO layouts and back (same
// names, dtypes and shapes; the layout is the reader's).
TEST(ReshardE2ETest, TorchLayoutCheckpointLoadsIntoOtherLayouts) {
  const std::string root = TempDir();
  const std::vector<TensorSpec> torch = TorchModel(true);
  std::vector<TensorSpec> flat = torch;
  for (TensorSpec& t : flat) {
    const std::vector<int> layers = t.layout.layers();
    // Block-interleaved tensors are saved in their block view: they keep their blocks.
    t.layout = t.layout.tp_blocks() > 1 ? t.layout.ZeroShard()
                                        : Layout::Layers(layers).ZeroShard(t.name != "bias");
  }
  SaveModel(torch, Cfg(2, 3, 2), root + "/torch");
  LoadAndCheckModel(flat, Cfg(3, 2, 1), root + "/torch");
  LoadAndCheckModel(torch, Cfg(4, 2, 4), root + "/torch");
  SaveModel(flat, Cfg(3, 1, 2), root + "/flat");
  LoadAndCheckModel(torch, Cfg(2, 4, 1), root + "/flat");
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace morph
