#include "reshard/buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#if MORPH_WITH_CUDA
#include "base/cuda_check.h"
#endif

namespace morph {

std::string_view MemoryKindName(MemoryKind kind) {
  return kind == MemoryKind::kCuda ? "cuda" : "host";
}

Buffer Buffer::Adopt(void* data, size_t bytes, MemoryKind kind, Release release) {
  Buffer b;
  b.data_ = data;
  b.bytes_ = bytes;
  b.kind_ = kind;
  b.release_ = std::move(release);
  return b;
}

Buffer::Buffer(Buffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      kind_(o.kind_),
      release_(std::exchange(o.release_, nullptr)),
      mapped_(std::exchange(o.mapped_, false)) {}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    kind_ = o.kind_;
    release_ = std::exchange(o.release_, nullptr);
    mapped_ = std::exchange(o.mapped_, false);
  }
  return *this;
}

Buffer::~Buffer() { Reset(); }

void Buffer::Reset() {
  if (data_ != nullptr && release_) release_(data_);
  data_ = nullptr;
  bytes_ = 0;
  release_ = nullptr;
  mapped_ = false;
}

namespace {
size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
size_t RoundToPages(size_t bytes) { return (bytes + PageSize() - 1) / PageSize() * PageSize(); }
}  // namespace

StatusOr<Buffer> Buffer::MapHost(size_t bytes) {
  const size_t len = RoundToPages(bytes == 0 ? 1 : bytes);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return ResourceExhaustedError("mapping " + std::to_string(bytes) +
                                  " bytes of host memory failed: " + std::strerror(errno));
  }
  Buffer b = Adopt(p, bytes, MemoryKind::kHost, [len](void* q) { munmap(q, len); });
  b.mapped_ = true;
  return b;
}

bool PagePool::Put(Buffer& b) {
  if (!b.mapped_ || b.data_ == nullptr) return false;
  const size_t len = RoundToPages(b.bytes_ == 0 ? 1 : b.bytes_);
  regions_.push_back({static_cast<char*>(b.data_), len});
  bytes_ += len;
  b.data_ = nullptr;
  b.bytes_ = 0;
  b.release_ = nullptr;
  b.mapped_ = false;
  return true;
}

StatusOr<Buffer> PagePool::Get(size_t bytes, size_t* recycled) {
  *recycled = 0;
  MORPH_ASSIGN_OR_RETURN(Buffer b, Buffer::MapHost(bytes));
  const size_t len = RoundToPages(bytes == 0 ? 1 : bytes);
  char* to = static_cast<char*>(b.data());
  while (*recycled < len && !regions_.empty()) {
    Region& r = regions_.back();
    const size_t k = std::min(r.bytes, len - *recycled);
    // Moves the region's first k bytes; the rest of it stays mapped where it was.
    if (mremap(r.data, k, k, MREMAP_MAYMOVE | MREMAP_FIXED, to + *recycled) == MAP_FAILED) break;
    *recycled += k;
    bytes_ -= k;
    r.data += k;
    r.bytes -= k;
    if (r.bytes == 0) regions_.pop_back();
  }
  *recycled = std::min(*recycled, bytes);
  return b;
}

void PagePool::Clear() {
  for (const Region& r : regions_) munmap(r.data, r.bytes);
  regions_.clear();
  bytes_ = 0;
}

Status MovePages(Buffer& src, Buffer& dst, size_t offset) {
  const std::string what = "moving the pages of a " + std::to_string(src.size()) +
                           "-byte buffer into a " + std::to_string(dst.size()) +
                           "-byte one at offset " + std::to_string(offset);
  if (!src.page_mapped() || !dst.page_mapped()) {
    return InvalidArgumentError(what + ": both must be page-mapped host buffers");
  }
  if (src.size() == 0 || offset % PageSize() != 0 || offset + src.size() > dst.size()) {
    return InvalidArgumentError(what +
                                ": needs a non-empty source, a page-aligned offset and "
                                "room in the destination");
  }
  // offset + RoundToPages(src) <= RoundToPages(dst): the mapping moved stays inside dst's.
  const size_t len = RoundToPages(src.size());
  void* to = static_cast<char*>(dst.data()) + offset;
  void* got = mremap(src.data(), len, len, MREMAP_MAYMOVE | MREMAP_FIXED, to);
  if (got == MAP_FAILED) return InternalError(what + ": mremap: " + std::strerror(errno));
  // src's mapping is gone (mremap unmapped it): forget it without releasing it.
  src.data_ = nullptr;
  src.bytes_ = 0;
  src.release_ = nullptr;
  src.mapped_ = false;
  return Status::Ok();
}

Allocator HostAllocator() {
  return [](size_t bytes) -> StatusOr<Buffer> {
    if (bytes >= (size_t{1} << 20)) return Buffer::MapHost(bytes);
    const size_t align = bytes >= (size_t{1} << 20) ? 4096 : 64;
    // aligned_alloc wants a multiple of the alignment; a zero-byte shard still gets a pointer.
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded == 0 ? align : rounded);
    if (p == nullptr) {
      return ResourceExhaustedError("host allocation of " + std::to_string(bytes) +
                                    " bytes failed");
    }
    return Buffer::Adopt(p, bytes, MemoryKind::kHost, [](void* q) { std::free(q); });
  };
}

Status PrefaultHost(BufferView view) {
  if (view.kind != MemoryKind::kHost) {
    return InvalidArgumentError("cannot pre-fault " + std::string(MemoryKindName(view.kind)) +
                                " memory (" + std::to_string(view.bytes) + " bytes)");
  }
  if (view.bytes == 0) return Status::Ok();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(view.data);
  const uintptr_t end = begin + view.bytes;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
  // madvise wants a page-aligned start; the first page holds view.data's first byte.
  const uintptr_t aligned = begin / page * page;
  if (madvise(reinterpret_cast<void*>(aligned), end - aligned, MADV_POPULATE_WRITE) == 0) {
    return Status::Ok();
  }
  // Older kernels (EINVAL), or memory madvise cannot populate: write each page's first byte
  // back to itself (the compiler may not drop a volatile access).
  for (uintptr_t p = begin; p < end; p = (p / page + 1) * page) {
    volatile char* c = reinterpret_cast<volatile char*>(p);
    *c = *c;
  }
  return Status::Ok();
}

Allocator CudaAllocator(int device) {
#if MORPH_WITH_CUDA
  return [device](size_t bytes) -> StatusOr<Buffer> {
    MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(device)) << "selecting CUDA device " << device;
    void* p = nullptr;
    MORPH_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes == 0 ? 1 : bytes))
        << "allocating " << bytes << " bytes on CUDA device " << device;
    return Buffer::Adopt(p, bytes, MemoryKind::kCuda, [](void* q) { (void)cudaFree(q); });
  };
#else
  return [device](size_t bytes) -> StatusOr<Buffer> {
    return UnimplementedError("cannot allocate " + std::to_string(bytes) +
                              " bytes on CUDA device " + std::to_string(device) +
                              ": morph was built without CUDA");
  };
#endif
}

Allocator PinnedHostAllocator() {
#if MORPH_WITH_CUDA
  return [](size_t bytes) -> StatusOr<Buffer> {
    void* p = nullptr;
    MORPH_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocDefault))
        << "allocating " << bytes << " bytes of pinned host memory";
    return Buffer::Adopt(p, bytes, MemoryKind::kHost, [](void* q) { (void)cudaFreeHost(q); });
  };
#else
  return HostAllocator();
#endif
}

}  // namespace morph
