// Copying a box's elements between two buffers that lay it out differently: the one primitive
// behind pack (strided -> contiguous), unpack (contiguous -> strided), local reshard copies
// (strided -> strided) and checkpoint reads. Host code here; cuda_pack.h runs the same
// CopyGeometry on a GPU.
//
//   StridedView src = *ViewOf(old_shard, box), dst = ContiguousView(box.shape());
//   MORPH_ASSIGN_OR_RETURN(CopyGeometry g, MakeCopyGeometry(dst, src));
//   HostStridedCopy(g, staging, old_data, elem_size, /*begin=*/0, /*end=*/g.num_elements);
//
// Thread-safety: pure functions; distinct calls may run concurrently on disjoint destinations.
#ifndef MORPH_RESHARD_STRIDED_COPY_H_
#define MORPH_RESHARD_STRIDED_COPY_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "morph/status.h"
#include "morph/shard.h"

namespace morph {

// Dimensions left after merging the ones that are contiguous in both views.
inline constexpr int kMaxCopyDims = 8;

// A copy of a box between two strided layouts, reduced to `rows` runs of `row` elements that
// are contiguous on both sides. Plain data so that it can be passed to a CUDA kernel.
struct CopyGeometry {
  int outer_rank = 0;  // dims above the row, outermost first
  int64_t outer_shape[kMaxCopyDims] = {};
  int64_t dst_stride[kMaxCopyDims] = {};
  int64_t src_stride[kMaxCopyDims] = {};
  int64_t row = 1;         // elements per contiguous run
  int64_t dst_offset = 0;  // elements, of the box's first element
  int64_t src_offset = 0;
  int64_t num_elements = 0;  // of the whole box
};

// Row-major strides of a dense array of `shape`, offset 0.
StridedView ContiguousView(const std::vector<int64_t>& shape);

// kInvalidArgument if the shapes differ, either innermost stride is not 1, or more than
// kMaxCopyDims dimensions remain after merging.
StatusOr<CopyGeometry> MakeCopyGeometry(const StridedView& dst, const StridedView& src);

// Copies the box elements with row-major linear index in [begin, end) (0 <= begin <= end <=
// num_elements) from `src` to `dst` (base pointers of the two buffers; offsets are in g).
// memcpy for bulk moves: copies of at least kStreamingCopyMinBytes use non-temporal stores on
// x86-64 (the destination is not read back soon, so it should not evict the cache), like
// glibc's memcpy does for very large sizes; smaller ones are plain memcpy. Any alignment.
inline constexpr size_t kStreamingCopyMinBytes = size_t{256} << 10;
void BulkCopy(void* dst, const void* src, size_t bytes);

// One piece of a larger copy made of many pieces (rows of a strided message): non-temporal
// stores for pieces of 64 bytes and more whatever their size, so that a message of many small
// rows streams like one large copy; the caller calls StoreFence() once after the last piece.
void StreamCopy(void* dst, const void* src, size_t bytes);
void StoreFence();

void HostStridedCopy(const CopyGeometry& g, void* dst, const void* src, int elem_size,
                     int64_t begin, int64_t end);

// `g` with its source (destination) side replaced by the dense row-major layout of the box at
// offset 0; the other side is kept. Copies between one side of `g` and a contiguous buffer.
CopyGeometry WithDenseSource(const CopyGeometry& g);
CopyGeometry WithDenseDestination(const CopyGeometry& g);

// Copies `count` elements in one pass, strided to strided between two different geometries of
// the same element order: box elements [src_begin, src_begin + count) read from the source side
// of `src_g` over `src` go to box elements [dst_begin, dst_begin + count) of the destination side
// of `dst_g` over `dst`. Both ranges must lie within their geometry's num_elements.
void HostStridedTransfer(const CopyGeometry& dst_g, void* dst, int64_t dst_begin,
                         const CopyGeometry& src_g, const void* src, int64_t src_begin,
                         int elem_size, int64_t count);

// If box elements [begin, end) of `view` occupy one contiguous range of its buffer, the element
// offset of `begin` in it; else nullopt.
std::optional<int64_t> ContiguousOffset(const StridedView& view, int64_t begin, int64_t end);

}  // namespace morph

#endif  // MORPH_RESHARD_STRIDED_COPY_H_
