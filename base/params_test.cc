#include "base/params.h"

#include <glog/logging.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "base/testing.h"

namespace morph::params {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class CapturingSink : public google::LogSink {
 public:
  void send(google::LogSeverity, const char*, const char*, int, const struct ::tm*,
            const char* message, size_t len) override {
    std::lock_guard<std::mutex> l(mu);
    lines.emplace_back(message, len);
  }
  int Count(const std::string& needle) {
    std::lock_guard<std::mutex> l(mu);
    int n = 0;
    for (auto& s : lines) n += s.find(needle) != std::string::npos;
    return n;
  }
  std::mutex mu;
  std::vector<std::string> lines;
};

TEST(ParamsTest, DefaultWhenUnset) {
  ScopedEnv e("MORPH_HEARTBEAT_MS", nullptr);
  MORPH_ASSERT_OK_AND_ASSIGN(int64_t v, HeartbeatMs());
  EXPECT_EQ(v, 1000);
}

TEST(ParamsTest, ValidValueIsReadAndLoggedOnce) {
  CapturingSink sink;
  google::AddLogSink(&sink);
  {
    ScopedEnv e("MORPH_HEARTBEAT_MS", "500");
    for (int i = 0; i < 3; ++i) {
      MORPH_ASSERT_OK_AND_ASSIGN(int64_t v, HeartbeatMs());
      EXPECT_EQ(v, 500);
    }
  }
  google::RemoveLogSink(&sink);
  EXPECT_EQ(sink.Count("MORPH_HEARTBEAT_MS set by environment to 500"), 1);
}

TEST(ParamsTest, BadIntegerNamesVariableAndValue) {
  ScopedEnv e("MORPH_HEARTBEAT_MS", "abc");
  EXPECT_THAT(HeartbeatMs(),
              StatusIs(StatusCode::kInvalidArgument, "MORPH_HEARTBEAT_MS=abc: not an integer"));
}

TEST(ParamsTest, OutOfRangeInteger) {
  ScopedEnv e("MORPH_HEARTBEAT_MS", "0");
  EXPECT_THAT(HeartbeatMs(), StatusIs(StatusCode::kInvalidArgument,
                                      "MORPH_HEARTBEAT_MS=0: out of range [10, 600000]"));
  ScopedEnv e2("MORPH_HEARTBEAT_MS", "99999999999999999999999");
  EXPECT_THAT(HeartbeatMs(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("out of range")));
}

TEST(ParamsTest, TrailingGarbageRejected) {
  ScopedEnv e("MORPH_HEARTBEAT_MS", "100ms");
  EXPECT_THAT(HeartbeatMs(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("not an integer")));
}

TEST(ParamsTest, StringParam) {
  ScopedEnv e("MORPH_COORDINATOR", " 10.0.0.1:29400 ");
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v, Coordinator());
  EXPECT_EQ(v, "10.0.0.1:29400");
}

