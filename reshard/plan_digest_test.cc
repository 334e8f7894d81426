#include "reshard/plan_digest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "base/testing.h"
#include "reshard/plan.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

ParallelConfig Config(int dp, int tp) {
  return ParallelConfig{.dp = dp, .tp = tp, .pp = 1, .stage_of_layer = {0}, .zero_stage = 1};
}

PlanInput Input() {
  return PlanInput{.tensors = {{"w", DType::kF32, {64, 32}, Layout::Layer(0).SplitTP(0)},
                               {"m", DType::kBF16, {64, 32}, Layout::Layer(0).ZeroShard()}},
                   .old_config = Config(2, 2),
                   .old_participant_of_rank = {0, 1, 2, 3},
                   .new_config = Config(3, 1),
                   .available = {0, 2, 3},
                   .num_participants = 4};
}

PlanDigest DigestOf(const PlanInput& in, const PlanOptions& o = {}) {
  auto p = Planner::Create(in, o);
  EXPECT_TRUE(p.ok()) << p.status();
  return p->digest();
}

TEST(PlanDigestTest, HasherIsFnv1aOverLittleEndianBytes) {
  // An independent FNV-1a over the bytes the encoding promises: 8 little-endian bytes of 0x0102,
  // then the string "ab" as its length (8 bytes) and its bytes.
  const unsigned char bytes[] = {2, 1, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 'a', 'b'};
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  EXPECT_EQ(DigestHasher().Add(uint64_t{0x0102}).Add(std::string_view("ab")).value(), h);
  // Frozen: changing the encoding is a wire change (peers of different versions disagree).
  EXPECT_EQ(DigestHex(h), "f91620024734d02d");
}

TEST(PlanDigestTest, EachInputChangesOnlyItsPart) {
  const PlanInput base = Input();
  const PlanDigest d = DigestOf(base);
  EXPECT_TRUE(d.known());
  EXPECT_EQ(d.parts[PlanDigest::kMessageLayout], 0u);
  EXPECT_EQ(d, DigestOf(base)) << "deterministic";
  auto expect_only = [&](const PlanInput& in, std::vector<int> parts, const PlanOptions& o = {}) {
    const PlanDigest e = DigestOf(in, o);
    for (int k = 0; k < PlanDigest::kNumParts; ++k) {
      const bool differs = e.parts[static_cast<size_t>(k)] != d.parts[static_cast<size_t>(k)];
      const bool want = std::find(parts.begin(), parts.end(), k) != parts.end();
      // The assignment follows from the other inputs: it may change with them.
      if (k == PlanDigest::kAssignment && parts.size() > 1) continue;
      EXPECT_EQ(differs, want) << PlanDigest::PartName(k);
    }
    EXPECT_NE(e.combined(), d.combined());
    return d.Differences(e);
  };
  PlanInput in = base;
  in.tensors[1].dtype = DType::kF16;
  EXPECT_EQ(expect_only(in, {PlanDigest::kTensors}), "tensors");
  in = base;
  in.tensors[0].shape[1] = 16;
  expect_only(in, {PlanDigest::kTensors});
  in = base;
  in.old_config.zero_stage = 0;
  EXPECT_EQ(expect_only(in, {PlanDigest::kOldConfig}), "old config");
  in = base;
  in.old_participant_of_rank = {1, 0, 2, 3};
  expect_only(in, {PlanDigest::kOldParticipants, PlanDigest::kAssignment});
  in = base;
  in.new_config = Config(2, 1);
  expect_only(in, {PlanDigest::kNewConfig, PlanDigest::kAssignment});
  in = base;
  in.available = {3, 0, 2};  // a set: the order does not matter
  EXPECT_EQ(DigestOf(in), d);
  in.available = {0, 1, 2, 3};
  expect_only(in, {PlanDigest::kParticipants});
  PlanOptions o;
  o.max_world = 1000;
  // Different planner limits are a different plan input, which is its own part.
  const PlanDigest e = DigestOf(base, o);
  EXPECT_NE(e.parts[PlanDigest::kPlanOptions], d.parts[PlanDigest::kPlanOptions]);
  EXPECT_THAT(d.Differences(e), HasSubstr("plan options"));
}

