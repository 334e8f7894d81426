// Host storage of the package's CPU tensors (ext.h): blocks that morph adopts
// (State::AdoptTensor) and torch views without a copy (host_storage: a uint8 tensor over a
// block that keeps it alive). Any thread; no Python.
//
// Blocks of 1 MiB or more are mappings of one memfd of the process (sparse: each block gets
// a fresh range of file offsets, never reused; the pages of a range no live block maps are
// punched out), so that a shard that grows over its old range takes the old pages over
// without a copy (TensorAllocator::move_pages: mremap moves the page tables, 1 GiB in
// milliseconds), while the old block's range stays readable: it maps the same file pages,
// privately (copy-on-write). A torch view of an old shard the program kept therefore reads
// the moved elements as they are now and the rest as they were at the change, and a write
// through it lands in a private copy: it never reaches the new state and never faults
// (docs/torch.md "The API"). Pages stay allocated while any block maps them.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <nanobind/ndarray.h>

#include "ext.h"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

namespace morph_py {
namespace {

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// [offset, offset + len) of a block's address range is file bytes [file_offset, ...).
struct Segment {
  size_t offset;
  size_t len;
  size_t file_offset;
};

struct HostBlock {
  void* data = nullptr;
  size_t bytes = 0;
  size_t mapped = 0;              // the mapping's length (blocks of 1 MiB or more), else 0
  bool file_backed = false;       // a mapping of the memfd (else anonymous, or malloc's)
  std::vector<Segment> segments;  // file-backed: what backs [0, mapped), in address order
  ~HostBlock();
};

// The process's memfd and every live file-backed block (also those morph released that torch
// still views), so that a range is punched only once no block maps it.
class Arena {
 public:
  static Arena& Get() {
    static auto* arena = new Arena();  // outlives every block (never destroyed)
    return *arena;
  }
  // A fresh range of `len` file bytes mapped shared at a new address; nullptr if the memfd
  // is unavailable (then the caller maps anonymous memory).
  void* Map(size_t len, size_t* file_offset) {
    std::lock_guard<std::mutex> l(mu_);
    if (fd_ == -2) fd_ = memfd_create("morph-host-tensors", MFD_CLOEXEC);
    if (fd_ < 0) return nullptr;
    const size_t at = next_;
    if (ftruncate(fd_, static_cast<off_t>(at + len)) != 0) return nullptr;
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(at));
    if (p == MAP_FAILED) return nullptr;
    next_ = at + len;
    *file_offset = at;
    return p;
  }
  void Add(HostBlock* b) {
    std::lock_guard<std::mutex> l(mu_);
    live_.insert(b);
  }
  // `b` is going: unmaps it and punches what only it mapped.
  void Remove(HostBlock* b) {
    std::lock_guard<std::mutex> l(mu_);
    live_.erase(b);
    munmap(b->data, b->mapped);
    for (const Segment& s : b->segments) PunchUnmappedLocked(s.file_offset, s.len);
  }
  // move_pages (see the file comment). False, with nothing changed, where it cannot.
  bool Move(HostBlock& src, size_t at, size_t len, HostBlock& dst, size_t offset);

 private:
  // Frees the pages of file bytes [begin, begin + len) that no live block maps.
  void PunchUnmappedLocked(size_t begin, size_t len) {
    std::vector<std::pair<size_t, size_t>> used;  // mapped ranges within it, by anyone
    for (const HostBlock* b : live_) {
      for (const Segment& s : b->segments) {
        const size_t lo = std::max(begin, s.file_offset);
        const size_t hi = std::min(begin + len, s.file_offset + s.len);
        if (lo < hi) used.emplace_back(lo, hi);
      }
    }
    std::sort(used.begin(), used.end());
    size_t cursor = begin;
    auto punch = [&](size_t lo, size_t hi) {
      if (lo < hi) {
        (void)fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(lo),
                        static_cast<off_t>(hi - lo));
      }
    };
    for (const auto& [lo, hi] : used) {
      punch(cursor, lo);
      cursor = std::max(cursor, hi);
    }
    punch(cursor, begin + len);
  }

