#include "runtime/tools/config_pins.h"

#include <gtest/gtest.h>

namespace morph {
namespace {

TEST(ConfigPinsTest, PinnedSizesGetTheirConfigWithTheModelsStages) {
  StatusOr<ConfigPins> pins = ParseConfigPins({"4=dp2tp2pp1", "3=dp1tp1pp2"});
  ASSERT_TRUE(pins.ok()) << pins.status();
  ModelConstraints model;
  model.num_layers = 4;
  model.zero_stage = 1;
  model.micro_batches = 2;
  ConfigPolicy policy = pins->Policy();
  std::optional<ParallelConfig> four = policy(4, nullptr, model);
  ASSERT_TRUE(four.has_value());
  EXPECT_EQ(four->dp, 2);
  EXPECT_EQ(four->tp, 2);
  EXPECT_EQ(four->pp, 1);
  EXPECT_EQ(four->zero_stage, 1);
  EXPECT_TRUE(four->Validate().ok()) << four->Validate();
  std::optional<ParallelConfig> three = policy(3, nullptr, model);
  ASSERT_TRUE(three.has_value());
  EXPECT_EQ(three->pp, 2);
  EXPECT_EQ(three->stage_of_layer, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(three->micro_batches, 2);
  EXPECT_FALSE(policy(5, nullptr, model).has_value()) << "an unpinned size is the planner's";
  model.num_layers = 1;  // pp=2 cannot split one layer: left to the planner
  EXPECT_FALSE(policy(3, nullptr, model).has_value());
}

TEST(ConfigPinsTest, BadItemsAreNamed) {
  for (const char* item : {"4", "4=dp2tp2", "4=dp2tp2pp1x", "x=dp1tp1pp1", "0=dp1tp1pp1",
                           "4=dp0tp1pp1", "3=dp2tp2pp1", "4=dp-1tp1pp1"}) {
    StatusOr<ConfigPins> pins = ParseConfigPins({item});
    ASSERT_FALSE(pins.ok()) << item;
    EXPECT_EQ(pins.status().code(), StatusCode::kInvalidArgument) << item;
    EXPECT_NE(std::string(pins.status().message()).find(item), std::string::npos)
        << pins.status();
  }
  StatusOr<ConfigPins> twice = ParseConfigPins({"4=dp4tp1pp1", "4=dp2tp2pp1"});
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(std::string(twice.status().message()).find("a second pin"), std::string::npos);
}

}  // namespace
}  // namespace morph
