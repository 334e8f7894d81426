#include "reshard/strided_copy.h"

#include <algorithm>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <string>

namespace morph {
namespace {

std::string Join(const std::vector<int64_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "}";
}

}  // namespace

StridedView ContiguousView(const std::vector<int64_t>& shape) {
  StridedView v;
  v.shape = shape;
  v.strides.assign(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    v.strides[static_cast<size_t>(d)] =
        v.strides[static_cast<size_t>(d) + 1] * shape[static_cast<size_t>(d) + 1];
  }
  return v;
}

StatusOr<CopyGeometry> MakeCopyGeometry(const StridedView& dst, const StridedView& src) {
  if (dst.shape != src.shape || dst.strides.size() != dst.shape.size() ||
      src.strides.size() != src.shape.size()) {
    return InvalidArgumentError("copy between views of different shapes: destination " +
                                Join(dst.shape) + ", source " + Join(src.shape));
  }
  CopyGeometry g;
  g.dst_offset = dst.offset;
  g.src_offset = src.offset;
  const int n = static_cast<int>(src.shape.size());
  int64_t count = 1;
  for (int64_t s : src.shape) count *= s;
  g.num_elements = count;
  if (n == 0 || count == 0) {
    g.row = 1;
    return g;
  }
  if (src.strides.back() != 1 || dst.strides.back() != 1) {
    return InvalidArgumentError("innermost strides must be 1, got destination " +
                                Join(dst.strides) + ", source " + Join(src.strides));
  }
  // Merge dims from the inside out while the next outer dim continues the run on both sides;
  // size-1 dims never break a run.
  std::vector<int64_t> shape, ds, ss;  // innermost first
  shape.push_back(src.shape[static_cast<size_t>(n - 1)]);
  ds.push_back(1);
  ss.push_back(1);
  for (int d = n - 2; d >= 0; --d) {
    const size_t i = static_cast<size_t>(d);
    const int64_t len = src.shape[i];
    if (len == 1) continue;
    if (shape.back() == 1) {  // a leading run of size-1 dims
      shape.back() = len;
      ds.back() = dst.strides[i];
      ss.back() = src.strides[i];
      continue;
    }
    if (dst.strides[i] == ds.back() * shape.back() && src.strides[i] == ss.back() * shape.back()) {
      shape.back() *= len;
      continue;
    }
    shape.push_back(len);
    ds.push_back(dst.strides[i]);
    ss.push_back(src.strides[i]);
  }
  // The innermost merged dim has stride 1 on both sides only if it started at the last dim.
  if (ds.front() != 1 || ss.front() != 1) {
    // Last dim had length 1 and an outer dim took its place: treat that dim as rows of 1.
    shape.insert(shape.begin(), 1);
    ds.insert(ds.begin(), 1);
    ss.insert(ss.begin(), 1);
  }
  if (static_cast<int>(shape.size()) - 1 > kMaxCopyDims) {
    return InvalidArgumentError("copy has " + std::to_string(shape.size() - 1) +
                                " non-mergeable outer dimensions, at most " +
                                std::to_string(kMaxCopyDims) + " are supported");
  }
  g.row = shape.front();
  g.outer_rank = static_cast<int>(shape.size()) - 1;
  for (int k = 0; k < g.outer_rank; ++k) {  // outermost first
    const size_t from = shape.size() - 1 - static_cast<size_t>(k);
    g.outer_shape[k] = shape[from];
    g.dst_stride[k] = ds[from];
    g.src_stride[k] = ss[from];
  }
  return g;
}

namespace {

#if defined(__SSE2__)
// One 64-byte line, streamed.
inline void StreamLine(char* d, const char* s) {
  __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
  __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
  __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
}
#endif

// Non-temporal copy: memcpy up to 16-byte destination alignment, 64-byte streamed lines, memcpy
// of the tail. One line after the other: interleaving four 4 KiB blocks line by line (as
// glibc's largest memcpy does) ran at 11.6 GB/s against 9.1 single-threaded on one VM, but at
// 9.4-10.7 against 12.9-16.4 on another (AMD EPYC), where it also made the executor 2-3x slower
// with more copying threads than cores (docs/performance.md). The caller issues the store fence
// once after all its rows.
void StreamRow(char* d, const char* s, size_t n) {
#if defined(__SSE2__)
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  if (n < head + 64) {
    std::memcpy(d, s, n);
    return;
  }
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64) StreamLine(d, s);
  std::memcpy(d, s, n);
#else
  std::memcpy(d, s, n);
#endif
}

}  // namespace

void StoreFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

