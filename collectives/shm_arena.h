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

#include "base/status.h"
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

  ShmArena();
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

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_SHM_ARENA_H_
