#include "morph/shard.h"

#include <sstream>

namespace morph {

StatusOr<Shard> Shard::Whole(Box frame) {
  MORPH_ASSIGN_OR_RETURN(int64_t n, frame.NumElements());
  return Shard{std::move(frame), 0, n};
}

std::string Shard::ToString() const {
  std::ostringstream os;
  os << frame << " flat [" << flat_begin << "," << flat_end << ")";
  return os.str();
}

namespace {

// Appends boxes covering linear indices [a, b) of the sub-space of dims k.. of `frame`, with
// dims < k fixed by `prefix`. `inner[k]` = product of the sizes of dims k+1...
void Decompose(const Box& frame, const std::vector<int64_t>& inner, std::vector<Interval>& prefix,
               int k, int64_t a, int64_t b, std::vector<Box>& out) {
  if (a >= b) return;
  const int n = frame.rank();
  const int64_t base = frame.dim(k).begin;
  auto emit = [&](Interval dk) {
    std::vector<Interval> dims = prefix;
    dims.push_back(dk);
    for (int d = k + 1; d < n; ++d) dims.push_back(frame.dim(d));
    out.emplace_back(std::move(dims));
  };
  const int64_t in = inner[static_cast<size_t>(k)];
  if (k == n - 1 || (a % in == 0 && b % in == 0)) {
    emit({base + a / in, base + b / in});
    return;
  }
  const int64_t row_a = a / in, row_b = b / in;
  auto recurse_row = [&](int64_t row, int64_t lo, int64_t hi) {
    prefix.push_back({base + row, base + row + 1});
    Decompose(frame, inner, prefix, k + 1, lo, hi, out);
    prefix.pop_back();
  };
  if (row_a == row_b) {
    recurse_row(row_a, a - row_a * in, b - row_a * in);
    return;
  }
  int64_t full_begin = row_a;
  if (a % in != 0) {
    recurse_row(row_a, a % in, in);
    full_begin = row_a + 1;
  }
  if (row_b > full_begin) emit({base + full_begin, base + row_b});
  if (b % in != 0) recurse_row(row_b, 0, b % in);
}

std::vector<int64_t> InnerSizes(const Box& frame) {
  std::vector<int64_t> inner(static_cast<size_t>(frame.rank()), 1);
  for (int d = frame.rank() - 2; d >= 0; --d) {
    inner[static_cast<size_t>(d)] =
        inner[static_cast<size_t>(d) + 1] * frame.dim(d + 1).size();
  }
  return inner;
}

}  // namespace

std::vector<Box> ShardBoxes(const Shard& shard) {
  std::vector<Box> out;
  if (shard.empty()) return out;
  if (shard.frame.rank() == 0) {
    out.push_back(shard.frame);
    return out;
  }
  std::vector<Interval> prefix;
  Decompose(shard.frame, InnerSizes(shard.frame), prefix, 0, shard.flat_begin, shard.flat_end,
            out);
  return out;
}

std::vector<Box> IntersectShard(const Shard& shard, const Box& box) {
  std::vector<Box> out;
  for (const Box& b : ShardBoxes(shard)) {
    Box c = Intersect(b, box);
    if (!c.empty()) out.push_back(std::move(c));
  }
  return out;
}

StatusOr<StridedView> ViewOf(const Shard& shard, const Box& box) {
  const Box& f = shard.frame;
  if (box.rank() != f.rank()) {
    return InvalidArgumentError("box " + box.ToString() + " has rank " +
                                std::to_string(box.rank()) + ", shard frame " + f.ToString() +
                                " has rank " + std::to_string(f.rank()));
  }
  StridedView v;
  v.shape = box.shape();
  v.strides = InnerSizes(f);
  if (box.empty()) return v;
  if (!f.Contains(box)) {
    return InvalidArgumentError("box " + box.ToString() + " is not inside shard " +
                                shard.ToString());
  }
  int64_t first = 0, last = 0;
  for (int d = 0; d < f.rank(); ++d) {
    first += (box.dim(d).begin - f.dim(d).begin) * v.strides[static_cast<size_t>(d)];
    last += (box.dim(d).end - 1 - f.dim(d).begin) * v.strides[static_cast<size_t>(d)];
  }
  if (first < shard.flat_begin || last >= shard.flat_end) {
    return InvalidArgumentError("box " + box.ToString() + " is not inside shard " +
                                shard.ToString());
  }
  v.offset = first - shard.flat_begin;
  return v;
}

}  // namespace morph
