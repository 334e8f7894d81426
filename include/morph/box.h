// Half-open intervals and boxes over a tensor's global index space (TensorStore's
// IndexInterval and Box, reduced to what resharding needs). Pure values; all arithmetic that
// could overflow int64 is checked.
//
//   Box w = Box::FromShape({4096, 16384});
//   Box mine({{0, 4096}, {4096, 8192}});        // TP rank 1 of 4, split on dim 1
//   Box both = Intersect(w, mine);              // == mine
//   int64_t n = *mine.NumElements();            // 4096 * 4096
#ifndef MORPH_BOX_H_
#define MORPH_BOX_H_

#include "morph/api.h"

#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "morph/status.h"

namespace morph {

// a*b, a+b, a-b or kOutOfRange ("int64 overflow in <what>").
MORPH_API StatusOr<int64_t> CheckedMul(int64_t a, int64_t b, std::string_view what = "multiplication");
MORPH_API StatusOr<int64_t> CheckedAdd(int64_t a, int64_t b, std::string_view what = "addition");

// [begin, end). Empty when end <= begin.
struct MORPH_API Interval {
  int64_t begin = 0;
  int64_t end = 0;

  int64_t size() const { return end > begin ? end - begin : 0; }
  bool empty() const { return end <= begin; }
  bool Contains(int64_t i) const { return i >= begin && i < end; }
  bool Contains(const Interval& o) const { return o.empty() || (o.begin >= begin && o.end <= end); }
  friend bool operator==(const Interval& a, const Interval& b) {
    return (a.empty() && b.empty()) || (a.begin == b.begin && a.end == b.end);
  }
};
MORPH_API Interval Intersect(const Interval& a, const Interval& b);
MORPH_API std::ostream& operator<<(std::ostream& os, const Interval& i);

class MORPH_API Box {
 public:
  Box() = default;  // rank 0: one element (a scalar)
  explicit Box(std::vector<Interval> dims) : dims_(std::move(dims)) {}
  Box(std::initializer_list<Interval> dims) : dims_(dims) {}
  // [0, shape[i]) in each dimension.
  static Box FromShape(std::span<const int64_t> shape);
  static Box FromShape(std::initializer_list<int64_t> shape) {
    return FromShape(std::span<const int64_t>(shape.begin(), shape.size()));
  }

  int rank() const { return static_cast<int>(dims_.size()); }
  const Interval& dim(int i) const { return dims_[static_cast<size_t>(i)]; }
  Interval& dim(int i) { return dims_[static_cast<size_t>(i)]; }
  std::span<const Interval> dims() const { return dims_; }
  std::vector<int64_t> shape() const;
  std::vector<int64_t> origin() const;
  bool empty() const;
  // Product of the sizes; kOutOfRange if it overflows int64.
  StatusOr<int64_t> NumElements() const;
  // True if every element of `other` is in this box (an empty box is in every box).
  bool Contains(const Box& other) const;
  bool Contains(std::span<const int64_t> index) const;

  // "[0,4)x[2,8)", "[]" for rank 0.
  std::string ToString() const;
  friend bool operator==(const Box& a, const Box& b);

 private:
  std::vector<Interval> dims_;
};

// Exported (the friend declaration above cannot carry the attribute).
MORPH_API bool operator==(const Box& a, const Box& b);

// The common part of two boxes of the same rank (empty if disjoint). Ranks must match.
MORPH_API Box Intersect(const Box& a, const Box& b);
// The elements of `a` not in `b`, as at most 2 * rank disjoint boxes (empty ones left out).
// Ranks must match.
MORPH_API std::vector<Box> Subtract(const Box& a, const Box& b);
MORPH_API std::ostream& operator<<(std::ostream& os, const Box& b);

}  // namespace morph

#endif  // MORPH_BOX_H_
