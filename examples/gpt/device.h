// Where gpt keeps its registered state, chosen at link time like the GEMM (model.h):
// device_host.cc (gpt, gpt_cuda: host memory, Gloo) or device_cuda.cc (gpt_nccl: parameters
// and Adam moments in CUDA memory on the runtime's device, the step's communicators on NCCL).
// The model's elementwise math runs on host copies either way (train.cc), so every variant
// computes the same numbers up to the GEMM backend's summation order.
// Training thread only.
#ifndef MORPH_EXAMPLES_GPT_DEVICE_H_
#define MORPH_EXAMPLES_GPT_DEVICE_H_

#include <morph/morph.h>

#include <cstddef>
#include <string>

namespace gpt {

// The memory the state's tensors are registered in: kHost or kCuda.
morph::MemoryKind StateMemory();
// "" when the state's memory is usable, else why not (no GPU), before the runtime starts.
std::string InitStateMemory();
// Synchronous copy of `bytes` between any two of host memory and the state's memory (returns
// only once the bytes arrived). kInternal naming CUDA's error.
morph::Status Copy(void* dst, const void* src, size_t bytes);
// Device buffer number `slot` of at least `bytes`, kept and grown across calls (communication
// staging for NCCL). kFailedPrecondition in a build without CUDA; kResourceExhausted when
// cudaMalloc fails.
morph::StatusOr<void*> DeviceScratch(int slot, size_t bytes);

}  // namespace gpt

#endif  // MORPH_EXAMPLES_GPT_DEVICE_H_
