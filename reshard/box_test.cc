#include "morph/box.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/testing.h"
#include "morph/dtype.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

TEST(IntervalTest, Basics) {
  Interval a{2, 8}, b{5, 12};
  EXPECT_EQ(a.size(), 6);
  EXPECT_EQ(Intersect(a, b), (Interval{5, 8}));
  EXPECT_TRUE(Intersect(a, Interval{8, 9}).empty());
  EXPECT_TRUE(Intersect(a, Interval{10, 12}).empty());
  EXPECT_EQ(Intersect(a, Interval{10, 12}).size(), 0);
  EXPECT_TRUE(a.Contains(Interval{3, 3}));
  EXPECT_FALSE(a.Contains(Interval{1, 3}));
}

TEST(BoxTest, ShapeAndElements) {
  Box b = Box::FromShape({4, 6});
  EXPECT_EQ(b.rank(), 2);
  EXPECT_EQ(b.shape(), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(*b.NumElements(), 24);
  EXPECT_EQ(b.ToString(), "[0,4)x[0,6)");
  EXPECT_EQ(*Box().NumElements(), 1);
  EXPECT_EQ(Box().ToString(), "[]");
}

TEST(BoxTest, IntersectAndContains) {
  Box a({{0, 4}, {0, 6}});
  Box b({{2, 8}, {3, 4}});
  Box c = Intersect(a, b);
  EXPECT_EQ(c, Box({{2, 4}, {3, 4}}));
  EXPECT_TRUE(a.Contains(c));
  EXPECT_TRUE(b.Contains(c));
  EXPECT_FALSE(a.Contains(b));
  Box d = Intersect(a, Box({{5, 7}, {0, 6}}));
  EXPECT_TRUE(d.empty());
  EXPECT_EQ(d, Box({{1, 1}, {0, 0}}));  // all empty boxes are equal
  EXPECT_TRUE(a.Contains(d));
  EXPECT_TRUE(a.Contains(std::vector<int64_t>{3, 5}));
  EXPECT_FALSE(a.Contains(std::vector<int64_t>{4, 5}));
}

TEST(BoxTest, OverflowIsReported) {
  Box huge = Box::FromShape({int64_t{1} << 40, int64_t{1} << 40});
  EXPECT_THAT(huge.NumElements(), StatusIs(StatusCode::kOutOfRange, HasSubstr("int64 overflow")));
  EXPECT_THAT(CheckedAdd(INT64_MAX, 1, "offset"),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("int64 overflow in offset")));
  EXPECT_EQ(*CheckedMul(3, 4), 12);
}

TEST(DTypeTest, SizesNamesAndParsing) {
  for (DType d : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16, DType::kI32, DType::kI64,
                  DType::kI8, DType::kU8}) {
    MORPH_ASSERT_OK_AND_ASSIGN(DType back, ParseDType(DTypeName(d)));
    EXPECT_EQ(back, d);
  }
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeSize(DType::kI64), 8);
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_THAT(ParseDType("f128"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("'f128'")));
}

}  // namespace
}  // namespace morph
