// Gemm on the CPU through OpenBLAS's CBLAS (model.h).
#include <cblas.h>

#include "model.h"

namespace gpt {

std::string InitGemm() {
  // One BLAS thread per process: workers share the host's cores.
  openblas_set_num_threads(1);
  return "";
}

const char* GemmBackend() { return "openblas"; }

void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace gpt
