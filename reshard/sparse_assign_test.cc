#include "reshard/sparse_assign.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

#include "base/testing.h"
#include "reshard/plan_internal.h"

namespace morph::plan_internal {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;
using Rng = std::mt19937_64;

int Uniform(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// A random problem: sparse direct entries, random groups, rows sharing a few entry lists.
SparseAssignProblem RandomProblem(Rng& rng, int rows, int cols, int max_w) {
  SparseAssignProblem pb;
  pb.rows = rows;
  pb.cols = cols;
  pb.num_groups = Uniform(rng, 0, 4);
  pb.col_group_begin.push_back(0);
  for (int j = 0; j < cols; ++j) {
    for (int g = 0; g < pb.num_groups; ++g) {
      if (Uniform(rng, 0, 2) == 0) pb.col_group.push_back(g);
    }
    pb.col_group_begin.push_back(static_cast<int64_t>(pb.col_group.size()));
  }
  const int lists = Uniform(rng, 0, 3);
  pb.list_begin.push_back(0);
  for (int l = 0; l < lists; ++l) {
    for (int g = 0; g < pb.num_groups; ++g) {
      if (Uniform(rng, 0, 1) == 0) {
        pb.list_group.push_back(g);
        pb.list_w.push_back(Uniform(rng, 1, max_w));
      }
    }
    pb.list_begin.push_back(static_cast<int64_t>(pb.list_group.size()));
  }
  pb.direct_begin.push_back(0);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      if (Uniform(rng, 0, 2) == 0) {
        pb.direct_col.push_back(j);
        pb.direct_w.push_back(Uniform(rng, 1, max_w));
      }
    }
    pb.direct_begin.push_back(static_cast<int64_t>(pb.direct_col.size()));
    std::array<int32_t, kListsPerRow> ls{-1, -1, -1, -1};
    for (int k = 0; k < kListsPerRow && lists > 0; ++k) {
      if (Uniform(rng, 0, 1)) ls[static_cast<size_t>(k)] = Uniform(rng, 0, lists - 1);
    }
    pb.row_lists.push_back(ls);
  }
  return pb;
}

// The optimum by the dense Hungarian (plan_internal::Hungarian) with `rows` zero columns added.
int64_t DenseBest(const SparseAssignProblem& pb) {
  std::vector<std::vector<int64_t>> cost(static_cast<size_t>(pb.rows),
                                         std::vector<int64_t>(size_t(pb.cols + pb.rows), 0));
  for (int i = 0; i < pb.rows; ++i) {
    for (int j = 0; j < pb.cols; ++j) cost[size_t(i)][size_t(j)] = -SparseWeight(pb, i, j);
  }
  const std::vector<int> col = Hungarian(cost);
  int64_t best = 0;
  for (int i = 0; i < pb.rows; ++i) best -= cost[size_t(i)][size_t(col[size_t(i)])];
  return best;
}

void ExpectValid(const SparseAssignProblem& pb, const SparseAssignResult& r) {
  ASSERT_EQ(static_cast<int>(r.col_of_row.size()), pb.rows);
  std::set<int32_t> used;
  int64_t total = 0;
  for (int i = 0; i < pb.rows; ++i) {
    const int32_t j = r.col_of_row[size_t(i)];
    if (j == kDummy) continue;
    ASSERT_GE(j, 0);
    ASSERT_LT(j, pb.cols);
    ASSERT_TRUE(used.insert(j).second) << "column " << j << " used twice";
    total += SparseWeight(pb, i, j);
  }
  EXPECT_EQ(total, r.total);
}

TEST(SparseAssignTest, MatchesDenseHungarianOnRandomProblems) {
  const unsigned long long seed = testing::TestSeed();
  std::printf("sparse_assign_test seed: %llu\n", seed);
  Rng rng(seed);
  for (int it = 0; it < 3000; ++it) {
    const int rows = Uniform(rng, 0, 9), cols = Uniform(rng, 0, 9);
    // Small weights make many ties (the hard case for tie handling and the greedy start).
    const SparseAssignProblem pb = RandomProblem(rng, rows, cols, it % 2 ? 3 : 1000);
    SCOPED_TRACE("iteration " + std::to_string(it) + " seed " + std::to_string(seed));
    MORPH_ASSERT_OK_AND_ASSIGN(SparseAssignResult r, SolveSparseAssignment(pb));
    ExpectValid(pb, r);
    ASSERT_EQ(r.total, DenseBest(pb));
  }
}

TEST(SparseAssignTest, LargerProblemsMatchDense) {
  Rng rng(testing::TestSeed() + 1);
  for (int it = 0; it < 20; ++it) {
    const int rows = Uniform(rng, 30, 80), cols = Uniform(rng, 30, 80);
    const SparseAssignProblem pb = RandomProblem(rng, rows, cols, it % 2 ? 4 : 1 << 20);
    MORPH_ASSERT_OK_AND_ASSIGN(SparseAssignResult r, SolveSparseAssignment(pb));
    ExpectValid(pb, r);
    ASSERT_EQ(r.total, DenseBest(pb)) << "iteration " << it;
  }
}

TEST(SparseAssignTest, Deterministic) {
  Rng rng(7);
  const SparseAssignProblem pb = RandomProblem(rng, 40, 50, 2);
  MORPH_ASSERT_OK_AND_ASSIGN(SparseAssignResult a, SolveSparseAssignment(pb));
  MORPH_ASSERT_OK_AND_ASSIGN(SparseAssignResult b, SolveSparseAssignment(pb));
  EXPECT_EQ(a.col_of_row, b.col_of_row);
}

TEST(SparseAssignTest, RejectsMalformedAndTooLargeProblems) {
  SparseAssignProblem pb;
  pb.rows = 1;
  pb.cols = 1;
  pb.direct_begin = {0, 1};
  pb.direct_col = {0};
  pb.direct_w = {0};
  pb.col_group_begin = {0, 0};
  pb.list_begin = {0};
  pb.row_lists = {{-1, -1, -1, -1}};
  EXPECT_THAT(SolveSparseAssignment(pb),
              StatusIs(StatusCode::kInvalidArgument, "sparse assignment: direct weight <= 0"));
  pb.direct_col = {1};
  pb.direct_w = {5};
  EXPECT_THAT(SolveSparseAssignment(pb),
              StatusIs(StatusCode::kInvalidArgument, "sparse assignment: direct column range"));
  pb.direct_col = {0};
  pb.direct_w = {int64_t{1} << 60};
  EXPECT_THAT(SolveSparseAssignment(pb),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("exact int64 limit")));
  pb.direct_w = {5};
  MORPH_ASSERT_OK_AND_ASSIGN(SparseAssignResult r, SolveSparseAssignment(pb));
  EXPECT_EQ(r.col_of_row, std::vector<int32_t>{0});
  EXPECT_EQ(r.total, 5);
}

}  // namespace
}  // namespace morph::plan_internal
