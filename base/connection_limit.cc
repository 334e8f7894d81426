#include "base/connection_limit.h"

#include <sys/resource.h>

#include <limits>

namespace morph {

int64_t OpenFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) {
    return std::numeric_limits<int64_t>::max();
  }
  return static_cast<int64_t>(lim.rlim_cur);
}

int64_t PreAuthCap(int64_t configured, int64_t open_file_limit) {
  return std::max<int64_t>(1, std::min(configured, std::max<int64_t>(8, open_file_limit / 8)));
}

bool WarningLimiter::Allow(int64_t* folded) {
  const auto now = std::chrono::steady_clock::now();
  if (logged_ && now - last_ < interval_) {
    ++folded_;
    return false;
  }
  *folded = folded_;
  folded_ = 0;
  last_ = now;
  logged_ = true;
  return true;
}

std::string Folded(int64_t folded) {
  if (folded <= 0) return "";
  return " (and " + std::to_string(folded) + " more like it since the last such line)";
}

}  // namespace morph
