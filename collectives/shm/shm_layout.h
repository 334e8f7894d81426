// The shared segment of ShmCollectives (shm_collectives.h), as every rank maps it: a header,
// one control block per rank, each rank's two collective buffers, for communicators of up to
// ShmCollectives::kP2PMaxRanks ranks a ring per ordered pair of ranks for point-to-point
// messages, and each rank's staging slots for large collectives. Private to
// shm_collectives.cc, shm_p2p.cc and shm_large.cc.
#ifndef MORPH_COLLECTIVES_SHM_LAYOUT_H_
#define MORPH_COLLECTIVES_SHM_LAYOUT_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "collectives/op_signature.h"
#include "collectives/shm/shm_collectives.h"

namespace morph {
namespace shm_layout {

constexpr uint64_t kMagic = 0x336c6c6f63687370ull;  // "pshcoll3"
// A rank's state word.
constexpr uint32_t kLive = 0;
constexpr uint32_t kLeft = 1;    // aborted or failed (Fail)
constexpr uint32_t kClosed = 2;  // communicator destroyed (Close)
// How often a sleeping waiter looks at the peers' pidfds.
constexpr auto kPollSlice = std::chrono::milliseconds(10);

// One rank's words: the first line written by its owner only, the second by whoever wakes it.
struct alignas(64) Control {
  std::atomic<uint64_t> seq;    // the last operation this rank published
  std::atomic<uint32_t> state;  // kLive, kLeft, kClosed
  int32_t pid;
  // The call behind operation k (op_signature.h), in signature[k % 2], written before k is
  // published. Rewritten at k + 2, once every peer published k + 1, which each does only after
  // it compared k's: every operation waits for every peer's publish of it.
  OpSignature signature[2];
  char pad0[16];
  std::atomic<uint32_t> waiting;   // 1 while the owner may sleep on `doorbell`
  std::atomic<uint32_t> doorbell;  // futex word: bumped to wake the owner
  // What the owner waits for while `waiting`: every peer (wait_only < 0) or peer wait_only
  // to publish wait_seq. Written before `waiting` is set.
  std::atomic<uint64_t> wait_seq;
  std::atomic<int32_t> wait_only;
  // Point-to-point: 1 while the owner may sleep on p2p_doorbell, which a peer that posted to or
  // consumed from one of its rings bumps.
  std::atomic<uint32_t> p2p_waiting;
  std::atomic<uint32_t> p2p_doorbell;
  char pad1[36];
};
static_assert(sizeof(Control) == 128);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// A point-to-point ring's counters: slots posted by its sender and consumed by its receiver.
struct alignas(64) RingHead {
  std::atomic<uint64_t> posted;
  char pad0[56];
  std::atomic<uint64_t> consumed;
  char pad1[56];
};
static_assert(sizeof(RingHead) == 128);

// A slot's header: `len` bytes of a message of `msg_bytes` from its byte `offset`; the message
// is number `index` of the `count` the sender's operation sends to this receiver.
struct SlotHead {
  uint64_t msg_bytes;
  uint64_t offset;
  uint32_t len;
  uint32_t count;
  uint32_t index;
  uint32_t pad;
};
static_assert(sizeof(SlotHead) == 32);

constexpr size_t kSlotStride = sizeof(SlotHead) + ShmCollectives::kP2PSlotBytes;
constexpr size_t kRingBytes = sizeof(RingHead) + ShmCollectives::kP2PSlots * kSlotStride;

}  // namespace shm_layout

// Header (64 bytes), Control[size], then per rank two data buffers of kSlotBytes (operation
// k in buffer k mod 2), then (size <= kP2PMaxRanks) size x size rings, ring(a, b) for a's
// messages to b, then (from a page boundary) per rank kStagingSlots staging slots of
// chunk_bytes = ChunkBytes(size) (chunk g of large collectives in slot g mod kStagingSlots).
struct ShmCollectives::Segment {
  uint64_t magic;
  int32_t size;
  uint32_t slot_bytes;
  uint32_t chunk_bytes;
  char pad[44];

  static constexpr size_t kRankBytes = 2 * kSlotBytes;

  shm_layout::Control* control(int rank) {
    return reinterpret_cast<shm_layout::Control*>(reinterpret_cast<char*>(this) + 64) + rank;
  }
  uint8_t* rank_data(int rank) {
    return reinterpret_cast<uint8_t*>(this) + 64 +
           sizeof(shm_layout::Control) * static_cast<size_t>(size) +
           static_cast<size_t>(rank) * kRankBytes;
  }
  uint8_t* data(int rank, uint64_t seq) { return rank_data(rank) + (seq & 1) * kSlotBytes; }
  static bool HasRings(int size) { return size <= kP2PMaxRanks; }
  uint8_t* ring(int from, int to) {
    return rank_data(size) + static_cast<size_t>(from * size + to) * shm_layout::kRingBytes;
  }
  static size_t StagingOffset(int size) {
    const size_t n = static_cast<size_t>(size);
    const size_t end = 64 + (sizeof(shm_layout::Control) + kRankBytes) * n +
                       (HasRings(size) ? n * n * shm_layout::kRingBytes : 0);
    return (end + 4095) & ~size_t{4095};
  }
  uint8_t* staging(int rank, uint64_t chunk) {
    return reinterpret_cast<uint8_t*>(this) + StagingOffset(size) +
           (static_cast<size_t>(rank) * kStagingSlots + chunk % kStagingSlots) * chunk_bytes;
  }
  static size_t Bytes(int size) {
    return StagingOffset(size) + static_cast<size_t>(size) * kStagingSlots * ChunkBytes(size);
  }
};
static_assert(sizeof(ShmCollectives::Segment) == 64);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_SHM_LAYOUT_H_
