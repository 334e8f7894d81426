#include "base/logging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>
#include <thread>
#include <vector>

namespace morph {
namespace {

using ::testing::HasSubstr;

TEST(LoggingTest, PrefixUnknownFields) {
  LogContext ctx("coordinator");
  EXPECT_EQ(ctx.Prefix(), "[g- r-/0 coordinator] ");
}

TEST(LoggingTest, PrefixAfterSet) {
  LogContext ctx("reshard");
  ctx.Set(4, 5, 8);
  EXPECT_EQ(ctx.Prefix(), "[g4 r5/8 reshard] ");
  EXPECT_EQ(ctx.generation(), 4);
  EXPECT_EQ(ctx.rank(), 5);
  EXPECT_EQ(ctx.world(), 8);
  ctx.Set(5, 3, 6);
  EXPECT_EQ(ctx.Prefix(), "[g5 r3/6 reshard] ");
}

TEST(LoggingTest, LargeValues) {
  LogContext ctx("x");
  ctx.Set(1 << 20, 16383, 16384);
  EXPECT_EQ(ctx.Prefix(), "[g1048576 r16383/16384 x] ");
}

class Sink : public google::LogSink {
 public:
  void send(google::LogSeverity, const char*, const char*, int, const struct ::tm*,
            const char* message, size_t len) override {
    std::lock_guard<std::mutex> l(mu);
    lines.emplace_back(message, len);
  }
  std::mutex mu;
  std::vector<std::string> lines;
};

TEST(LoggingTest, MorphLogCarriesPrefix) {
  Sink sink;
  google::AddLogSink(&sink);
  LogContext ctx("collectives");
  ctx.Set(2, 1, 4);
  MORPH_LOG(INFO, ctx) << "built 3 communicators";
  google::RemoveLogSink(&sink);
  ASSERT_EQ(sink.lines.size(), 1u);
  EXPECT_EQ(sink.lines[0], "[g2 r1/4 collectives] built 3 communicators");
}

TEST(LoggingTest, ConcurrentSetAndRead) {
  LogContext ctx("w");
  std::thread writer([&] {
    for (int i = 0; i < 10000; ++i) ctx.Set(i, i % 7, 7);
  });
  for (int i = 0; i < 10000; ++i) {
    std::string p = ctx.Prefix();
    EXPECT_THAT(p, HasSubstr("/"));
  }
  writer.join();
}

}  // namespace
}  // namespace morph
