// The state in CUDA memory (device.h): gpt_nccl. Copies go through one private stream and
// wait for it, so a copy has landed when Copy returns (cudaMemcpy from pageable memory may
// return before its DMA finished, and NCCL's streams do not wait on the legacy stream).
#include <cuda_runtime.h>

#include <vector>

#include "device.h"

namespace gpt {
namespace {

cudaStream_t g_stream = nullptr;
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};
std::vector<Scratch> g_scratch;

morph::Status CudaError(const char* what, cudaError_t e) {
  return morph::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

morph::MemoryKind StateMemory() { return morph::MemoryKind::kCuda; }

std::string InitStateMemory() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    return std::string("no CUDA device (cudaGetDeviceCount: ") +
           (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") +
           "): gpt_nccl keeps its state on a GPU; run gpt instead";
  }
  return "";
}

morph::Status Copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return morph::Status::Ok();
  if (g_stream == nullptr) {
    // On the current device: the runtime made its device current before this (Start).
    if (cudaError_t e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaError("cudaStreamCreate", e);
    }
  }
  if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, g_stream);
      e != cudaSuccess) {
    return CudaError("cudaMemcpyAsync", e);
  }
  if (cudaError_t e = cudaStreamSynchronize(g_stream); e != cudaSuccess) {
    return CudaError("cudaStreamSynchronize", e);
  }
  return morph::Status::Ok();
}

morph::StatusOr<void*> DeviceScratch(int slot, size_t bytes) {
  if (slot < 0) return morph::InvalidArgumentError("scratch slot < 0");
  if (g_scratch.size() <= static_cast<size_t>(slot)) g_scratch.resize(slot + 1);
  Scratch& s = g_scratch[slot];
  if (s.bytes < bytes) {
    if (s.ptr != nullptr) cudaFree(s.ptr);
    s = Scratch{};
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
      return morph::ResourceExhaustedError("cudaMalloc(" + std::to_string(bytes) +
                                           "): " + cudaGetErrorString(e));
    }
    s = Scratch{p, bytes};
  }
  return s.ptr;
}

}  // namespace gpt
