// Views of the memory that holds a tensor's shard (host or CUDA): what State::TensorRef hands
// out and what a TensorAllocator returns. Non-owning; plain values.
#ifndef MORPH_BUFFER_H_
#define MORPH_BUFFER_H_

#include "morph/api.h"

#include <cstddef>
#include <string_view>

namespace morph {

enum class MemoryKind { kHost, kCuda };
MORPH_API std::string_view MemoryKindName(MemoryKind kind);  // "host", "cuda"

// Non-owning view of a buffer.
struct MORPH_API BufferView {
  void* data = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
};
struct MORPH_API ConstBufferView {
  const void* data = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  ConstBufferView() = default;
  ConstBufferView(const void* d, size_t n, MemoryKind k) : data(d), bytes(n), kind(k) {}
  ConstBufferView(BufferView v) : data(v.data), bytes(v.bytes), kind(v.kind) {}  // NOLINT
};

}  // namespace morph

#endif  // MORPH_BUFFER_H_
