#include "morph/dataset_cursor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

DatasetCursor Make(int64_t n, int64_t b, uint64_t seed, bool shuffle = true) {
  auto c = DatasetCursor::Create(
      {.num_samples = n, .global_batch = b, .seed = seed, .shuffle = shuffle});
  c.status().CheckOk("DatasetCursor::Create");
  return *std::move(c);
}

TEST(DatasetCursorTest, EveryEpochIsAPermutation) {
  for (int64_t n : {1, 2, 3, 5, 7, 16, 17, 100, 257, 1000}) {
    for (uint64_t seed : {0u, 1u, 42u}) {
      DatasetCursor c = Make(n, 1, seed);
      std::vector<int64_t> first;
      for (int64_t e = 0; e < 3; ++e) {
        std::vector<int64_t> order;
        for (int64_t i = 0; i < n; ++i) order.push_back(c.SampleAt(e * n + i));
        if (e == 0) first = order;
        if (e == 1 && n >= 8) {
          EXPECT_NE(order, first) << "epochs reshuffle, n=" << n;
        }
        std::sort(order.begin(), order.end());
        std::vector<int64_t> all(n);
        std::iota(all.begin(), all.end(), 0);
        ASSERT_EQ(order, all) << "n=" << n << " seed=" << seed << " epoch=" << e;
      }
    }
  }
}

const std::vector<int64_t> kPinned = {0, 8, 5, 2, 9, 7, 4, 3, 1, 6};

TEST(DatasetCursorTest, OrderIsPinnedAcrossMachinesAndBuilds) {
  // The order is part of a run's reproducibility: a change here changes every user's data order.
  DatasetCursor c = Make(10, 4, 7);
  std::vector<int64_t> got;
  for (int64_t p = 0; p < 10; ++p) got.push_back(c.SampleAt(p));
  std::vector<int64_t> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_EQ(sorted, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(got, kPinned) << "update kPinned only on purpose";
}

TEST(DatasetCursorTest, ElasticScheduleConsumesTheFixedGlobalOrder) {
  // Whatever dp does from step to step, the concatenation of what the DP ranks take (in rank
  // order) is the fixed stream: no sample skipped or repeated, same as a dp=1 run.
  std::mt19937_64 rng(::morph::testing::TestSeed());
  for (int trial = 0; trial < 200; ++trial) {
    int64_t n = std::uniform_int_distribution<int64_t>(1, 500)(rng);
    int64_t b = std::uniform_int_distribution<int64_t>(1, 64)(rng);
    DatasetCursor c = Make(n, b, rng());
    DatasetCursor reference = Make(n, b, c.spec().seed);
    std::vector<int64_t> elastic, fixed;
    for (int64_t step = 0; step < 40; ++step) {
      int dp = std::uniform_int_distribution<int>(1, 80)(rng);  // dp > B happens
      int64_t mb = std::uniform_int_distribution<int64_t>(1, 9)(rng);
      int64_t step_total = 0;
      for (int d = 0; d < dp; ++d) {
        RankBatch rb = c.BatchFor(step, dp, d, mb);
        std::vector<int64_t> joined;
        for (const auto& m : rb.micro_batches) {
          ASSERT_LE(static_cast<int64_t>(m.size()), mb);
          ASSERT_FALSE(m.empty());
          joined.insert(joined.end(), m.begin(), m.end());
        }
        ASSERT_EQ(joined, rb.samples);
        int64_t share = static_cast<int64_t>(rb.samples.size());
        ASSERT_TRUE(share == b / dp || share == b / dp + 1) << "balanced shares";
        step_total += share;
        elastic.insert(elastic.end(), rb.samples.begin(), rb.samples.end());
      }
      ASSERT_EQ(step_total, b) << "the global batch is fixed";
      RankBatch all = reference.BatchFor(step, 1, 0, b);
      fixed.insert(fixed.end(), all.samples.begin(), all.samples.end());
    }
    ASSERT_EQ(elastic, fixed) << "trial " << trial;
  }
}

TEST(DatasetCursorTest, UnshuffledIsTheIdentityOrder) {
  DatasetCursor c = Make(5, 3, 9, /*shuffle=*/false);
  RankBatch rb = c.BatchFor(2, 1, 0, 3);  // positions 6, 7, 8
  EXPECT_EQ(rb.samples, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(rb.first_position, 6);
}

TEST(DatasetCursorTest, RejectsBadSpecsNamingTheField) {
  EXPECT_THAT(
      DatasetCursor::Create({.num_samples = 0, .global_batch = 4}).status(),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("num_samples: must be at least 1, got 0")));
  EXPECT_THAT(DatasetCursor::Create({.num_samples = 10, .global_batch = -2}).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("global_batch: must be at least 1, got -2")));
  EXPECT_THAT(DatasetCursor::Create({.num_samples = 10, .global_batch = int64_t{1} << 30}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("global_batch: at most")));
}

}  // namespace
}  // namespace morph
