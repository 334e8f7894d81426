#include "morph/parallel_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ParallelConfigTest, RankAlgebraRoundTrips) {
  ParallelConfig c{.dp = 4, .tp = 2, .pp = 3};
  c.stage_of_layer = *ParallelConfig::EvenStages(7, 3);
  MORPH_ASSERT_OK(c.Validate());
  EXPECT_EQ(c.world(), 24);
  for (int r = 0; r < c.world(); ++r) EXPECT_EQ(c.RankOf(c.CoordsOf(r)), r);
  EXPECT_EQ(c.CoordsOf(13), (ParallelConfig::Coords{1, 2, 1}));
  EXPECT_EQ(c.DpGroup(13), (std::vector<int>{9, 11, 13, 15}));
  EXPECT_EQ(c.TpGroup(13), (std::vector<int>{12, 13}));
  EXPECT_EQ(c.PpGroup(13), (std::vector<int>{5, 13, 21}));
}

TEST(ParallelConfigTest, EvenStages) {
  EXPECT_EQ(*ParallelConfig::EvenStages(7, 3), (std::vector<int>{0, 0, 0, 1, 1, 2, 2}));
  EXPECT_THAT(ParallelConfig::EvenStages(2, 3),
              StatusIs(StatusCode::kInvalidArgument, "cannot split 2 layers into pp=3 stages"));
}

TEST(ParallelConfigTest, ValidateNamesTheField) {
  ParallelConfig c{.dp = 0};
  EXPECT_THAT(c.Validate(), StatusIs(StatusCode::kInvalidArgument, "parallel config: dp=0 must be >= 1"));
  c = {.dp = 1, .tp = 1, .pp = 2, .stage_of_layer = {0, 1, 0}};
  EXPECT_THAT(c.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("stage_of_layer[2]=0")));
  c = {.dp = 1, .tp = 1, .pp = 3, .stage_of_layer = {0, 0, 2}};
  EXPECT_THAT(c.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("stage 1 has no layer")));
  c = {.dp = 1, .tp = 1, .pp = 2, .stage_of_layer = {0, 2}};
  EXPECT_THAT(c.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not in [0, pp=2)")));
  c = {.dp = 1, .tp = 1, .pp = 2};
  EXPECT_THAT(c.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("stage_of_layer is empty")));
  c = {.zero_stage = 4};
  EXPECT_THAT(c.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("zero_stage=4")));
  c = {.dp = 1 << 12, .tp = 1 << 12, .pp = 2, .stage_of_layer = {0, 1}};
  EXPECT_THAT(c.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("too large")));
}

}  // namespace
}  // namespace morph
