// ShmCollectives: the same-host fast path of the Gloo communicator (gloo_communicator.h). Over
// TCP every small collective costs several thread hand-offs (Gloo's event thread, ~1 ms each on
// a loaded host) and a large one copies through the loopback stack; Open MPI busy-polls shared
// memory. When every rank of a communicator is on this host, allreduce, reduce-scatter,
// broadcast, allgather and barrier go through one shared segment instead: each rank copies its
// contribution into its own slot, publishes the operation's sequence number, waits until every
// peer published it, and reads the others' slots. Operations beyond the 64 KiB slots go the
// same way chunk by chunk through staging slots, a chunk per wait, each rank reducing its
// 1/n of every chunk (shm_large.cc). Reductions run in rank order with the same function as
// the TCP one-round algorithms (gloo_algorithms::ReduceInRankOrder), so every rank gets the
// same bits, at every size, and up to 64 KiB the same bits as over TCP. docs/collectives.md,
// "Same-host shared memory".
//
//   MORPH_ASSIGN_OR_RETURN(auto shm, ShmCollectives::Create(rank, size, options, what,
//                                                           tcp_allgather, &why_not));
//   if (shm != nullptr && shm->Handles(op)) return shm->Run(op, workspace, "allreduce");
//
// Slots are double-buffered by the sequence number's parity: a rank rewrites the buffer of
// operation k only at k + 2, after every peer published k + 1, which each does only once it
// has read everything of k. So one wait per operation, no acknowledgements. Every rank of
// every operation (a broadcast's root too) waits for every peer's publish of it, and then
// compares the calls each published with it (op_signature.h): ranks whose calls differ all get
// kInvalidArgument before any byte is read. (An earlier root returned before its receivers
// arrived, MPI's eager broadcast; it could not learn that they disagreed.) A root that returned
// from a broadcast has handed its data over: a peer still reads it after the root failed,
// closed or exited.
//
// Waiting: a bounded spin (Options::spin, _mm_pause), a bounded poll between sched_yield()
// calls (Options::yield), then futex waits on this rank's doorbell
// word, which a publisher rings only when the waiter said it sleeps and what it waits for is
// then complete (one wake-up per sleep, not one per peer's publish); every 10 ms a sleeping
// waiter also polls the peers' pidfds. An oversubscribed host (more ranks than cores) spends at
// most the spin per operation busy. A publisher takes the `waiting` flag when it rings, so a
// sleeper is rung once.
//
// Failures (the communicator contract, communicator.h): Fail() (Abort, or any error of the
// communicator; any thread) sets this rank's state word and rings every doorbell, so its own
// waiter returns kAborted within microseconds and peers waiting for it return kUnavailable
// naming it. A peer that exited (pidfd) gives kUnavailable naming it, preferred over a peer
// that merely failed in reaction; the timeout gives kDeadlineExceeded naming the ranks that did
// not arrive in the message (failed_peers empty, as over TCP). Close() (communicator destroyed)
// lets peers still waiting for this rank fail the same way, at once.
//
// The segment (/dev/shm/morph-coll-<pid>-<random>, created by rank 0) is unlinked as soon as
// every rank opened it, at the end of Create; only a rank 0 killed inside Create leaves it.
// Internal to collectives/ (not installed).
//
// Thread-safety: Run by one thread at a time (the communicator's op thread or its owner);
// Fail() and Close() from any thread.
#ifndef MORPH_COLLECTIVES_SHM_COLLECTIVES_H_
#define MORPH_COLLECTIVES_SHM_COLLECTIVES_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "morph/status.h"
#include "collectives/communicator.h"
#include "collectives/gloo/gloo_algorithms.h"
#include "collectives/op_signature.h"

