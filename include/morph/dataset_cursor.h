// DatasetCursor: which samples each data-parallel rank trains on at each step, such that the
// sequence of samples a run consumes is one fixed, seeded global order whatever the allocation
// does (docs/design.md §5: global batch and sample order stay fixed across changes).
//
// The global order is an infinite stream: epoch e is a seeded pseudo-random permutation of the
// N sample ids (a Feistel network with cycle walking: O(1) memory, the same on every machine),
// epochs follow each other. Step s consumes stream positions [s·B, (s+1)·B) for the fixed global
// batch B. Under a config with dp data-parallel ranks, DP rank d takes the d-th of dp contiguous
// slices of that range (sizes differ by at most one when dp does not divide B), cut into
// micro-batches of at most `micro_batch` samples (gradient accumulation absorbs dp changes).
// The cursor's whole state is the step, so moving it at a reconfiguration is moving the step:
// a joiner that knows (seed, N, B, step) computes the same samples as everyone else.
//
//   MORPH_ASSIGN_OR_RETURN(DatasetCursor cursor, DatasetCursor::Create(
//       {.num_samples = 1 << 20, .global_batch = 512, .seed = 7}));
//   RankBatch mine = cursor.BatchFor(step, /*dp=*/4, /*dp_rank=*/1, /*micro_batch=*/16);
//   for (auto& mb : mine.micro_batches) { ...forward/backward on samples mb... }
//   // loss/gradient scale: 1 / cursor.spec().global_batch, whatever dp is
//
// A data loader looks ahead with it (the samples of steps s+1, s+2, ... under the current config
// are known before they begin: what prefetching needs); the runtime's own cursor is
// Runtime::cursor(), built from Options' dataset_* fields and ModelShape::global_batch.
//
// Pure values and functions; thread-compatible; any thread.
#ifndef MORPH_DATASET_CURSOR_H_
#define MORPH_DATASET_CURSOR_H_

#include <cstdint>
#include <vector>

#include "morph/api.h"
#include "morph/status.h"
#include "morph/step.h"  // RankBatch

namespace morph {

struct MORPH_API DatasetSpec {
  int64_t num_samples = 0;   // N, at least 1
  int64_t global_batch = 0;  // B, at least 1; samples per optimizer step, fixed for the run
  uint64_t seed = 0;
  bool shuffle = true;  // false: epoch order is 0..N-1
};

class MORPH_API DatasetCursor {
 public:
  // kInvalidArgument naming the field: num_samples or global_batch < 1, or a stream position
  // that could overflow int64 within 2^40 steps.
  static StatusOr<DatasetCursor> Create(DatasetSpec spec);

  const DatasetSpec& spec() const { return spec_; }

  // The sample at stream position `pos` (>= 0).
  int64_t SampleAt(int64_t pos) const;
  // The contiguous range [begin, end) of stream positions DP rank d takes at `step`.
  struct Range {
    int64_t begin = 0;
    int64_t end = 0;
  };
  Range RangeFor(int64_t step, int dp, int dp_rank) const;
  // Precondition: step >= 0, dp >= 1, 0 <= dp_rank < dp, micro_batch >= 1.
  RankBatch BatchFor(int64_t step, int dp, int dp_rank, int64_t micro_batch) const;

 private:
  explicit DatasetCursor(DatasetSpec spec);
  int64_t Permute(uint64_t epoch, int64_t index) const;

  DatasetSpec spec_;
  int half_bits_ = 1;  // Feistel half width: 2^(2*half_bits_) >= N
};

}  // namespace morph

#endif  // MORPH_DATASET_CURSOR_H_
