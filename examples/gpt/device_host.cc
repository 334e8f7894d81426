// The state in host memory (device.h): gpt and gpt_cuda.
#include <cstring>

#include "device.h"

namespace gpt {

morph::MemoryKind StateMemory() { return morph::MemoryKind::kHost; }

std::string InitStateMemory() { return ""; }

morph::Status Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return morph::Status::Ok();
}

morph::StatusOr<void*> DeviceScratch(int, size_t) {
  return morph::FailedPreconditionError(
      "device buffers in a host build: the NCCL backend needs gpt_nccl");
}

}  // namespace gpt
