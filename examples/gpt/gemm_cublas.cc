// Gemm on the GPU through cuBLAS-XT (model.h): the operands stay in host memory and cuBLAS-XT
// moves tiles to the current device and back, so the rest of the program is unchanged. Row-major
// C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap places.
#include <cublasXt.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "model.h"

namespace gpt {
namespace {
cublasXtHandle_t g_handle = nullptr;
}  // namespace

std::string InitGemm() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    return std::string("no CUDA device (cudaGetDeviceCount: ") +
           (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") +
           "): run the OpenBLAS build (gpt) instead";
  }
  return "";
}

namespace {
// The handle on the device current at the first product: the runtime's (MORPH_CUDA_DEVICE or
// the local rank, made current by Runtime::Start) when the program started the runtime first.
cublasXtHandle_t Handle() {
  if (g_handle != nullptr) return g_handle;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  if (cublasXtCreate(&g_handle) != CUBLAS_STATUS_SUCCESS ||
      cublasXtDeviceSelect(g_handle, 1, &device) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "gpt: cublasXt setup failed on device %d\n", device);
    std::abort();
  }
  return g_handle;
}
}  // namespace

const char* GemmBackend() { return "cublas"; }

void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  cublasStatus_t s = cublasXtSgemm(Handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, ldb, a,
                                   lda, &beta, c, ldc);
  if (s != CUBLAS_STATUS_SUCCESS) {
    // A failed product leaves the step's numbers wrong: stop rather than train on them.
    std::fprintf(stderr, "gpt: cublasXtSgemm failed with status %d\n", static_cast<int>(s));
    std::abort();
  }
}

}  // namespace gpt
