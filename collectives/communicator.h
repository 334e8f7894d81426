// What the backends and the runtime share beyond the public Communicator interface
// (morph/communicator.h): the job's default collective timeout from the environment, and the
// host reduction and f16/bf16 conversions the Gloo backend and the executor use.
#ifndef MORPH_COLLECTIVES_COMMUNICATOR_H_
#define MORPH_COLLECTIVES_COMMUNICATOR_H_

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "morph/communicator.h"

namespace morph {

// MORPH_COLLECTIVE_TIMEOUT_MS as a duration, for callers that pass "the job's default" timeout.
// kInvalidArgument naming the variable for a bad value. Any thread.
StatusOr<std::chrono::milliseconds> CollectiveTimeoutFromEnv();

// Reduces `n` elements of `in` into `inout` (inout[i] = op(inout[i], in[i])) on the host.
// f16/bf16 are converted to f32, combined and rounded back (round to nearest even). The two
// buffers must not overlap.
void ReduceInto(void* inout, const void* in, size_t n, DType dtype, ReduceOp op);

// f32 <-> f16/bf16, round to nearest even; NaN stays NaN.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_COMMUNICATOR_H_
