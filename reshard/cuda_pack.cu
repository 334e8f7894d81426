#include <algorithm>

#include "base/cuda_check.h"
#include "reshard/cuda_pack.h"

namespace morph {
namespace {

__device__ inline void RowOffsets(const CopyGeometry& g, int64_t row, int64_t& doff,
                                  int64_t& soff) {
  doff = g.dst_offset;
  soff = g.src_offset;
  for (int k = g.outer_rank - 1; k >= 0; --k) {
    const int64_t i = row % g.outer_shape[k];
    row /= g.outer_shape[k];
    doff += i * g.dst_stride[k];
    soff += i * g.src_stride[k];
  }
}

// Copies n bytes with the widest type both pointers and the length allow; threads of the block
// stride over the words (coalesced).
__device__ inline void CopyBytes(char* d, const char* s, int64_t n) {
  const uintptr_t align =
      reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | static_cast<uintptr_t>(n);
  if ((align & 15) == 0) {
    auto* dw = reinterpret_cast<uint4*>(d);
    auto* sw = reinterpret_cast<const uint4*>(s);
    for (int64_t i = threadIdx.x; i < n / 16; i += blockDim.x) dw[i] = sw[i];
  } else if ((align & 7) == 0) {
    auto* dw = reinterpret_cast<uint2*>(d);
    auto* sw = reinterpret_cast<const uint2*>(s);
    for (int64_t i = threadIdx.x; i < n / 8; i += blockDim.x) dw[i] = sw[i];
  } else if ((align & 3) == 0) {
    auto* dw = reinterpret_cast<uint32_t*>(d);
    auto* sw = reinterpret_cast<const uint32_t*>(s);
    for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x) dw[i] = sw[i];
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
  }
}

// One block per row (grid-stride): for long rows.
__global__ void RowCopyKernel(CopyGeometry g, char* dst, const char* src, int elem_size,
                              int64_t begin, int64_t end) {
  const int64_t first_row = begin / g.row;
  const int64_t last_row = (end - 1) / g.row;
  for (int64_t row = first_row + blockIdx.x; row <= last_row; row += gridDim.x) {
    int64_t doff, soff;
    RowOffsets(g, row, doff, soff);
    const int64_t lo = max(begin, row * g.row), hi = min(end, (row + 1) * g.row);
    const int64_t in_row = lo - row * g.row;
    CopyBytes(dst + (doff + in_row) * elem_size, src + (soff + in_row) * elem_size,
              (hi - lo) * elem_size);
  }
}

// One thread per element (grid-stride): for short rows, where a block per row would idle.
template <typename T>
__global__ void ElementCopyKernel(CopyGeometry g, T* dst, const T* src, int64_t begin,
                                  int64_t end) {
  for (int64_t e = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < end;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t doff, soff;
    RowOffsets(g, e / g.row, doff, soff);
    const int64_t in_row = e % g.row;
    dst[doff + in_row] = src[soff + in_row];
  }
}

}  // namespace

Status CudaStridedCopy(const CopyGeometry& g, void* dst, const void* src, int elem_size,
                       int64_t begin, int64_t end, cudaStream_t stream) {
  if (begin >= end) return Status();
  if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) {
    return InvalidArgumentError("CUDA strided copy: element size " + std::to_string(elem_size) +
                                " is not 1, 2, 4 or 8");
  }
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  constexpr int kThreads = 256;
  if (g.row * elem_size >= 512) {
    const int64_t rows = (end - 1) / g.row - begin / g.row + 1;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 16));
    RowCopyKernel<<<blocks, kThreads, 0, stream>>>(g, d, s, elem_size, begin, end);
  } else {
    const int64_t n = end - begin;
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16));
    switch (elem_size) {
      case 1:
        ElementCopyKernel<uint8_t><<<blocks, kThreads, 0, stream>>>(
            g, reinterpret_cast<uint8_t*>(d), reinterpret_cast<const uint8_t*>(s), begin, end);
        break;
      case 2:
        ElementCopyKernel<uint16_t><<<blocks, kThreads, 0, stream>>>(
            g, reinterpret_cast<uint16_t*>(d), reinterpret_cast<const uint16_t*>(s), begin, end);
        break;
      case 4:
        ElementCopyKernel<uint32_t><<<blocks, kThreads, 0, stream>>>(
            g, reinterpret_cast<uint32_t*>(d), reinterpret_cast<const uint32_t*>(s), begin, end);
        break;
      default:
        ElementCopyKernel<uint64_t><<<blocks, kThreads, 0, stream>>>(
            g, reinterpret_cast<uint64_t*>(d), reinterpret_cast<const uint64_t*>(s), begin, end);
        break;
    }
  }
  MORPH_CUDA_RETURN_IF_ERROR(cudaGetLastError()) << "launching the strided copy kernel";
  return Status();
}

}  // namespace morph
