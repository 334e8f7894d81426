// CUDA pack/unpack: the device version of HostStridedCopy (strided_copy.h), used by the
// executor when shards live in GPU memory, and by checkpoint loads into device buffers.
// Only present in CUDA builds (MORPH_WITH_CUDA).
//
//   MORPH_ASSIGN_OR_RETURN(CopyGeometry g, MakeCopyGeometry(ContiguousView(shape), src_view));
//   MORPH_RETURN_IF_ERROR(CudaStridedCopy(g, staging, shard, 4, 0, g.num_elements, stream));
//   MORPH_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
#ifndef MORPH_RESHARD_CUDA_PACK_H_
#define MORPH_RESHARD_CUDA_PACK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "morph/status.h"
#include "reshard/strided_copy.h"

namespace morph {

// Enqueues on `stream` the copy of box elements [begin, end) from device buffer `src` to device
// buffer `dst` (base pointers; offsets are in g). Returns immediately; kInternal or
// kInvalidArgument if the launch fails (errors of the kernel itself surface at the next
// synchronization). Any thread; the caller orders uses of the buffers through `stream`.
Status CudaStridedCopy(const CopyGeometry& g, void* dst, const void* src, int elem_size,
                       int64_t begin, int64_t end, cudaStream_t stream);

}  // namespace morph

#endif  // MORPH_RESHARD_CUDA_PACK_H_
