#include "morph/dataset_cursor.h"

#include <algorithm>
#include <string>

namespace morph {
namespace {

// splitmix64's finalizer: a well-mixed 64-bit hash, identical on every platform.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

StatusOr<DatasetCursor> DatasetCursor::Create(DatasetSpec spec) {
  if (spec.num_samples < 1) {
    return InvalidArgumentError("num_samples: must be at least 1, got " +
                                std::to_string(spec.num_samples));
  }
  if (spec.global_batch < 1) {
    return InvalidArgumentError("global_batch: must be at least 1, got " +
                                std::to_string(spec.global_batch));
  }
  // Positions up to 2^40 steps * B must fit in int64.
  if (spec.global_batch > (int64_t{1} << 22)) {
    return InvalidArgumentError("global_batch: at most 4194304 samples, got " +
                                std::to_string(spec.global_batch));
  }
  return DatasetCursor(spec);
}

DatasetCursor::DatasetCursor(DatasetSpec spec) : spec_(spec) {
  while ((uint64_t{1} << (2 * half_bits_)) < static_cast<uint64_t>(spec_.num_samples)) {
    ++half_bits_;
  }
}

int64_t DatasetCursor::Permute(uint64_t epoch, int64_t index) const {
  // A 4-round Feistel network is a bijection on [0, 2^(2h)); walking the cycle until the value
  // falls below N restricts it to a bijection on [0, N) (at most 4 steps expected, since
  // 2^(2h) < 4N).
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  const uint64_t key = Mix(spec_.seed ^ Mix(epoch));
  uint64_t x = static_cast<uint64_t>(index);
  do {
    uint64_t left = x >> half_bits_;
    uint64_t right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t f = Mix(key ^ (round << 56) ^ right) & mask;
      uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= static_cast<uint64_t>(spec_.num_samples));
  return static_cast<int64_t>(x);
}

int64_t DatasetCursor::SampleAt(int64_t pos) const {
  uint64_t epoch = static_cast<uint64_t>(pos / spec_.num_samples);
  int64_t index = pos % spec_.num_samples;
  return spec_.shuffle ? Permute(epoch, index) : index;
}

DatasetCursor::Range DatasetCursor::RangeFor(int64_t step, int dp, int dp_rank) const {
  const int64_t b = spec_.global_batch;
  const int64_t base = step * b;
  // Rank d takes [floor(d*B/dp), floor((d+1)*B/dp)): sizes differ by at most one.
  return Range{base + dp_rank * b / dp, base + (dp_rank + 1) * b / dp};
}

RankBatch DatasetCursor::BatchFor(int64_t step, int dp, int dp_rank, int64_t micro_batch) const {
  Range r = RangeFor(step, dp, dp_rank);
  RankBatch out;
  out.first_position = r.begin;
  out.samples.reserve(r.end - r.begin);
  for (int64_t p = r.begin; p < r.end; ++p) out.samples.push_back(SampleAt(p));
  for (size_t i = 0; i < out.samples.size(); i += micro_batch) {
    size_t end = std::min(out.samples.size(), i + static_cast<size_t>(micro_batch));
    out.micro_batches.emplace_back(out.samples.begin() + i, out.samples.begin() + end);
  }
  return out;
}

}  // namespace morph
