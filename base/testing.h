// Test helpers for Status: assertions and a gmock matcher.
//
//   MORPH_ASSERT_OK(store.Set("k", "v"));
//   MORPH_ASSERT_OK_AND_ASSIGN(auto plan, MakePlan(a, b));
//   EXPECT_THAT(s, StatusIs(StatusCode::kInvalidArgument, HasSubstr("tp=3")));
#ifndef MORPH_BASE_TESTING_H_
#define MORPH_BASE_TESTING_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "morph/status.h"

namespace morph::testing {

MATCHER_P2(StatusIs, code, message_matcher, "") {
  const ::morph::Status& s = ::morph::internal::AsStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(s.message()), result_listener);
}

// The seed for randomized tests: MORPH_TEST_SEED if set, else a fresh one. Printed by the
// caller so a failure can be reproduced.
unsigned long long TestSeed();

}  // namespace morph::testing

#define MORPH_ASSERT_OK(expr)                                           \
  do {                                                                  \
    ::morph::Status _s = ::morph::internal::AsStatus(expr);  /* copy: expr may be a temporary */      \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.ToString();             \
  } while (0)
#define MORPH_EXPECT_OK(expr)                                           \
  do {                                                                  \
    ::morph::Status _s = ::morph::internal::AsStatus(expr);  /* copy: expr may be a temporary */      \
    EXPECT_TRUE(_s.ok()) << #expr << ": " << _s.ToString();             \
  } while (0)
#define MORPH_ASSERT_OK_AND_ASSIGN(lhs, rexpr)                                              \
  MORPH_ASSERT_OK_AND_ASSIGN_IMPL_(MORPH_STATUS_CONCAT_(_morph_test_so_, __COUNTER__), lhs, \
                                   rexpr)
#define MORPH_ASSERT_OK_AND_ASSIGN_IMPL_(var, lhs, rexpr)      \
  auto var = (rexpr);                                          \
  ASSERT_TRUE(var.ok()) << #rexpr << ": " << var.status();     \
  lhs = std::move(var).value()

#endif  // MORPH_BASE_TESTING_H_
