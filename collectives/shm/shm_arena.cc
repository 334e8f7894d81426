#include "collectives/shm/shm_arena.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "collectives/shm/shm_support.h"

namespace morph {

namespace {

using shm_support::kHugePage;
#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;
#endif
#ifndef MADV_COLLAPSE
constexpr int MADV_COLLAPSE = 25;
#endif

}  // namespace

struct ShmArena::Impl {
  Options options;
  mutable std::mutex mu;
  std::map<uint64_t, Segment> by_base;  // guarded by mu
  std::map<uint64_t, uint64_t> huge;    // base -> bytes collapsed; guarded by mu

  static StatusOr<Buffer> Allocate(const std::shared_ptr<Impl>& self, size_t bytes) {
    if (bytes == 0) return Buffer();
    auto fail = [&](const char* what) {
      return ResourceExhaustedError("shared host memory: " + std::string(what) + " of " +
                                    std::to_string(bytes) +
                                    " bytes failed: " + std::strerror(errno));
    };
    const int fd = memfd_create("morph-shard", MFD_CLOEXEC);
    if (fd < 0) return fail("memfd_create");
    // Huge segments span whole 2 MiB pages (the tail past `bytes` is never handed out).
    const bool huge = self->options.huge_pages && bytes >= kHugePage;
    const size_t size = huge ? (bytes + kHugePage - 1) / kHugePage * kHugePage : bytes;
    struct stat st {};
    if (ftruncate(fd, static_cast<off_t>(size)) != 0 || fstat(fd, &st) != 0) {
      Status s = fail("ftruncate");
      close(fd);
      return s;
    }
    void* p = huge ? shm_support::MapHugeAligned(fd, size, PROT_READ | PROT_WRITE)
                   : mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      Status s = fail("mmap");
      close(fd);
      return s;
    }
    // Huge pages where the host allows them for shared memory
    // (/sys/kernel/mm/transparent_hugepage/shmem_enabled = advise): 512x fewer faults for this
    // process and for every receiver that maps the segment. A no-op elsewhere.
    if (bytes >= kHugePage) (void)madvise(p, size, MADV_HUGEPAGE);
    // Options::huge_pages: whatever the host's setting, populate (zeroed 4 KiB pages) and
    // collapse them into 2 MiB pages now. Best effort: a refusal leaves 4 KiB pages.
    uint64_t collapsed = 0;
    if (huge && madvise(p, size, MADV_POPULATE_WRITE) == 0 &&
        madvise(p, size, MADV_COLLAPSE) == 0) {
      collapsed = size;
    }
    const Segment seg{fd, static_cast<uint64_t>(st.st_ino), reinterpret_cast<uint64_t>(p),
                      static_cast<uint64_t>(bytes)};
    {
      std::lock_guard<std::mutex> lock(self->mu);
      self->by_base[seg.base] = seg;
      if (collapsed > 0) self->huge[seg.base] = collapsed;
    }
    return Buffer::Adopt(p, bytes, MemoryKind::kHost, [self, seg, size](void* data) {
      {
        std::lock_guard<std::mutex> lock(self->mu);
        self->by_base.erase(seg.base);
        self->huge.erase(seg.base);
      }
      munmap(data, size);
      close(seg.fd);
    });
  }
};

ShmArena::ShmArena() : impl_(std::make_shared<Impl>()) {}
ShmArena::ShmArena(Options options) : impl_(std::make_shared<Impl>()) { impl_->options = options; }
ShmArena::~ShmArena() = default;

StatusOr<Buffer> ShmArena::Allocate(size_t bytes) { return Impl::Allocate(impl_, bytes); }

Allocator ShmArena::allocator() {
  return [impl = impl_](size_t bytes) { return Impl::Allocate(impl, bytes); };
}

std::optional<ShmArena::Segment> ShmArena::Find(const void* p) const {
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->by_base.upper_bound(a);
  if (it == impl_->by_base.begin()) return std::nullopt;
  --it;
  if (a >= it->second.base + it->second.size) return std::nullopt;
  return it->second;
}

size_t ShmArena::num_segments() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->by_base.size();
}

uint64_t ShmArena::huge_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  uint64_t n = 0;
  for (const auto& [base, bytes] : impl_->huge) n += bytes;
  return n;
}

}  // namespace morph
