#include "base/connection_limit.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace morph {
namespace {

TEST(ConnectionLimitTest, TheCapIsAnEighthOfTheOpenFileLimitAtMost) {
  EXPECT_EQ(PreAuthCap(1024, 1024), 128);
  EXPECT_EQ(PreAuthCap(1024, 256), 32);
  EXPECT_EQ(PreAuthCap(1024, 40), 8);  // a floor, for tiny limits
  EXPECT_EQ(PreAuthCap(4, 1024), 4);   // the configured cap when it is lower
  EXPECT_EQ(PreAuthCap(1024, INT64_MAX), 1024);
  EXPECT_GE(OpenFileLimit(), 1);
}

TEST(ConnectionLimitTest, TheQueueKeepsTheOldestFirst) {
  PreAuthQueue<int> q(2);
  EXPECT_FALSE(q.full());
  auto a = q.Add(1);
  auto b = q.Add(2);
  EXPECT_TRUE(q.full());
  EXPECT_EQ(q.oldest(), 1);
  q.Remove(a);
  EXPECT_EQ(q.oldest(), 2);
  q.Add(3);
  q.Remove(b);
  EXPECT_EQ(q.oldest(), 3);
  EXPECT_EQ(q.size(), 1u);
}

TEST(ConnectionLimitTest, WarningsAreFoldedWithinTheInterval) {
  WarningLimiter w(std::chrono::milliseconds(200));
  int64_t folded = -1;
  EXPECT_TRUE(w.Allow(&folded));
  EXPECT_EQ(folded, 0);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(w.Allow(&folded));
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_TRUE(w.Allow(&folded));
  EXPECT_EQ(folded, 5);
  EXPECT_EQ(Folded(5), " (and 5 more like it since the last such line)");
  EXPECT_EQ(Folded(0), "");
}

}  // namespace
}  // namespace morph