namespace morph {

class ShmCollectives {
 public:
  // The largest contribution of one rank to one operation: the allreduce or broadcast buffer,
  // one rank's allgather input, the whole reduce-scatter input.
  static constexpr size_t kSlotBytes = size_t{64} << 10;
  // Larger collectives go through per-rank staging slots, a chunk of ChunkBytes(size) per rank
  // at a time (RunLarge): kStagingSlots slots per rank, chunk g in slot g mod kStagingSlots.
  // kStagingBytes / size per rank (256 KiB at 2 ranks, 128 KiB at 4; at least kMinChunkBytes),
  // so that the chunks of all ranks stay in the caches: 1.5 MiB of staging per communicator of
  // up to 8 ranks, 192 KiB per rank beyond. Communicators of more than kLargeMaxRanks ranks
  // run large collectives over TCP.
  static constexpr size_t kStagingBytes = size_t{512} << 10;
  static constexpr size_t kMinChunkBytes = size_t{64} << 10;
  static constexpr size_t kStagingSlots = 3;
  static constexpr int kLargeMaxRanks = 256;
  static size_t ChunkBytes(int size) {
    return std::max(kMinChunkBytes, kStagingBytes / static_cast<size_t>(size) & ~size_t{4095});
  }
  // Point-to-point through the segment (SendRecv) for communicators of up to kP2PMaxRanks
  // ranks: a ring of kP2PSlots slots of kP2PSlotBytes per ordered pair (128 KiB each; 2 MiB
  // for 4 ranks, 8 MiB for 8); larger communicators send over TCP.
  static constexpr int kP2PMaxRanks = 8;
  static constexpr size_t kP2PSlots = 4;
  static constexpr size_t kP2PSlotBytes = size_t{32} << 10;

  struct Options {
    bool enable = true;
    // How long a wait busy-polls before it sleeps on the futex. Negative: 20 us when this
    // process may run on at least as many CPUs as the communicator has ranks, else 0 (spinning
    // on an oversubscribed host takes the core a late peer needs: measured 5x slower).
    std::chrono::microseconds spin{-1};
    // Then how long it polls with a sched_yield() between looks before it sleeps. On an
    // oversubscribed host the yield hands the core to a peer this rank waits for; a sleep
    // costs a futex wake-up and a scheduler hand-off at every operation (4 ranks on 2 cores,
    // 8 B allreduce: 21-23 us without, 5-7 us with 50 us, load 4). Where nothing else is
    // runnable it busy-polls; 0: none.
    std::chrono::microseconds yield{50};
  };

  // An allgather of `bytes` per rank over the communicator's TCP path (used twice).
  using Allgather = std::function<Status(const void* send, void* recv, size_t bytes)>;

  // Collective over the communicator's `size` ranks (every rank calls it, with its own
  // options): exchanges host identities and `enable` (one allgather), then, when every rank is
  // on this host and enabled, maps rank 0's segment and agrees that all did (a second one).
  // Returns null, with the reason in `*why_not`, when any rank cannot use it (another host,
  // disabled on some rank, shm_open/mmap/pidfd failed); the decision is the same on every
  // rank. Errors: the allgather's only. `what` (the communicator's name) prefixes messages.
  static StatusOr<std::unique_ptr<ShmCollectives>> Create(int rank, int size,
                                                          const Options& options,
                                                          const std::string& what,
                                                          const Allgather& allgather,
                                                          std::string* why_not);
  ~ShmCollectives();
  ShmCollectives(const ShmCollectives&) = delete;
  ShmCollectives& operator=(const ShmCollectives&) = delete;

  // Whether `op` takes this path: barrier; allreduce, broadcast, allgather and reduce-scatter
  // of at least one element (those beyond the per-rank buffers, Fits(), in chunks through the
  // staging slots, for up to kLargeMaxRanks ranks). Depends only on what every rank passes
  // alike, so all ranks agree. Any thread.
  bool Handles(const CollectiveOp& op) const;

  // Runs `op` (Handles(op) must be true; arguments validated by the caller). OK; kAborted
  // after Fail(); kUnavailable naming the peer that exited or failed; kDeadlineExceeded at
  // op.timeout. Each error carries its CollectiveFailure; after one, the caller must call
  // Fail() (the communicator does). `kind` names the operation in messages ("allreduce").
  // Every rank compares the ranks' calls (op_signature.h) once all published the operation, the
  // root of a broadcast too (so it waits for the receivers to arrive): ranks whose calls differ
  // all get kInvalidArgument and nothing is read.
  Status Run(const CollectiveOp& op, gloo_algorithms::Workspace& workspace, std::string_view kind);
  // For an operation this path does not take (no elements, or beyond the per-rank buffers on
  // more than kLargeMaxRanks ranks): an operation of its own that only
  // compares the ranks' calls, before the caller runs it over TCP. Ranks that took Run for
  // their call and ranks that took Agree for theirs meet in the same operation and fail alike.
  Status Agree(const CollectiveOp& op, std::string_view kind);

