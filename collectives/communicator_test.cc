#include "collectives/communicator.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "base/testing.h"
#include "collectives/store/store.h"

namespace morph {
namespace {

TEST(HalfTest, RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(HalfTest, RoundsToNearestEven) {
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 0x1p-11f)), 1.0f);                // tie -> even (down)
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);  // tie -> even (up)
  EXPECT_EQ(HalfToFloat(FloatToHalf(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(65520.0f))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(0x1p-24f)), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(HalfToFloat(FloatToHalf(0x1p-26f)), 0.0f);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
}

TEST(BFloat16Test, RoundTripsAndRounds) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToBFloat16(f), b);
  }
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(1.0f + 0x1p-8f)), 1.0f);  // tie -> even
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
}

TEST(TimeoutsTest, FromEnvironment) {
  ::unsetenv("MORPH_COLLECTIVE_TIMEOUT_MS");
  EXPECT_EQ(*CollectiveTimeoutFromEnv(), std::chrono::milliseconds(300000));
  // One default collective timeout: the op's and the parameter's are the same.
  EXPECT_EQ(*CollectiveTimeoutFromEnv(), CollectiveOp{}.timeout);
  EXPECT_EQ(CollectiveOp::Barrier(kDefaultCollectiveTimeout).timeout, CollectiveOp{}.timeout);
  ::setenv("MORPH_COLLECTIVE_TIMEOUT_MS", "1500", 1);
  EXPECT_EQ(*CollectiveTimeoutFromEnv(), std::chrono::milliseconds(1500));
  ::setenv("MORPH_COLLECTIVE_TIMEOUT_MS", "soon", 1);
  EXPECT_THAT(CollectiveTimeoutFromEnv(),
              testing::StatusIs(StatusCode::kInvalidArgument,
                                ::testing::HasSubstr("MORPH_COLLECTIVE_TIMEOUT_MS=soon")));
  ::unsetenv("MORPH_COLLECTIVE_TIMEOUT_MS");
  ::setenv("MORPH_STORE_TIMEOUT_MS", "2000", 1);
  StatusOr<Deadline> d = StoreDeadlineFromEnv();
  ASSERT_TRUE(d.ok());
  EXPECT_GT(d->RemainingMs(), 1000);
  EXPECT_LE(d->RemainingMs(), 2000);
  ::unsetenv("MORPH_STORE_TIMEOUT_MS");
}

TEST(ReduceIntoTest, EveryTypeAndOp) {
  int32_t a[3] = {1, -5, 7}, b[3] = {2, 3, -9};
  ReduceInto(a, b, 3, DType::kI32, ReduceOp::kSum);
  EXPECT_EQ(a[0], 3);
  EXPECT_EQ(a[1], -2);
  EXPECT_EQ(a[2], -2);
  double c[2] = {1.5, -2}, d[2] = {0.5, 4};
  ReduceInto(c, d, 2, DType::kF64, ReduceOp::kMax);
  EXPECT_EQ(c[0], 1.5);
  EXPECT_EQ(c[1], 4);
  uint16_t h[1] = {FloatToBFloat16(3)}, k[1] = {FloatToBFloat16(-4)};
  ReduceInto(h, k, 1, DType::kBF16, ReduceOp::kMin);
  EXPECT_EQ(BFloat16ToFloat(h[0]), -4);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeName(DType::kI64), "i64");
  EXPECT_EQ(ReduceOpName(ReduceOp::kMin), "min");
}

}  // namespace
}  // namespace morph
