#include "runtime/coordinator/config_planner.h"

#include <gtest/gtest.h>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

ConfigPlanner Make(ModelConstraints m, ConfigPolicy p = nullptr) {
  auto c = ConfigPlanner::Create(std::move(m), std::move(p));
  c.status().CheckOk("ConfigPlanner::Create");
  return *std::move(c);
}

ModelConstraints Gpt() {
  return ModelConstraints{.num_layers = 8,
                          .num_heads = 8,
                          .tp_candidates = {1, 2, 4},
                          .pp_candidates = {1, 2},
                          .global_batch = 64,
                          .micro_batches = 4};
}

TEST(ConfigPlannerTest, KeepsTpAndPpWhenTheyStillFit) {
  ConfigPlanner p = Make(Gpt());
  ParallelConfig cur{.dp = 4, .tp = 2, .pp = 1, .stage_of_layer = {0, 0, 0, 0, 0, 0, 0, 0}};
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice c, p.Choose(7, &cur));
  EXPECT_EQ(c.config.dp, 3);
  EXPECT_EQ(c.config.tp, 2);
  EXPECT_EQ(c.config.pp, 1);
  EXPECT_EQ(c.spares, 1);
  EXPECT_EQ(c.explanation, "keep tp=2 pp=1: dp=3 tp=2 pp=1 on 7 workers, 1 spare");
}

// Hybrid ZeRO groups of 2: dp stays even; the odd worker is a spare (a failure of one of four
// workers leaves dp=2 and a spare, not a dp the groups do not divide).
TEST(ConfigPlannerTest, DpIsAMultipleOfTheHybridZeroGroup) {
  ModelConstraints m = Gpt();
  m.tp_candidates = {1};
  m.pp_candidates = {1};
  m.dp_multiple = 2;
  ConfigPlanner p = Make(m);
  ParallelConfig cur{.dp = 4, .tp = 1, .pp = 1, .stage_of_layer = {0, 0, 0, 0, 0, 0, 0, 0}};
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice c, p.Choose(3, &cur));
  EXPECT_EQ(c.config.dp, 2);
  EXPECT_EQ(c.spares, 1);
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice fresh, p.Choose(5, nullptr));
  EXPECT_EQ(fresh.config.dp, 4);
  EXPECT_THAT(p.Choose(1, nullptr), StatusIs(StatusCode::kFailedPrecondition,
                                             HasSubstr("no DP rank left")));
}

TEST(ConfigPlannerTest, PicksTheHighestEstimatedThroughputAtStart) {
  ConfigPlanner p = Make(Gpt());
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice c, p.Choose(8, nullptr));
  // dp8: 8; tp2: 8*0.9 = 7.2; pp2: 8*4/5 = 6.4.
  EXPECT_EQ(c.config.world(), 8);
  EXPECT_EQ(c.config.tp, 1);
  EXPECT_EQ(c.config.pp, 1);
  EXPECT_EQ(c.config.stage_of_layer.size(), 8u);
  EXPECT_THAT(c.explanation, HasSubstr("highest estimated throughput"));
}

TEST(ConfigPlannerTest, MemoryForcesModelParallelism) {
  ModelConstraints m = Gpt();
  m.memory_per_rank = [](const ParallelConfig& c) { return int64_t{100} / (c.tp * c.pp); };
  m.device_memory_bytes = 30;  // tp*pp >= 4
  ConfigPlanner p = Make(m);
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice c, p.Choose(8, nullptr));
  // tp4 pp1: 8*0.81 = 6.48 beats tp2 pp2: 8*0.9*0.8 = 5.76.
  EXPECT_EQ(c.config.tp, 4);
  EXPECT_EQ(c.config.pp, 1);
  EXPECT_EQ(c.config.dp, 2);
  // The current tp=1 no longer fits a shrink: the planner says why it moved.
  ParallelConfig cur{.dp = 8, .tp = 1, .pp = 1};
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice d, p.Choose(6, &cur));
  EXPECT_EQ(d.config.tp * d.config.pp, 4);
  EXPECT_THAT(d.explanation, HasSubstr("tp=1 pp=1 no longer fits (needs 100 B per rank"));
  EXPECT_THAT(p.Choose(3, nullptr).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no configuration fits 3")));
}

TEST(ConfigPlannerTest, TpMustDivideTheHeads) {
  ModelConstraints m = Gpt();
  m.num_heads = 6;
  m.tp_candidates = {4};
  ConfigPlanner p = Make(m);
  EXPECT_THAT(p.Choose(8, nullptr).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("tp=4 does not divide 6 heads")));
}

TEST(ConfigPlannerTest, DpNeverExceedsTheGlobalBatch) {
  ModelConstraints m = Gpt();
  m.global_batch = 3;
  ConfigPlanner p = Make(m);
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice c, p.Choose(8, nullptr));
  EXPECT_LE(c.config.dp, 3);
}

TEST(ConfigPlannerTest, UserPolicyOverridesAndIsValidated) {
  ConfigPlanner p = Make(Gpt(),
                         [](int workers, const ParallelConfig*,
                            const ModelConstraints&) -> std::optional<ParallelConfig> {
                           if (workers == 5) return std::nullopt;  // let the default decide
                           return ParallelConfig{.dp = workers, .tp = 2, .pp = 1};
                         });
  MORPH_ASSERT_OK_AND_ASSIGN(ConfigChoice d, p.Choose(5, nullptr));
  EXPECT_THAT(d.explanation, HasSubstr("highest estimated throughput"));
  EXPECT_THAT(
      p.Choose(4, nullptr).status(),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("the user policy's config dp=4 tp=2 pp=1")));
}

TEST(ConfigPlannerTest, RejectsImpossibleConstraintsNamingTheField) {
  ModelConstraints m = Gpt();
  m.tp_candidates = {};
  EXPECT_THAT(ConfigPlanner::Create(m).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tp_candidates: empty")));
  m = Gpt();
  m.pp_candidates = {2, 0};
  EXPECT_THAT(ConfigPlanner::Create(m).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("pp_candidates: 0 is not")));
  m = Gpt();
  m.num_layers = 0;
  EXPECT_THAT(ConfigPlanner::Create(m).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("num_layers: must be at least 1")));
}

}  // namespace
}  // namespace morph