TEST(ParamsTest, ParseBool) {
  for (const char* t : {"1", "true", "YES", "on"}) EXPECT_TRUE(*ParseBool("X", t)) << t;
  for (const char* t : {"0", "false", "No", "off"}) EXPECT_FALSE(*ParseBool("X", t)) << t;
  EXPECT_THAT(ParseBool("MORPH_X", "maybe"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_X=maybe: not a boolean")));
}

TEST(ParamsTest, ParseBytes) {
  EXPECT_EQ(*ParseBytes("X", "4096"), 4096u);
  EXPECT_EQ(*ParseBytes("X", "64KiB"), 64u << 10);
  EXPECT_EQ(*ParseBytes("X", "256MiB"), 256u << 20);
  EXPECT_EQ(*ParseBytes("X", "2G"), 2ull << 30);
  EXPECT_EQ(*ParseBytes("X", "1 TB"), 1ull << 40);
  EXPECT_EQ(*ParseBytes("X", "7B"), 7u);
  EXPECT_THAT(ParseBytes("MORPH_Y", "12 parsecs"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_Y=12 parsecs: unknown unit")));
  EXPECT_THAT(ParseBytes("MORPH_Y", "MiB"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a byte size")));
  EXPECT_THAT(ParseBytes("MORPH_Y", "99999999999999999999"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("too large")));
  EXPECT_THAT(ParseBytes("MORPH_Y", "17179869184T"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("too large")));
}

TEST(ParamsTest, ParseDouble) {
  EXPECT_DOUBLE_EQ(*ParseDouble("X", "0.25", 0, 1), 0.25);
  EXPECT_THAT(ParseDouble("MORPH_Z", "1.5", 0, 1), StatusIs(StatusCode::kInvalidArgument, HasSubstr("out of range")));
  EXPECT_THAT(ParseDouble("MORPH_Z", "nan", 0, 1), StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a number")));
  EXPECT_THAT(ParseDouble("MORPH_Z", "", 0, 1), StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a number")));
}

TEST(ParamsTest, DumpListsEveryParameterAndFlagsInvalidOnes) {
  ScopedEnv e("MORPH_HEARTBEAT_MS", "abc");
  std::string dump = Dump();
  for (const ParamInfo& p : All()) {
    EXPECT_THAT(dump, HasSubstr(std::string(p.env_name) + "=")) << p.env_name;
    EXPECT_THAT(dump, HasSubstr(p.description));
  }
  EXPECT_THAT(dump, HasSubstr("MORPH_HEARTBEAT_MS=abc (int64, default '1000', set) (invalid: "
                              "MORPH_HEARTBEAT_MS=abc: not an integer)"));
}

// A secret (the job token) is returned to its reader, never printed: not in the one-time log
// line, not in Dump().
TEST(ParamsTest, SecretValuesAreNeverPrinted) {
  constexpr char kSecret[] = "params-test-s3cret-token";
  CapturingSink sink;
  google::AddLogSink(&sink);
  std::string dump;
  {
    ScopedEnv e("MORPH_TOKEN", kSecret);
    for (int i = 0; i < 2; ++i) {
      MORPH_ASSERT_OK_AND_ASSIGN(std::string v, Token());
      EXPECT_EQ(v, kSecret);
    }
    dump = Dump();
  }
  google::RemoveLogSink(&sink);
  EXPECT_EQ(sink.Count(kSecret), 0) << "the token was logged";
  EXPECT_EQ(sink.Count("MORPH_TOKEN set by environment (secret, value not shown)"), 1);
  EXPECT_THAT(dump, ::testing::Not(HasSubstr(kSecret)));
  EXPECT_THAT(dump, HasSubstr("MORPH_TOKEN=<redacted> (string, secret, default '', set)"));
  // The registry says which parameters are secrets; any printer asks it.
  for (const ParamInfo& p : All()) {
    EXPECT_EQ(p.secret, std::string(p.env_name) == "MORPH_TOKEN") << p.env_name;
    if (p.secret) {
      EXPECT_EQ(Shown(p, kSecret), "<redacted>");
    }
  }
  EXPECT_EQ(Shown(All()[0], "10.0.0.1:29400"), "10.0.0.1:29400");
}

TEST(ParamsTest, NamesAreUniqueAndPrefixed) {
  std::set<std::string> seen;
  for (const ParamInfo& p : All()) {
    EXPECT_TRUE(std::string(p.env_name).starts_with("MORPH_")) << p.env_name;
    EXPECT_TRUE(seen.insert(p.env_name).second) << "declared twice: " << p.env_name;
    // Defaults must parse.
    ScopedEnv e(p.env_name, nullptr);
    MORPH_EXPECT_OK(p.check());
  }
}

// docs/operations.md must document every variable (keeps the docs true).
TEST(ParamsTest, OperationsDocListsEveryParameter) {
  std::ifstream in(std::string(MORPH_SOURCE_DIR) + "/docs/operations.md");
  ASSERT_TRUE(in.good()) << "docs/operations.md missing";
  std::stringstream ss;
  ss << in.rdbuf();
  for (const ParamInfo& p : All()) {
    EXPECT_THAT(ss.str(), HasSubstr(std::string("`") + p.env_name + "`"))
        << p.env_name << " is not documented in docs/operations.md";
  }
}

}  // namespace
}  // namespace morph::params
