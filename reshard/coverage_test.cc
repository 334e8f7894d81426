#include "reshard/coverage.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

bool Overlap(const Box& a, const Box& b) { return !Intersect(a, b).empty(); }

TEST(FindOverlapTest, MatchesBruteForceOnRandomBoxes) {
  std::mt19937_64 rng(7);
  int found = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int rank = 1 + static_cast<int>(rng() % 3);
    const int n = static_cast<int>(rng() % 9);
    std::vector<Box> boxes;
    // Mostly a grid (like plan pieces), sometimes arbitrary.
    const bool grid = rng() % 2 == 0;
    for (int i = 0; i < n; ++i) {
      std::vector<Interval> d;
      for (int k = 0; k < rank; ++k) {
        int64_t a = static_cast<int64_t>(rng() % 6), b = static_cast<int64_t>(rng() % 6);
        if (grid) a = a / 2 * 2, b = a + 2 * static_cast<int64_t>(rng() % 2);
        if (a > b) std::swap(a, b);
        d.push_back({a, b + (grid ? 0 : static_cast<int64_t>(rng() % 2))});
      }
      boxes.emplace_back(std::move(d));
    }
    bool brute = false;
    for (int i = 0; i < n && !brute; ++i)
      for (int j = i + 1; j < n && !brute; ++j) brute = Overlap(boxes[i], boxes[j]);
    auto [a, b] = FindOverlap(boxes);
    ASSERT_EQ(a >= 0, brute) << "iteration " << iter;
    if (a >= 0) {
      ++found;
      ASSERT_LT(a, b);
      EXPECT_TRUE(Overlap(boxes[static_cast<size_t>(a)], boxes[static_cast<size_t>(b)]));
    }
  }
  EXPECT_GT(found, 100);
}

TEST(FindOverlapTest, ManyDisjointPiecesAreFast) {
  // 200k column pieces sharing one row interval, then 200k row pieces: the sweep recurses once
  // per cluster, so this is O(p log p) (a pairwise check would be 4e10 comparisons).
  std::vector<Box> cols, rows;
  for (int64_t i = 0; i < 200000; ++i) {
    cols.push_back(Box({{0, 8}, {i, i + 1}}));
    rows.push_back(Box({{i, i + 1}, {0, 8}}));
  }
  EXPECT_EQ(FindOverlap(cols).first, -1);
  EXPECT_EQ(FindOverlap(rows).first, -1);
  cols.push_back(Box({{7, 8}, {5, 7}}));
  EXPECT_EQ(FindOverlap(cols), std::make_pair(5, 200000));
}

TEST(ValidateCoverageTest, ExactCoverIsOk) {
  MORPH_ASSERT_OK_AND_ASSIGN(Shard s, Shard::Whole(Box::FromShape({8, 8})));
  std::vector<CoveragePiece> p{{Box({{0, 4}, {0, 8}}), "a"},
                               {Box({{4, 8}, {0, 3}}), "b"},
                               {Box({{4, 8}, {3, 8}}), "c"},
                               {Box({{2, 2}, {0, 8}}), "empty"}};
  MORPH_EXPECT_OK(ValidateCoverage("w", s, p));
  // A flat (ZeRO) shard: elements 5..16 of a 4x6 frame.
  Shard flat{Box::FromShape({4, 6}), 5, 17};
  std::vector<CoveragePiece> q;
  for (const Box& b : ShardBoxes(flat)) q.push_back({b, "piece"});
  MORPH_EXPECT_OK(ValidateCoverage("m", flat, q));
}

TEST(ValidateCoverageTest, TwiceNeverAndOutsideAreNamed) {
  MORPH_ASSERT_OK_AND_ASSIGN(Shard s, Shard::Whole(Box::FromShape({8, 8})));
  // Rows 0-3 twice, rows 4-7 never: the element count matches, the data would not.
  std::vector<CoveragePiece> twice{{Box({{0, 4}, {0, 8}}), "local_copies[0]"},
                                   {Box({{0, 4}, {0, 8}}), "local_copies[1]"}};
  EXPECT_THAT(ValidateCoverage("w", s, twice),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'w'"), HasSubstr("local_copies[0] box [0,4)x[0,8)"),
                             HasSubstr("local_copies[1]"), HasSubstr("overlap"))));
  std::vector<CoveragePiece> missing{{Box({{0, 4}, {0, 8}}), "recvs[0]"}};
  EXPECT_THAT(ValidateCoverage("w", s, missing),
              StatusIs(StatusCode::kInvalidArgument, AllOf(HasSubstr("tensor 'w'"),
                                                           HasSubstr("32 of the 64 elements of box "
                                                                     "[0,8)x[0,8)"),
                                                           HasSubstr("not covered"))));
  Shard flat{Box::FromShape({4, 6}), 5, 17};
  std::vector<CoveragePiece> outside{{Box({{0, 1}, {0, 6}}), "recvs[3]"}};
  EXPECT_THAT(ValidateCoverage("m", flat, outside),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("recvs[3] box [0,1)x[0,6) is not inside the new shard"),
                             HasSubstr("5 of its 6 elements are outside"))));
  std::vector<CoveragePiece> bad_rank{{Box({{0, 8}}), "x"}};
  EXPECT_THAT(ValidateCoverage("w", s, bad_rank),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("has rank 1")));
}

}  // namespace
}  // namespace morph
