// CUDA runtime errors as Status. Header-only so that base/ does not depend on CUDA.
//
//   MORPH_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream))
//       << "copying shard " << name;
#ifndef MORPH_BASE_CUDA_CHECK_H_
#define MORPH_BASE_CUDA_CHECK_H_

#include <cuda_runtime_api.h>

#include "base/check.h"

namespace morph {

// Out of memory -> kResourceExhausted; no driver / no device -> kUnavailable; invalid value
// -> kInvalidArgument; anything else (sticky launch failures, illegal addresses) -> kInternal.
inline StatusCode CudaErrorToStatusCode(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return StatusCode::kResourceExhausted;
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
      return StatusCode::kUnavailable;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
      return StatusCode::kInvalidArgument;
    default:
      return StatusCode::kInternal;
  }
}

inline Status CudaToStatus(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return Status();
  return ApiError(CudaErrorToStatusCode(e), "CUDA", call, static_cast<long long>(e),
                  std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e), file, line);
}

}  // namespace morph

#define MORPH_CUDA_RETURN_IF_ERROR(call) \
  MORPH_RETURN_IF_ERROR(::morph::CudaToStatus((call), #call, __FILE__, __LINE__))

#endif  // MORPH_BASE_CUDA_CHECK_H_