  // Whether SendRecv takes this path (the communicator has at most kP2PMaxRanks ranks).
  bool HandlesP2P() const { return size_ <= kP2PMaxRanks; }
  // A group of sends and receives (CollectiveOp::SendRecv) through the pair rings, progressing
  // together; a send completes once its bytes are in the ring (eager: the contract's buffer
  // rule holds, the bytes having been copied). Between a pair the i-th send matches the i-th
  // receive, across operations too (one FIFO ring per ordered pair). Each slot names its
  // message's size and its place among the operation's messages to that receiver, which the
  // receiver checks against its own before copying anything out: kInternal naming the peer for
  // other sizes or counts (as over TCP). kAborted after Fail(); kUnavailable naming a peer
  // that exited or failed while this rank still needs it (what it had posted is still read);
  // kDeadlineExceeded at op.timeout naming the peers waited for.
  Status SendRecv(const CollectiveOp& op);

  // This rank leaves for good: its waits, now and later, return kAborted; peers waiting for it
  // fail. Idempotent. Any thread.
  void Fail();
  // The communicator is being destroyed: peers waiting for an operation this rank will never
  // publish fail (kUnavailable naming it) rather than time out. Any thread.
  void Close();

  struct Segment;  // the shared layout (shm_collectives.cc)

 private:
  ShmCollectives() = default;
  // Whether `op` fits the per-rank buffers (one round): barrier; allreduce and broadcast of up
  // to kSlotBytes bytes; allgather of up to kSlotBytes per rank; reduce-scatter of up to
  // kSlotBytes of input.
  bool Fits(const CollectiveOp& op) const;
  // Run for an operation that does not fit (shm_large.cc): chunk by chunk through the staging
  // slots, one wait for every peer per chunk, the same failures as Run.
  Status RunLarge(const CollectiveOp& op, gloo_algorithms::Workspace& workspace,
                  std::string_view kind);
  // One more operation number, published, and the wait for every peer to publish it.
  Status Step(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout,
              std::string_view kind);
  // Waits until every peer (`only` < 0) or peer `only` published `seq`, up to `deadline`
  // (the op's `timeout` after its start).
  Status WaitForPeers(uint64_t seq, int only, std::chrono::steady_clock::time_point deadline,
                      std::chrono::milliseconds timeout, std::string_view kind);
  // kInvalidArgument naming the first peer whose call for operation `k` differs from `mine`.
  Status Compare(uint64_t k, const OpSignature& mine, std::string_view kind) const;
  // Whether every peer (`only` < 0) or peer `only` published `seq`.
  bool Published(uint64_t seq, int only) const;
  // The error for such a wait that cannot finish because a peer exited or left, or OK.
  Status PeerFailure(uint64_t seq, int only, std::string_view kind) const;
  void Publish(uint64_t seq);
  void SetState(uint32_t state);
  // SendRecv's wait for room or data from `peers` (shm_p2p.cc): spin, yield, then sleep on this
  // rank's p2p doorbell; `can_progress` is checked after the waiting flag is set.
  Status WaitP2P(const std::vector<int>& peers, const std::function<bool()>& can_progress,
                 std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout);
  // Wakes `peer` if it sleeps in WaitP2P.
  void WakeP2P(int peer);
  uint8_t* Data(int rank, uint64_t seq) const;

  int rank_ = 0;
  int size_ = 0;
  std::string what_;
  std::chrono::microseconds spin_{0};
  std::chrono::microseconds yield_{0};
  Segment* segment_ = nullptr;
  size_t segment_bytes_ = 0;
  std::vector<int> pidfds_;  // per rank; -1 for this rank and ranks in this process
  std::vector<pid_t> pids_;
  uint64_t seq_ = 0;  // operations run here (Run's thread only)
  uint64_t chunk_ = 0;  // chunks of large operations staged here (Run's thread only)
  std::atomic<bool> failed_{false};
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_SHM_COLLECTIVES_H_
