#include "morph/box.h"

#include <algorithm>
#include <sstream>

namespace morph {

StatusOr<int64_t> CheckedMul(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) {
    return OutOfRangeError("int64 overflow in " + std::string(what) + ": " + std::to_string(a) +
                           " * " + std::to_string(b));
  }
  return r;
}

StatusOr<int64_t> CheckedAdd(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) {
    return OutOfRangeError("int64 overflow in " + std::string(what) + ": " + std::to_string(a) +
                           " + " + std::to_string(b));
  }
  return r;
}

Interval Intersect(const Interval& a, const Interval& b) {
  Interval r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

std::ostream& operator<<(std::ostream& os, const Interval& i) {
  return os << "[" << i.begin << "," << i.end << ")";
}

Box Box::FromShape(std::span<const int64_t> shape) {
  std::vector<Interval> dims;
  dims.reserve(shape.size());
  for (int64_t s : shape) dims.push_back({0, s});
  return Box(std::move(dims));
}

std::vector<int64_t> Box::shape() const {
  std::vector<int64_t> s;
  s.reserve(dims_.size());
  for (const Interval& i : dims_) s.push_back(i.size());
  return s;
}

std::vector<int64_t> Box::origin() const {
  std::vector<int64_t> s;
  s.reserve(dims_.size());
  for (const Interval& i : dims_) s.push_back(i.begin);
  return s;
}

bool Box::empty() const {
  return std::any_of(dims_.begin(), dims_.end(), [](const Interval& i) { return i.empty(); });
}

StatusOr<int64_t> Box::NumElements() const {
  int64_t n = 1;
  for (const Interval& i : dims_) {
    MORPH_ASSIGN_OR_RETURN(n, CheckedMul(n, i.size(), "number of elements of " + ToString()));
  }
  return n;
}

bool Box::Contains(const Box& other) const {
  if (other.rank() != rank()) return false;
  if (other.empty()) return true;
  for (int d = 0; d < rank(); ++d) {
    if (!dim(d).Contains(other.dim(d))) return false;
  }
  return true;
}

bool Box::Contains(std::span<const int64_t> index) const {
  if (static_cast<int>(index.size()) != rank()) return false;
  for (int d = 0; d < rank(); ++d) {
    if (!dim(d).Contains(index[static_cast<size_t>(d)])) return false;
  }
  return true;
}

std::string Box::ToString() const {
  if (dims_.empty()) return "[]";
  std::ostringstream os;
  for (size_t d = 0; d < dims_.size(); ++d) os << (d ? "x" : "") << dims_[d];
  return os.str();
}

bool operator==(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) return false;
  if (a.empty() || b.empty()) return a.empty() && b.empty();
  return a.dims_ == b.dims_;
}

Box Intersect(const Box& a, const Box& b) {
  std::vector<Interval> dims;
  size_t n = std::min(a.dims().size(), b.dims().size());
  dims.reserve(n);
  for (size_t d = 0; d < n; ++d) dims.push_back(Intersect(a.dims()[d], b.dims()[d]));
  return Box(std::move(dims));
}

std::ostream& operator<<(std::ostream& os, const Box& b) { return os << b.ToString(); }

std::vector<Box> Subtract(const Box& a, const Box& b) {
  std::vector<Box> out;
  if (a.empty()) return out;
  const Box common = Intersect(a, b);
  if (common.empty()) {
    out.push_back(a);
    return out;
  }
  // Peel dimension by dimension: the part of `rest` below and above `common` in dim d, then
  // narrow `rest` to common's interval in d.
  Box rest = a;
  for (int d = 0; d < a.rank(); ++d) {
    const Interval r = rest.dim(d), c = common.dim(d);
    if (r.begin < c.begin) {
      Box lo = rest;
      lo.dim(d) = {r.begin, c.begin};
      out.push_back(std::move(lo));
    }
    if (c.end < r.end) {
      Box hi = rest;
      hi.dim(d) = {c.end, r.end};
      out.push_back(std::move(hi));
    }
    rest.dim(d) = c;
  }
  return out;
}

}  // namespace morph
