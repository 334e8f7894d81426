#include "runtime/plan/plan_input.h"

#include <gtest/gtest.h>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;

JobManifest Model() {
  JobManifest m;
  m.model.num_layers = 2;
  m.model.tp_candidates = {1, 2};
  m.model.pp_candidates = {1, 2};
  m.model.global_batch = 8;
  m.tensors.push_back({"l0.w", DType::kF32, {8, 16}, Layout::Layer(0).SplitTP(1)});
  m.tensors.push_back({"l1.w", DType::kF32, {8, 16}, Layout::Layer(1).SplitTP(0).ZeroShard()});
  m.scalars.push_back({"rng", 16});
  return m;
}

ParallelConfig Dp(int dp) {
  return ParallelConfig{.dp = dp, .tp = 1, .pp = 1, .stage_of_layer = {0, 0}};
}

TEST(ManifestTest, FirstDifferenceNamesTheTensorAndField) {
  JobManifest a = Model(), b = Model();
  EXPECT_EQ(FirstDifference(a, b), "");
  b.tensors[1].shape = {8, 32};
  EXPECT_EQ(FirstDifference(a, b), "tensor 'l1.w' (#1): shape [8, 16] vs [8, 32]");
  b = Model();
  b.tensors[0].dtype = DType::kBF16;
  EXPECT_EQ(FirstDifference(a, b), "tensor 'l0.w' (#0): dtype f32 vs bf16");
  b = Model();
  b.tensors.pop_back();
  EXPECT_EQ(FirstDifference(a, b), "tensor count: 2 vs 1 (first unmatched: 'l1.w')");
  b = Model();
  b.scalars[0].bytes = 8;
  EXPECT_EQ(FirstDifference(a, b), "scalar 'rng': 16 bytes vs 8 bytes");
  b = Model();
  b.model.global_batch = 16;
  EXPECT_EQ(FirstDifference(a, b), "model.global_batch: 8 vs 16");
  EXPECT_NE(ManifestDigest(a), ManifestDigest(b));
}

TEST(ManifestTest, ValidateRejectsDuplicates) {
  JobManifest m = Model();
  MORPH_EXPECT_OK(ValidateManifest(m));
  m.tensors.push_back(m.tensors[0]);
  EXPECT_THAT(ValidateManifest(m),
              StatusIs(StatusCode::kInvalidArgument, "tensor 'l0.w' is registered twice"));
  m = Model();
  m.scalars.push_back({"rng", 4});
  EXPECT_THAT(ValidateManifest(m),
              StatusIs(StatusCode::kInvalidArgument, "scalar 'rng' is registered twice"));
}

TEST(PlanInputTest, ParticipantOrderIsOldRanksThenJoinersById) {
  Generation from{.id = 1, .config = Dp(3), .ranks = {5, 2, 9}};
  std::vector<WorkerId> lost = {2};
  std::vector<WorkerId> next = {9, 11, 5, 7};
  EXPECT_EQ(ParticipantOrder(from, lost, next), (std::vector<WorkerId>{5, 9, 7, 11}));
}

TEST(PlanInputTest, CoordinatorAndParticipantsAgreeOnTheDigest) {
  JobManifest m = Model();
  Generation from{.id = 1, .config = Dp(2), .ranks = {3, 4}};
  std::vector<WorkerId> cands = {3, 4, 8, 6};
  MORPH_ASSERT_OK_AND_ASSIGN(std::vector<WorkerId> ranks, AssignRanks(m, from, {}, cands, Dp(4)));
  ASSERT_EQ(ranks.size(), 4u);
  // Resident bytes are maximal: the old ranks keep ranks that hold their ZeRO range.
  EXPECT_EQ(ranks[0], 3);
  Generation next{.id = 2, .config = Dp(4), .ranks = ranks};
  ChangeParticipants change{.participants = ParticipantOrder(from, {}, ranks)};
  MORPH_ASSERT_OK_AND_ASSIGN(ChangePlan a, PlanForChange(m, from, next, change));
  MORPH_ASSERT_OK_AND_ASSIGN(ChangePlan b, PlanForChange(m, from, next, change));
  EXPECT_EQ(a.digest, b.digest);
  ASSERT_TRUE(a.planner.has_value());
  EXPECT_EQ(a.IndexOf(6), 2);
  // Another assignment is another digest.
  Generation swapped = next;
  std::swap(swapped.ranks[2], swapped.ranks[3]);
  MORPH_ASSERT_OK_AND_ASSIGN(ChangePlan c, PlanForChange(m, from, swapped, change));
  EXPECT_NE(a.digest, c.digest);
  // Participants out of the protocol's order are refused.
  ChangeParticipants bad = change;
  std::swap(bad.participants[2], bad.participants[3]);
  EXPECT_THAT(PlanForChange(m, from, next, bad), StatusIs(StatusCode::kInvalidArgument, ::testing::HasSubstr("order")));
}

TEST(PlanInputTest, FirstGenerationTakesLowestIdsAndMovesNothing) {
  JobManifest m = Model();
  Generation none;
  std::vector<WorkerId> cands = {9, 4, 7};
  MORPH_ASSERT_OK_AND_ASSIGN(std::vector<WorkerId> ranks, AssignRanks(m, none, {}, cands, Dp(2)));
  EXPECT_EQ(ranks, (std::vector<WorkerId>{4, 7}));
  Generation g1{.id = 1, .config = Dp(2), .ranks = ranks};
  MORPH_ASSERT_OK_AND_ASSIGN(ChangePlan p, PlanForChange(m, none, g1, {.participants = ranks}));
  EXPECT_FALSE(p.planner.has_value());
  EXPECT_NE(p.digest, 0u);
  EXPECT_THAT(AssignRanks(m, none, {}, cands, Dp(4)),
              StatusIs(StatusCode::kFailedPrecondition,
                       "config dp=4 tp=1 pp=1 zero=0 layers=2 needs 4 workers, only 3 candidates"));
}

}  // namespace
}  // namespace morph
