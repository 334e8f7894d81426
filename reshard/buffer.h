// Buffer: memory that morph owns for a registered tensor's local shard (host or CUDA), so the
// executor can hand back new shards of a different size after a reshard. An Allocator is the
// hook through which users make morph allocate from their own pool, or adopt buffers they
// already have (Buffer::Adopt).
//
//   MORPH_ASSIGN_OR_RETURN(Buffer b, HostAllocator()(1 << 20));   // 1 MiB, 64-byte aligned
//   Buffer mine = Buffer::Adopt(ptr, bytes, MemoryKind::kHost, [](void* p) { free(p); });
//   BufferView v = b.view();                                       // non-owning
//
// Thread-safety: a Buffer is a move-only value; allocators are callable from any thread.
#ifndef MORPH_RESHARD_BUFFER_H_
#define MORPH_RESHARD_BUFFER_H_

#include <cstddef>
#include <functional>
#include <string_view>
#include <vector>

#include "morph/buffer.h"
#include "morph/status.h"

namespace morph {

class Buffer {
 public:
  using Release = std::function<void(void*)>;

  Buffer() = default;
  // Takes ownership of `data`: `release(data)` runs when the Buffer dies (may be empty: the
  // caller keeps ownership and must outlive the Buffer).
  static Buffer Adopt(void* data, size_t bytes, MemoryKind kind, Release release);

  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  BufferView view() const { return {data_, bytes_, kind_}; }
  // True for host memory that is a private anonymous mapping of its own (MapHost; what
  // HostAllocator returns for 1 MiB or more): its pages can be moved (MovePages).
  bool page_mapped() const { return mapped_; }

  // A page-aligned private anonymous mapping of `bytes` bytes (> 0), not yet faulted in;
  // kResourceExhausted naming the size when mmap fails. Any thread.
  static StatusOr<Buffer> MapHost(size_t bytes);

 private:
  friend Status MovePages(Buffer& src, Buffer& dst, size_t offset);
  friend class PagePool;
  void Reset();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemoryKind kind_ = MemoryKind::kHost;
  Release release_;
  bool mapped_ = false;
};

// Moves the pages of `src` into `dst` at byte `offset`, without copying a byte (mremap): dst's
// bytes [offset, offset + src.size()) then hold src's, the rest of the last page moved is
// undefined, and src is empty. How a growing shard that contains its old one keeps the resident
// part in place (runtime/switch/switch.h). kInvalidArgument (nothing changed) unless both are
// page_mapped(), src is not empty, `offset` is a multiple of the page size and
// offset + src.size() <= dst.size(); kInternal naming errno if mremap fails (nothing changed).
// Any thread; not concurrently with other uses of either buffer.
Status MovePages(Buffer& src, Buffer& dst, size_t offset);

// Pages of released page-mapped buffers, handed to new ones without a page fault (mremap): in a
// switch, the old shards released after one batch back the new shards allocated for the next
// (runtime/switch/switch.h). Recycled pages keep whatever they held: only for buffers that are
// written in full before they are read. One owner thread.
class PagePool {
 public:
  PagePool() = default;
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;
  ~PagePool() { Clear(); }

  // Takes `b`'s pages (b is empty afterwards) when it is page_mapped(); false (b untouched)
  // otherwise.
  bool Put(Buffer& b);
  // A page-mapped buffer of `bytes` (> 0) whose first pages come from the pool, as many as it
  // holds (*recycled: how many bytes); the rest is fresh (not faulted in). kResourceExhausted
  // when mapping fails.
  StatusOr<Buffer> Get(size_t bytes, size_t* recycled);
  size_t bytes() const { return bytes_; }
  // Unmaps whatever the pool holds.
  void Clear();

 private:
  struct Region {
    char* data;
    size_t bytes;  // whole pages
  };
  std::vector<Region> regions_;
  size_t bytes_ = 0;
};

// Returns a buffer of exactly `bytes` bytes (contents undefined), or kResourceExhausted
// naming the size. Called from any thread.
using Allocator = std::function<StatusOr<Buffer>(size_t bytes)>;
// The same for a given tensor's shard (`tensor`: its index in the state): the storage that
// tensor's shards live in. ForAnyTensor(a): `a` for every tensor.
using ShardAllocator = std::function<StatusOr<Buffer>(size_t tensor, size_t bytes)>;
inline ShardAllocator ForAnyTensor(Allocator a) {
  return [a = std::move(a)](size_t, size_t bytes) { return a(bytes); };
}

// Host memory aligned to 64 bytes; buffers of 1 MiB or more are page-mapped (MapHost).
Allocator HostAllocator();
// Faults in every page of a host buffer now (MADV_POPULATE_WRITE; where the kernel lacks it,
// one write of the byte already there per page), so that the first writes into it — a copy,
// a receive — do not page-fault. Costs what those faults would (about half of it with
// MADV_POPULATE_WRITE: no trap per page), so it pays where it runs off the critical path (a
// switch's new shards, pre-allocated while the old generation trains). Contents are kept.
// kInvalidArgument for a CUDA view. Any thread.
Status PrefaultHost(BufferView view);

// cudaMalloc on `device`. Without CUDA support in this build every call returns
// kUnimplemented; without a usable GPU, kUnavailable.
Allocator CudaAllocator(int device = 0);
// Page-locked host memory (cudaHostAlloc; MemoryKind::kHost), which device copies reach by DMA
// at full PCIe speed: where a switch stages old device shards when the device cannot hold the
// change. Without CUDA in this build: HostAllocator's memory.
Allocator PinnedHostAllocator();

}  // namespace morph

#endif  // MORPH_RESHARD_BUFFER_H_