  std::mutex mu_;
  int fd_ = -2;  // -2: not created yet; -1: memfd_create failed
  size_t next_ = 0;
  std::set<HostBlock*> live_;
};

HostBlock::~HostBlock() {
  if (file_backed) {
    Arena::Get().Remove(this);
  } else if (mapped > 0) {
    munmap(data, mapped);
  } else {
    std::free(data);
  }
}

bool Arena::Move(HostBlock& src, size_t at, size_t len, HostBlock& dst, size_t offset) {
  std::lock_guard<std::mutex> l(mu_);
  // The range must lie in one segment of the source (one mapping: mremap moves one).
  auto seg = std::find_if(src.segments.begin(), src.segments.end(), [&](const Segment& s) {
    return s.offset <= at && at + len <= s.offset + s.len;
  });
  if (seg == src.segments.end()) return false;
  const size_t file_offset = seg->file_offset + (at - seg->offset);
  char* from = static_cast<char*>(src.data) + at;
  char* to = static_cast<char*>(dst.data) + offset;
  // The page tables move to `to` (replacing its pages there); `from` stays mapped to the same
  // file pages (shared mappings keep their range under MREMAP_DONTUNMAP, Linux 5.13), which
  // the next line turns private: old views read them, their writes stay their own.
  if (mremap(from, len, len, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to) == MAP_FAILED) {
    return false;
  }
  if (mmap(from, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd_,
           static_cast<off_t>(file_offset)) == MAP_FAILED) {
    (void)mprotect(from, len, PROT_READ);  // at least no write through an old view reaches it
  }
  // dst's segments: [offset, offset + len) now maps the source's file bytes.
  std::vector<Segment> next, replaced;
  for (const Segment& s : dst.segments) {
    const size_t lo = std::max(s.offset, offset), hi = std::min(s.offset + s.len, offset + len);
    if (lo >= hi) {
      next.push_back(s);
      continue;
    }
    if (s.offset < lo) next.push_back({s.offset, lo - s.offset, s.file_offset});
    replaced.push_back({lo, hi - lo, s.file_offset + (lo - s.offset)});
    if (hi < s.offset + s.len) {
      next.push_back({hi, s.offset + s.len - hi, s.file_offset + (hi - s.offset)});
    }
  }
  next.push_back({offset, len, file_offset});
  std::sort(next.begin(), next.end(),
            [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
  dst.segments = std::move(next);
  // The destination's own pages there (pre-faulted) are unmapped now: free them.
  for (const Segment& r : replaced) PunchUnmappedLocked(r.file_offset, r.len);
  return true;
}

class HostBlocks {
 public:
  static HostBlocks& Get() {
    static auto* blocks = new HostBlocks();  // outlives every State (never destroyed)
    return *blocks;
  }
  morph::StatusOr<morph::BufferView> Allocate(const std::string& tensor, int64_t bytes) {
    const size_t n = static_cast<size_t>(bytes > 0 ? bytes : 1);
    auto b = std::make_shared<HostBlock>();
    if (n >= (size_t{1} << 20)) {
      // A mapping of its own, as morph's HostAllocator gives (reshard/buffer.h MapHost): not
      // from malloc's arenas, whose locks and trimming the pre-allocating thread would share
      // with the training thread, and returned to the system when released.
      const size_t len = RoundUp(n, PageSize());
      // The kernel's overcommit check, as for anonymous memory: the memfd's shared pages are
      // not accounted up front, so a size no host could hold would otherwise map, and the
      // pre-faulting would bring the OOM killer instead of an error.
      void* probe = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (probe != MAP_FAILED) {
        munmap(probe, len);
        size_t file_offset = 0;
        void* p = Arena::Get().Map(len, &file_offset);
        if (p != nullptr) {
          b->data = p;
          b->file_backed = true;
          b->segments.push_back({0, len, file_offset});
        } else {
          p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          if (p != MAP_FAILED) b->data = p;
        }
        if (b->data != nullptr) b->mapped = len;
      }
    } else if (posix_memalign(&b->data, 64, RoundUp(n, 64)) != 0) {
      b->data = nullptr;
    }
    if (b->data == nullptr) {
      return morph::ResourceExhaustedError("tensor '" + tensor + "': allocating " +
                                           std::to_string(bytes) + " bytes of host memory failed");
    }
    b->bytes = n;
    if (b->file_backed) Arena::Get().Add(b.get());
    morph::BufferView v{b->data, static_cast<size_t>(bytes), morph::MemoryKind::kHost};
    std::lock_guard<std::mutex> l(mu_);
    blocks_[reinterpret_cast<uintptr_t>(b->data)] = std::move(b);
    return v;
  }
  // morph is done with the block; torch views of it keep it alive.
  void Release(const void* data) {
    std::shared_ptr<HostBlock> last;  // freed outside the lock
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(data));
    if (it == blocks_.end()) return;
    last = std::move(it->second);
    blocks_.erase(it);
  }
  // TensorAllocator::move_pages: the pages of `from` (a page-aligned part of a block, rounded
  // up to whole pages) become bytes [offset, ...) of block `to`. Both must be memfd blocks;
  // false (nothing changed) otherwise, or where the kernel cannot (before Linux 5.13).
  bool MovePages(morph::BufferView from, morph::BufferView to, size_t offset) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(from.data);
    std::shared_ptr<HostBlock> src = Containing(p);
    std::shared_ptr<HostBlock> dst = Find(reinterpret_cast<uintptr_t>(to.data));
    const size_t len = RoundUp(from.bytes, PageSize());
    if (!src || !dst || !src->file_backed || !dst->file_backed || len == 0 ||
        p % PageSize() != 0 || offset % PageSize() != 0 ||
        p + len > reinterpret_cast<uintptr_t>(src->data) + src->mapped ||
        offset + len > dst->mapped || src == dst) {
      return false;
    }
    return Arena::Get().Move(*src, p - reinterpret_cast<uintptr_t>(src->data), len, *dst, offset);
  }
  // The block whose range holds address `p`.
  std::shared_ptr<HostBlock> Containing(uintptr_t p) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) return nullptr;
    --it;
    const HostBlock& b = *it->second;
    const size_t span = b.mapped > 0 ? b.mapped : b.bytes;
    return p < it->first + span ? it->second : nullptr;
  }
  std::shared_ptr<HostBlock> Find(uintptr_t data) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.find(data);
    return it == blocks_.end() ? nullptr : it->second;
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, std::shared_ptr<HostBlock>> blocks_;  // morph's, by address
};

}  // namespace

