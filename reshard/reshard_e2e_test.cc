// End to end: the planner's LocalPlans (plan.h) run by the executor over the in-process
// transport, one thread per participant, on random reconfigurations (DP/TP/PP/ZeRO changes,
// leavers, joiners). Every new shard must equal the reference bitwise.
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
#include "reshard/plan_test_util.h"
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

}  // namespace
}  // namespace morph
