// main() for every gtest binary: glog to stderr, then gtest.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "base/logging.h"
#include "base/testing.h"

namespace morph::testing {
unsigned long long TestSeed() {
  static const unsigned long long seed = [] {
    if (const char* s = std::getenv("MORPH_TEST_SEED"); s != nullptr && *s != '\0') {
      return std::strtoull(s, nullptr, 0);
    }
    return static_cast<unsigned long long>(
        std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return seed;
}
}  // namespace morph::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  morph::InitLogging(argv[0]);
  return RUN_ALL_TESTS();
}