morph::TensorAllocator HostTensorAllocator(const std::string& tensor) {
  morph::TensorAllocator a;
  a.allocate = [tensor](int64_t bytes) { return HostBlocks::Get().Allocate(tensor, bytes); };
  a.release = [](morph::BufferView v) { HostBlocks::Get().Release(v.data); };
  a.move_pages = [](morph::BufferView from, morph::BufferView to, size_t offset) {
    return HostBlocks::Get().MovePages(from, to, offset);
  };
  a.any_thread = true;
  return a;
}

void BindHostStorage(nb::module_& m) {
  using namespace nb::literals;
  m.def("host_storage", [](uintptr_t data, size_t bytes) {
    std::shared_ptr<HostBlock> b = HostBlocks::Get().Find(data);
    if (b == nullptr || bytes > b->bytes) {
      Fail(morph::NotFoundError("no host block of " + std::to_string(bytes) + " bytes at " +
                                std::to_string(data)));
    }
    auto* keep = new std::shared_ptr<HostBlock>(std::move(b));
    nb::capsule owner(keep, [](void* p) noexcept {
      delete static_cast<std::shared_ptr<HostBlock>*>(p);
    });
    size_t shape[1] = {bytes};
    return nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>, nb::device::cpu>(
        reinterpret_cast<uint8_t*>(data), 1, shape, owner);
  }, "data_ptr"_a, "bytes"_a,
  "A torch uint8 tensor over `bytes` bytes of the host block at data_ptr (a host tensor's "
  "shard), keeping the block alive while torch holds it.");
}

}  // namespace morph_py
