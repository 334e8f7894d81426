// CUDA pack/unpack kernel bandwidth next to cudaMemcpy device-to-device bandwidth of the same
// bytes, in the same run. One JSON object per line:
//   {"name":"pack_gpu/cols_half_f32","bytes":...,"seconds":...,"gbps":...,
//    "memcpy_gbps":...,"ratio":...}
// ratio = kernel bandwidth / cudaMemcpy D2D bandwidth (bytes moved counted once).
// Usage: pack_gpu_bench [--mb=N] (size of the packed data per case, default 512 MiB)
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "reshard/cuda_pack.h"
#include "reshard/strided_copy.h"

namespace morph {
namespace {

#define CHECK_CUDA(x)                                               \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

template <typename F>
double TimeIt(F&& f, int reps) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  f();  // warm-up
  CHECK_CUDA(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) f();
  CHECK_CUDA(cudaEventRecord(b));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 1000.0 / reps;
}

// A box of `cols` columns out of a rows x frame_cols matrix, packed (or unpacked).
void Case(const char* name, int64_t rows, int64_t frame_cols, int64_t cols, int es, bool unpack,
          void* frame, void* packed, void* scratch) {
  const Shard s = *Shard::Whole(Box::FromShape({rows, frame_cols}));
  const StridedView v = *ViewOf(s, Box({{0, rows}, {0, cols}}));
  const StridedView dense = ContiguousView({rows, cols});
  const CopyGeometry g = unpack ? *MakeCopyGeometry(v, dense) : *MakeCopyGeometry(dense, v);
  const size_t bytes = static_cast<size_t>(rows * cols * es);
  const int reps = 10;
  const double t_kernel = TimeIt(
      [&] {
        Status st = unpack ? CudaStridedCopy(g, frame, packed, es, 0, g.num_elements, nullptr)
                           : CudaStridedCopy(g, packed, frame, es, 0, g.num_elements, nullptr);
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          std::exit(1);
        }
      },
      reps);
  const double t_memcpy = TimeIt(
      [&] {
        CHECK_CUDA(cudaMemcpyAsync(scratch, packed, bytes, cudaMemcpyDeviceToDevice, nullptr));
      },
      reps);
  const double gbps = bytes / t_kernel / 1e9, mgbps = bytes / t_memcpy / 1e9;
  std::printf(
      "{\"name\":\"pack_gpu/%s\",\"bytes\":%zu,\"seconds\":%.6g,\"gbps\":%.4g,"
      "\"memcpy_seconds\":%.6g,\"memcpy_gbps\":%.4g,\"ratio\":%.4f,\"row_bytes\":%lld}\n",
      name, bytes, t_kernel, gbps, t_memcpy, mgbps, mgbps > 0 ? gbps / mgbps : 0.0,
      static_cast<long long>(cols * es));
  std::fflush(stdout);
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  int64_t mb = 512;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--mb=", 5) == 0) mb = std::atoll(argv[i] + 5);
  }
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("{\"name\":\"pack_gpu\",\"skipped\":\"no usable GPU: %s\"}\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 0;
  }
  const size_t packed_bytes = static_cast<size_t>(mb) << 20;
  void *frame = nullptr, *packed = nullptr, *scratch = nullptr;
  CHECK_CUDA(cudaMalloc(&frame, 2 * packed_bytes));
  CHECK_CUDA(cudaMalloc(&packed, packed_bytes));
  CHECK_CUDA(cudaMalloc(&scratch, packed_bytes));
  CHECK_CUDA(cudaMemset(frame, 1, 2 * packed_bytes));
  // Half the columns of a matrix (TP 4->2 style), f32 and bf16; narrow rows; ZeRO-like
  // contiguous ranges; unpack of the same.
  const int64_t elems = static_cast<int64_t>(packed_bytes / 4);
  const int64_t cols = 4096;
  morph::Case("cols_half_f32", elems / cols, 2 * cols, cols, 4, false, frame, packed, scratch);
  morph::Case("cols_half_f32_unpack", elems / cols, 2 * cols, cols, 4, true, frame, packed,
              scratch);
  morph::Case("cols_half_bf16", elems * 2 / cols, 2 * cols, cols, 2, false, frame, packed, scratch);
  morph::Case("narrow_rows_64B_f32", elems / 16, 32, 16, 4, false, frame, packed, scratch);
  morph::Case("contiguous_f32", elems / cols, cols, cols, 4, false, frame, packed, scratch);
  cudaFree(frame);
  cudaFree(packed);
  cudaFree(scratch);
  return 0;
}