void StreamCopy(void* dst, const void* src, size_t bytes) {
  StreamRow(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
}

void BulkCopy(void* dst, const void* src, size_t bytes) {
  if (bytes < kStreamingCopyMinBytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  StreamRow(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  StoreFence();
}

void HostStridedCopy(const CopyGeometry& g, void* dst, const void* src, int elem_size,
                     int64_t begin, int64_t end) {
  if (begin >= end) return;
  // Large copies stream (rows of any size): the data lands in memory that the copier does
  // not read again.
  const bool stream = static_cast<size_t>((end - begin) * elem_size) >= kStreamingCopyMinBytes;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const int64_t es = elem_size;
  int64_t row_index = begin / g.row;
  int64_t idx[kMaxCopyDims];
  int64_t rem = row_index;
  for (int k = g.outer_rank - 1; k >= 0; --k) {
    idx[k] = rem % g.outer_shape[k];
    rem /= g.outer_shape[k];
  }
  int64_t pos = begin;
  while (pos < end) {
    int64_t doff = g.dst_offset, soff = g.src_offset;
    for (int k = 0; k < g.outer_rank; ++k) {
      doff += idx[k] * g.dst_stride[k];
      soff += idx[k] * g.src_stride[k];
    }
    const int64_t row_begin = row_index * g.row;
    const int64_t in_row = pos - row_begin;
    const int64_t n = std::min(end, row_begin + g.row) - pos;
    if (stream) {
      StreamRow(d + (doff + in_row) * es, s + (soff + in_row) * es, static_cast<size_t>(n * es));
    } else {
      std::memcpy(d + (doff + in_row) * es, s + (soff + in_row) * es, static_cast<size_t>(n * es));
    }
    pos += n;
    ++row_index;
    for (int k = g.outer_rank - 1; k >= 0; --k) {
      if (++idx[k] < g.outer_shape[k]) break;
      idx[k] = 0;
    }
  }
  if (stream) StoreFence();
}

namespace {

// Row-major strides of the geometry's (outer dims, row) shape.
void DenseStrides(const CopyGeometry& g, int64_t* strides) {
  int64_t s = g.row;
  for (int k = g.outer_rank - 1; k >= 0; --k) {
    strides[k] = s;
    s *= g.outer_shape[k];
  }
}

}  // namespace

CopyGeometry WithDenseSource(const CopyGeometry& g) {
  CopyGeometry r = g;
  DenseStrides(g, r.src_stride);
  r.src_offset = 0;
  return r;
}

CopyGeometry WithDenseDestination(const CopyGeometry& g) {
  CopyGeometry r = g;
  DenseStrides(g, r.dst_stride);
  r.dst_offset = 0;
  return r;
}

void HostStridedTransfer(const CopyGeometry& dst_g, void* dst, int64_t dst_begin,
                         const CopyGeometry& src_g, const void* src, int64_t src_begin,
                         int elem_size, int64_t count) {
  if (count <= 0) return;
  // Walk the source's contiguous runs; each goes to the destination layout with one
  // HostStridedCopy from a dense source placed at the run.
  CopyGeometry to_dst = WithDenseSource(dst_g);
  const auto* s = static_cast<const char*>(src);
  const int64_t es = elem_size;
  const int64_t src_end = src_begin + count;
  int64_t row_index = src_begin / src_g.row;
  int64_t idx[kMaxCopyDims];
  int64_t rem = row_index;
  for (int k = src_g.outer_rank - 1; k >= 0; --k) {
    idx[k] = rem % src_g.outer_shape[k];
    rem /= src_g.outer_shape[k];
  }
  int64_t pos = src_begin;
  while (pos < src_end) {
    int64_t soff = src_g.src_offset;
    for (int k = 0; k < src_g.outer_rank; ++k) soff += idx[k] * src_g.src_stride[k];
    const int64_t row_begin = row_index * src_g.row;
    const int64_t n = std::min(src_end, row_begin + src_g.row) - pos;
    const int64_t d = dst_begin + (pos - src_begin);  // destination element of this run's first
    to_dst.src_offset = -d;                           // element d is read at the run's start
    HostStridedCopy(to_dst, dst, s + (soff + pos - row_begin) * es, elem_size, d, d + n);
    pos += n;
    ++row_index;
    for (int k = src_g.outer_rank - 1; k >= 0; --k) {
      if (++idx[k] < src_g.outer_shape[k]) break;
      idx[k] = 0;
    }
  }
}

std::optional<int64_t> ContiguousOffset(const StridedView& view, int64_t begin, int64_t end) {
  if (begin >= end) return view.offset;
  // Element index -> buffer offset; the range is contiguous iff last - first == count - 1
  // (row-major strides are positive, so no two elements share an offset).
  auto offset_of = [&](int64_t linear) {
    int64_t off = view.offset;
    for (int d = static_cast<int>(view.shape.size()) - 1; d >= 0; --d) {
      const size_t i = static_cast<size_t>(d);
      off += (linear % view.shape[i]) * view.strides[i];
      linear /= view.shape[i];
    }
    return off;
  };
  const int64_t first = offset_of(begin), last = offset_of(end - 1);
  if (last - first == end - 1 - begin) return first;
  return std::nullopt;
}

}  // namespace morph
