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
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  if (cublasXtCreate(&g_handle) != CUBLAS_STATUS_SUCCESS) return "cublasXtCreate failed";
  if (cublasXtDeviceSelect(g_handle, 1, &device) != CUBLAS_STATUS_SUCCESS) {
    return "cublasXtDeviceSelect failed for device " + std::to_string(device);
  }
  return "";
}

const char* GemmBackend() { return "cublas"; }

void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  cublasStatus_t s = cublasXtSgemm(g_handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, ldb, a,
                                   lda, &beta, c, ldc);
  if (s != CUBLAS_STATUS_SUCCESS) {
    // A failed product leaves the step's numbers wrong: stop rather than train on them.
    std::fprintf(stderr, "gpt: cublasXtSgemm failed with status %d\n", static_cast<int>(s));
    std::abort();
  }
}

}  // namespace gpt