// Every field of the real-model layouts enters the tensors part, and only it.
TEST(PlanDigestTest, EveryLayoutFieldChangesTheTensorsPart) {
  PlanInput base = Input();
  base.old_config = ParallelConfig{.dp = 2, .tp = 2, .pp = 1, .stage_of_layer = {0, 0}};
  base.new_config = ParallelConfig{.dp = 2, .tp = 1, .pp = 1, .stage_of_layer = {0, 0}};
  base.available = {0, 1, 2, 3};
  const PlanDigest d = DigestOf(base);
  std::vector<Layout> variants = {
      Layout::Layer(0).SplitTP(0).AlsoOnLayer(1),   Layout::Layers({1, 0}).SplitTP(0),
      Layout::Layer(0).SplitTPBlocks(0, 2),         Layout::Layer(0).SplitTPBlocks(0, 4),
      Layout::Layer(0).SplitTP(0).PadToMultiple(8), Layout::Layer(0).SplitTP(0).PadToMultiple(16),
      Layout::Layer(0).SplitTP(0).ZeroShard(2),     Layout::Layer(0).SplitTP(0).ZeroShard(1),
      Layout::Layer(0).ChunkTP(0),                  Layout::Layer(0).SplitTP(0).ChunkDP(),
      Layout::Layer(0).ChunkTP(0).ChunkDP(),        Layout::Layer(0).SplitTP(0).ChunkDP(2)};
  std::set<uint64_t> seen{d.parts[PlanDigest::kTensors]};
  for (const Layout& l : variants) {
    PlanInput in = base;
    in.tensors[0].layout = l;
    const PlanDigest e = DigestOf(in);
    EXPECT_TRUE(seen.insert(e.parts[PlanDigest::kTensors]).second) << l.ToString();
    EXPECT_EQ(e.parts[PlanDigest::kOldConfig], d.parts[PlanDigest::kOldConfig]);
  }
  // ChunkDP is not ZeRO: same group, different digest.
  PlanInput z = base, c = base;
  z.tensors[1].layout = Layout::Layer(0).ZeroShard();
  c.tensors[1].layout = Layout::Layer(0).ChunkDP();
  EXPECT_NE(DigestOf(z).parts[PlanDigest::kTensors], DigestOf(c).parts[PlanDigest::kTensors]);
  // ZeroShard(0) is ZeroShard(): the same layout, the same digest.
  PlanInput a = base, b = base;
  a.tensors[1].layout = Layout::Layer(0).ZeroShard(0);
  b.tensors[1].layout = Layout::Layer(0).ZeroShard();
  EXPECT_EQ(DigestOf(a), DigestOf(b));
}

TEST(PlanDigestTest, EveryLocalPlanCarriesThePlannersDigest) {
  MORPH_ASSERT_OK_AND_ASSIGN(Planner p, Planner::Create(Input()));
  for (int q = 0; q < 4; ++q) {
    MORPH_ASSERT_OK_AND_ASSIGN(LocalPlan lp, p.PlanFor(q));
    EXPECT_EQ(lp.digest, p.digest());
  }
  PlanDigest unknown;
  EXPECT_FALSE(unknown.known());
  EXPECT_EQ(unknown.Differences(unknown), "");
  EXPECT_EQ(unknown.Differences(p.digest()),
            "tensors, old config, old participant map, new config, available participants, "
            "assignment, plan options");
  EXPECT_EQ(p.digest().ToString().size(), 16u);
}

// Per-tensor sizes that fit int64 whose sum does not: morph-plan used to report 0 bytes needed.
TEST(PlanSummaryTest, ByteTotalsThatOverflowAreAnError) {
  PlanInput in{.tensors = {},
               .old_config = Config(1, 1),
               .old_participant_of_rank = {0},
               .new_config = Config(1, 1),
               .available = {0},
               .num_participants = 1};
  for (const char* name : {"a", "b", "c", "d"}) {
    in.tensors.push_back(
        {name, DType::kF64, {int64_t{1} << 30, int64_t{1} << 29}, Layout::Layer(0)});
  }
  // The model (4 x 2^62 bytes) is refused up front by the planner's size limit.
  EXPECT_THAT(Planner::Create(in).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("limit of 2^60 bytes")));
  // A model within the limit whose replicas' total is not: one replicated 2^59-byte tensor on
  // 16 new DP ranks needs 2^63 bytes. (Its old holder is lost, so no resident weight reaches
  // the exact solver's own bound.)
  in.tensors = {{"r", DType::kF64, {int64_t{1} << 27, int64_t{1} << 29}, Layout::Layer(0)}};
  in.old_participant_of_rank = {-1};
  in.new_config = Config(16, 1);
  in.available.clear();
  for (int q = 0; q < 16; ++q) in.available.push_back(q);
  in.num_participants = 16;
  MORPH_ASSERT_OK_AND_ASSIGN(Planner p, Planner::Create(in));
  EXPECT_TRUE(p.ComputeTotals().overflow);
  std::vector<std::vector<PieceMove>> lost;
  MORPH_ASSERT_OK_AND_ASSIGN(std::vector<LocalPlan> plans, p.PlanAll(&lost));
  EXPECT_THAT(p.Summarize(plans, &lost),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("bytes needed: the new shards of all ranks")));
  in.new_config = Config(15, 1);  // 15 * 2^59 < 2^63
  in.available.pop_back();
  in.num_participants = 15;
  MORPH_ASSERT_OK_AND_ASSIGN(Planner r, Planner::Create(in));
  EXPECT_FALSE(r.ComputeTotals().overflow);
  EXPECT_EQ(r.ComputeTotals().needed, 15 * (int64_t{1} << 59));
}

}  // namespace
}  // namespace morph
