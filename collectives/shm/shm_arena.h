// ShmArena: host memory for tensor shards that same-host peers can map, so that the shared-memory
// path of CommTransport (shm_channel.h) moves a message with one plain memcpy from the sender's
// buffer instead of process_vm_readv (which pins every 4 KiB page of both sides per call and runs
// at 0.3-0.45 of memcpy on the VMs we measure; docs/reshard-executor.md "Between processes").
//
// Each buffer is its own memfd, mapped MAP_SHARED here. When this process sends a message out of
// such a buffer, the descriptor names the memfd (fd number and inode); the receiver takes a
// duplicate with pidfd_getfd (same permission as process_vm_readv), maps it read-only for the
// duration of its Wait, and copies. A buffer that is not from an arena still travels by
// process_vm_readv, so an arena is an optimisation and never needed for correctness.
//
//   ShmArena arena;                                   // owned by the runtime / the program
//   Allocator alloc = arena.allocator();              // used for host shards
//   MORPH_ASSIGN_OR_RETURN(Buffer b, alloc(256 << 20));
//   CommTransportOptions o{.arena = &arena};          // the transport looks buffers up in it
//
// Lifetime: buffers keep the arena's bookkeeping alive (shared), so they may outlive the ShmArena
// object; a segment is unmapped and its fd closed when its Buffer dies. A receiver that still has
// it mapped keeps the pages until it unmaps them (at the end of its Wait), never longer.
//
// Thread-safety: every member is callable from any thread.
#ifndef MORPH_COLLECTIVES_SHM_ARENA_H_
#define MORPH_COLLECTIVES_SHM_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "morph/status.h"
#include "reshard/buffer.h"

namespace morph {

class ShmArena {
 public:
  // Where a buffer of this arena lies: its memfd (in this process), the memfd's inode (so a
  // receiver can tell a reused fd number), the mapping's address and size.
  struct Segment {
    int fd = -1;
    uint64_t inode = 0;
    uint64_t base = 0;
    uint64_t size = 0;
  };

  struct Options {
    // Back each segment of at least 2 MiB with 2 MiB pages whatever the host's shared-memory
    // THP setting: the pages are populated and collapsed (MADV_POPULATE_WRITE, MADV_COLLAPSE,
    // Linux >= 6.1) when the segment is allocated, so that a receiver that maps it sets up 512x
    // fewer page-table entries (mapping 4 KiB pages costs about what copying them does on our
    // VMs) and freeing it is cheap. Allocate then costs what populating the memory does, more
    // where huge pages need compaction; where the kernel refuses the collapse the segment keeps
    // its 4 KiB pages (huge_bytes() says what was collapsed).
    bool huge_pages = false;
  };

  ShmArena();
  explicit ShmArena(Options options);
  ~ShmArena();
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // A memfd-backed buffer of exactly `bytes` (contents zero, pages not yet faulted). 0 bytes: an
  // empty buffer. kResourceExhausted naming the size when memfd_create, ftruncate or mmap fail
  // (with the errno text).
  StatusOr<Buffer> Allocate(size_t bytes);
  // Allocate as an Allocator (reshard/buffer.h); the arena's bookkeeping lives as long as the
  // returned function or any buffer it made.
  Allocator allocator();

  // The live segment that contains address `p`, if any.
  std::optional<Segment> Find(const void* p) const;

  // Number of live segments (tests).
  size_t num_segments() const;
  // Bytes of live segments backed by 2 MiB pages (Options::huge_pages).
  uint64_t huge_bytes() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_SHM_ARENA_H_
