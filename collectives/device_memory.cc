#include "collectives/device_memory.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>

#include "base/cuda_check.h"
#endif

namespace morph {

#if MORPH_WITH_CUDA
namespace {

class CudaMemory final : public DeviceMemory {
 public:
  CudaMemory(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaMemory() override {
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  void* stream() const override { return stream_; }
  bool IsDevice(const void* p, size_t) const override {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  }
  StatusOr<Buffer> Allocate(size_t bytes) override { return CudaAllocator(device_)(bytes); }
  Allocator StagingAllocator() override { return CudaAllocator(device_); }
  // From pageable host memory cudaMemcpyAsync returns once the source has been read (CUDA's
  // "API synchronization behavior"), so the caller's buffer may go at once; the copy itself is
  // ordered on the stream before the group that sends it.
  Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    MORPH_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return Status::Ok();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    MORPH_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    MORPH_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

 private:
  const int device_;
  cudaStream_t stream_;
};

}  // namespace

StatusOr<std::unique_ptr<DeviceMemory>> CudaDeviceMemory(int device) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return UnavailableError(std::string("device memory: no usable GPU (cudaGetDeviceCount: ") +
                            (e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device") + ")");
  }
  MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(device)) << "device memory on cuda:" << device;
  cudaStream_t stream = nullptr;
  MORPH_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking))
      << "device memory on cuda:" << device;
  return std::unique_ptr<DeviceMemory>(new CudaMemory(device, stream));
}
#else
StatusOr<std::unique_ptr<DeviceMemory>> CudaDeviceMemory(int device) {
  return UnimplementedError("device memory on cuda:" + std::to_string(device) +
                            ": morph was built without CUDA");
}
#endif

}  // namespace morph
