#include "morph/shard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

// Row-major linear index of `idx` within `frame`.
int64_t Linear(const Box& frame, const std::vector<int64_t>& idx) {
  int64_t l = 0;
  for (int d = 0; d < frame.rank(); ++d) l = l * frame.dim(d).size() + (idx[d] - frame.dim(d).begin);
  return l;
}

// Calls fn(index) for every element of `box` in row-major order.
template <typename Fn>
void ForEach(const Box& box, Fn fn) {
  if (box.empty()) return;
  std::vector<int64_t> idx = box.origin();
  while (true) {
    fn(idx);
    int d = box.rank() - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < box.dim(d).end) break;
      idx[d] = box.dim(d).begin;
    }
    if (d < 0) return;
  }
}

TEST(ShardTest, ExampleFromHeader) {
  Shard s{Box::FromShape({4, 6}), 5, 17};
  std::vector<Box> boxes = ShardBoxes(s);
  ASSERT_EQ(boxes.size(), 3u);
  EXPECT_EQ(boxes[0], Box({{0, 1}, {5, 6}}));
  EXPECT_EQ(boxes[1], Box({{1, 2}, {0, 6}}));
  EXPECT_EQ(boxes[2], Box({{2, 3}, {0, 5}}));
  MORPH_ASSERT_OK_AND_ASSIGN(StridedView v, ViewOf(s, boxes[1]));
  EXPECT_EQ(v.offset, 1);
  EXPECT_EQ(v.shape, (std::vector<int64_t>{1, 6}));
  EXPECT_EQ(v.strides, (std::vector<int64_t>{6, 1}));
}

TEST(ShardTest, WholeFrameIsOneBox) {
  MORPH_ASSERT_OK_AND_ASSIGN(Shard s, Shard::Whole(Box({{2, 4}, {3, 9}, {0, 5}})));
  EXPECT_EQ(s.NumElements(), 60);
  std::vector<Box> boxes = ShardBoxes(s);
  ASSERT_EQ(boxes.size(), 1u);
  EXPECT_EQ(boxes[0], s.frame);
}

TEST(ShardTest, ViewOfRejectsBoxOutsideShard) {
  Shard s{Box::FromShape({4, 6}), 5, 17};
  EXPECT_THAT(ViewOf(s, Box({{0, 1}, {0, 6}})),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not inside shard")));
  EXPECT_THAT(ViewOf(s, Box({{0, 1}})), StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank")));
  EXPECT_THAT(ViewOf(s, Box({{3, 5}, {0, 1}})),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not inside shard")));
}

// Randomized: ShardBoxes covers exactly the flat range, in storage order, with at most
// 2*rank-1 boxes, and ViewOf places every element where the flat layout says.
TEST(ShardTest, RandomDecompositionsAreExact) {
  const unsigned long long seed = morph::testing::TestSeed();
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 2000; ++iter) {
    int rank = 1 + static_cast<int>(rng() % 4);
    std::vector<Interval> dims;
    int64_t total = 1;
    for (int d = 0; d < rank; ++d) {
      int64_t lo = static_cast<int64_t>(rng() % 5), n = 1 + static_cast<int64_t>(rng() % 5);
      dims.push_back({lo, lo + n});
      total *= n;
    }
    Box frame(dims);
    int64_t a = static_cast<int64_t>(rng() % static_cast<uint64_t>(total + 1));
    int64_t b = a + static_cast<int64_t>(rng() % static_cast<uint64_t>(total - a + 1));
    Shard s{frame, a, b};
    std::vector<Box> boxes = ShardBoxes(s);
    ASSERT_LE(static_cast<int>(boxes.size()), 2 * rank - 1) << s.ToString();
    int64_t next = a;
    for (const Box& box : boxes) {
      ASSERT_FALSE(box.empty());
      MORPH_ASSERT_OK_AND_ASSIGN(StridedView v, ViewOf(s, box));
      std::vector<int64_t> rel(rank);
      ForEach(box, [&](const std::vector<int64_t>& idx) {
        ASSERT_EQ(Linear(frame, idx), next) << s.ToString() << " box " << box;
        int64_t off = v.offset;
        for (int d = 0; d < rank; ++d) off += (idx[d] - box.dim(d).begin) * v.strides[d];
        ASSERT_EQ(off, next - a);
        ++next;
      });
    }
    ASSERT_EQ(next, b) << s.ToString();
    // IntersectShard with a random box holds exactly the shard's elements in that box.
    std::vector<Interval> q;
    for (int d = 0; d < rank; ++d) {
      int64_t lo = frame.dim(d).begin + static_cast<int64_t>(rng() % 3) - 1;
      q.push_back({lo, lo + 1 + static_cast<int64_t>(rng() % 4)});
    }
    Box query(q);
    int64_t expect = 0;
    ForEach(Intersect(query, frame), [&](const std::vector<int64_t>& idx) {
      int64_t l = Linear(frame, idx);
      expect += (l >= a && l < b);
    });
    int64_t got = 0;
    for (const Box& c : IntersectShard(s, query)) {
      got += *c.NumElements();
      MORPH_ASSERT_OK(ViewOf(s, c).status());
      ASSERT_TRUE(query.Contains(c));
    }
    ASSERT_EQ(got, expect);
  }
}

}  // namespace
}  // namespace morph
