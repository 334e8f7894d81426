// Test and benchmark support for runtime/state/ and runtime/recovery/: a small model whose tensors cover every
// layout (TP split, blocks, padding, ZeRO, hybrid ZeRO, tied stages, replicated), States
// materialized for a config and rank, and a deterministic fill checked bitwise. Not installed.
//
//   auto s = *MakeState(Config(/*dp=*/1, /*tp=*/2, /*pp=*/1), /*rank=*/0);
//   Fill(*s, /*seed=*/7);           // each element a function of (seed, tensor, global index)
//   ExpectFilled(*s, 7);            // gtest expectations naming tensor and element
#ifndef MORPH_RUNTIME_STATE_STATE_TESTUTIL_H_
#define MORPH_RUNTIME_STATE_STATE_TESTUTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "morph/parallel_config.h"
#include "runtime/state/state.h"

namespace morph::state_testutil {

// dp x tp x pp over 4 layers (EvenStages).
ParallelConfig Config(int dp, int tp, int pp);
// The model (7 tensors, + a hybrid-ZeRO one when `hybrid`: needs even dp; scalars "step" (8 B)
// and "rng" (16 B) when `scalars`), materialized for (config, rank).
StatusOr<std::unique_ptr<StateStore>> MakeState(const ParallelConfig& config, int rank,
                                           bool hybrid = false, bool scalars = true);
// One f32 tensor of about `bytes` bytes split over TP (dim 0), plus the scalars.
StatusOr<std::unique_ptr<StateStore>> MakeBigState(const ParallelConfig& config, int rank,
                                              int64_t bytes);
// The byte a state element / scalar byte holds for `seed` (padding holds 0).
uint8_t ElementByte(uint64_t seed, size_t tensor, int64_t global_index, int byte);
// Writes the seed's values into every shard and scalar of `state`.
void Fill(StateStore& state, uint64_t seed);
// Number of bytes of `state` (shards and scalars) that differ from Fill(seed); the first
// difference is described in `*first` when given.
int64_t CountDifferences(const StateStore& state, uint64_t seed, std::string* first = nullptr);
// gtest: CountDifferences(state, seed) == 0, naming the first difference.
void ExpectFilled(const StateStore& state, uint64_t seed);

}  // namespace morph::state_testutil

#endif  // MORPH_RUNTIME_STATE_STATE_TESTUTIL_H_
