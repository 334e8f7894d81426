// Deadline: a point in steady time that every blocking morph call is bounded by.
//
//   Deadline d = Deadline::After(std::chrono::seconds(30));
//   while (!ready()) { if (d.Expired()) return DeadlineExceededError("waiting for x"); ... }
#ifndef MORPH_DEADLINE_H_
#define MORPH_DEADLINE_H_

#include "morph/api.h"

#include <algorithm>
#include <chrono>

namespace morph {

class MORPH_API Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline After(Clock::duration d) { return Deadline(Clock::now() + d); }
  static Deadline AfterMs(long long ms) { return After(std::chrono::milliseconds(ms)); }
  static Deadline Infinite() { return Deadline(Clock::time_point::max()); }
  explicit Deadline(Clock::time_point when) : when_(when) {}

  Clock::time_point when() const { return when_; }
  bool Expired() const { return Clock::now() >= when_; }
  bool IsInfinite() const { return when_ == Clock::time_point::max(); }
  // Time left, never negative.
  Clock::duration Remaining() const {
    if (IsInfinite()) return Clock::duration::max();
    return std::max(Clock::duration::zero(), when_ - Clock::now());
  }
  long long RemainingMs() const {
    if (IsInfinite()) return std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::hours(24 * 365)).count();
    return std::chrono::duration_cast<std::chrono::milliseconds>(Remaining()).count();
  }
  // The earlier of two deadlines.
  friend Deadline Min(Deadline a, Deadline b) { return a.when_ < b.when_ ? a : b; }

 private:
  Clock::time_point when_;
};

}  // namespace morph

#endif  // MORPH_DEADLINE_H_
