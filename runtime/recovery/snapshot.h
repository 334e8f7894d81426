// In-memory buddy snapshots (Gemini, SOSP'23): every `every` steps each rank copies its shards
// and scalars into host memory and sends the copy to its buddy — a rank on another host when
// there is one — while it receives the copy of the rank it is the buddy of (its ward). A dead
// worker's pieces can then be served from its buddy's memory at the snapshot step, with every
// survivor rolled back to the same step from its own local copy (docs/design.md "Recovery
// redundancy, as built").
//
//   BuddySnapshotter snap(opts.snapshot_every);            // lives as long as the worker
//   // each generation, collectively over its world (own communicators from its store):
//   MORPH_RETURN_IF_ERROR(snap.StartGeneration(store_g, {.generation = g, .rank = r,
//                                              .hosts = host_of_rank}, deadline));
//   // training thread, each step:
//   MORPH_RETURN_IF_ERROR(snap.MaybeBegin(step, state));   // start of the step
//   ... forward / backward (the state is only read) ...
//   MORPH_RETURN_IF_ERROR(snap.WaitCopied(deadline));     // BeginUpdate: before it changes
//   ... optimizer update ...
//   // recovery: snap.EndGeneration(); then snap.Local(s) / snap.Held(s) serve pieces.
//
// Buddies (BuddyRanks): the ranks listed host by host (hosts in order of first appearance,
// ranks in rank order within a host), rotated by the largest host's rank count m (by 1 when
// every rank is on one host): rank L[j]'s buddy is L[(j + m) % n]. With equal hosts that is the
// rank at the same position on the next host; it is a rotation, so every rank holds exactly one
// other rank's copy. A world of 1 has no buddy (local copies only).
//
// A round: the local copy (one memcpy pass; the only part the training thread waits for, at
// BeginUpdate), then on the background thread the exchange: header, description, the payload
// in pipelined groups of messages (the CRC32C of what goes out and of what came in computed
// while the next group moves), and a trailer with the sender's CRC32C.
//
// What the buddy gets (BuddyCopiedTensors): the local copy holds every shard, but only the
// shards with no other copy at the same step in another failure domain go to the buddy — a
// piece replicated elsewhere (a parameter over DP, an unsplit tensor over TP, a tied tensor
// over its stages, a hybrid ZeRO range over its groups) is in that replica's own local copy of
// the same step. A failure domain is a host when the world spans several hosts (so the loss
// of a whole host keeps every piece: its replicated pieces have a copy on another host, the
// others are at its ranks' buddies), a process on a single host. The held copy lists the other
// tensors with an empty shard (SnapshotData::shards); a recovery takes their pieces from the
// survivors' local copies (runtime/plan/snapshot_plan.h). With ZeRO-1 over dp ranks a round
// moves a rank's moments only: 1/3 of its 1 GiB-model state instead of all of it.
//
// Completeness. A local copy counts once it is fully copied (WaitCopied); a held copy once all
// its bytes and the trailer arrived and the payload's CRC32C equals the sender's. Each side is
// double-buffered: the newest complete local and held copies stay intact while the next ones
// are made, so a rank that dies mid-transfer leaves its buddy's previous held copy (held_step
// unchanged) and every survivor's previous local copy of the same step. Memory: 2 x this rank's
// state bytes (two local copies) + 2 x the ward's buddy-copied bytes (two held copies), host
// memory allocated once and reused (a buffer that must grow, after a change of layout, keeps
// its pages: only the growth is faulted in); memory_bytes() says how much.
//
// Threads: StartGeneration, EndGeneration, MaybeBegin, WaitCopied, WaitExchanged and the
// accessors are called by one thread (the training thread), Abort by any; one background
// thread per round copies and exchanges. A SnapshotData pointer stays valid until the next
// MaybeBegin.
#ifndef MORPH_RUNTIME_RECOVERY_SNAPSHOT_H_
#define MORPH_RUNTIME_RECOVERY_SNAPSHOT_H_

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "morph/deadline.h"
#include "base/logging.h"
#include "morph/parallel_config.h"
#include "morph/status.h"
#include "collectives/communicator.h"
#include "collectives/store/store.h"
#include "reshard/buffer.h"
#include "runtime/state/state.h"

namespace morph {

class GlooDevice;

// buddy[r] for every rank r of a world whose rank r runs on host_of_rank[r] (rule above);
// empty for an empty world, {0} for a world of one (no buddy: itself). Pure; any thread.
std::vector<int> BuddyRanks(std::span<const std::string> host_of_rank);

// For each of `tensors`, whether rank `rank`'s shard of it goes to its buddy under `config`
// (rule "What the buddy gets" above): false when the rank holds no piece of it (another stage)
// or when another rank in another failure domain holds the same piece. Every tensor when
// host_of_rank is not one host per rank of the config. Pure; any thread. Cost: per distinct
// replication pattern (stages, TP split, ZeRO group), at most the replicas of one piece.
std::vector<bool> BuddyCopiedTensors(std::span<const TensorSpec> tensors,
                                     const ParallelConfig& config, int rank,
                                     std::span<const std::string> host_of_rank);

// One rank's state at one step, in host memory: what the recovery serves pieces from.
struct SnapshotData {
  int64_t generation = -1;  // of the snapshot
  int64_t step = -1;        // the state at the start of this step
  int rank = -1;            // whose state, numbered in `generation`
  ParallelConfig config;    // its layout
  // By tensor index (registration order). A held copy lists the tensors its ward did not
  // send (BuddyCopiedTensors) with an empty shard; a local copy holds every shard.
  std::vector<Shard> shards;
  // The shards' bytes (host; empty when none), and the scalars' by scalar index.
  std::vector<ConstBufferView> tensors;
  std::vector<std::span<const std::byte>> scalars;
  // The copy's bytes (tensors + scalars, aligned); of a local copy, what goes to the buddy:
  // [sent_offset, sent_offset + sent_bytes).
  int64_t bytes = 0;
  int64_t sent_offset = 0;
  int64_t sent_bytes = 0;
  // CRC32C of what went to the buddy / came from the ward (0: nothing sent).
  uint32_t crc32c = 0;
};

// Copies `snap` back into `state` (a rollback in place): every shard's bytes (host or CUDA
// storage) and every scalar. kFailedPrecondition naming the first difference when the state
// is not laid out as the snapshot was (config, rank, a tensor's shard, a scalar's size, the
// tensor or scalar count). Training thread (it writes the state).
Status RestoreFromSnapshot(const SnapshotData& snap, StateStore& state);

// One generation's view of the job, for StartGeneration.
struct SnapshotGeneration {
  int64_t generation = 0;
  int rank = 0;                    // in [0, hosts.size())
  std::vector<std::string> hosts;  // host of each rank of the generation's world
};

struct BuddySnapshotOptions {
  // The device Gloo listens on (null: one made from the default GlooOptions, loopback);
  // multi-host jobs pass the data plane's.
  std::shared_ptr<GlooDevice> device;
  // Bound of each transfer operation (a chunk) and of MaybeBegin's wait for the previous round.
  std::chrono::milliseconds timeout{300000};
  // Bytes per message of the payload. Messages move in groups of chunks_per_group, posted at
  // once; the next group is queued before the previous one is waited for, so up to
  // 2 x chunks_per_group messages are in flight and no handshake stalls the wire. The old
  // exchange (one 16 MiB message at a time, then a wait) ran at 0.15-0.19 GB/s on a loaded
  // 2-core VM; docs/performance.md "Recovery redundancy" has today's rates.
  size_t chunk_bytes = size_t{32} << 20;
  size_t chunks_per_group = 2;
  // Test hook: called on the background thread after each chunk this rank sent, with the step
  // and the bytes sent so far (fault tests kill the process from it).
  std::function<void(int64_t step, int64_t sent)> after_chunk_sent;
  // Test hook: called on the background thread after each chunk (32 MiB) of the local copy.
  std::function<void(int64_t step)> after_chunk_copied;
};

class BuddySnapshotter {
 public:
  // Snapshots every `every` steps (every <= 0: never; MaybeBegin does nothing).
  explicit BuddySnapshotter(int64_t every, BuddySnapshotOptions options = {});
  // EndGeneration().
  ~BuddySnapshotter();
  BuddySnapshotter(const BuddySnapshotter&) = delete;
  BuddySnapshotter& operator=(const BuddySnapshotter&) = delete;

  bool enabled() const { return every_ > 0; }
  bool Due(int64_t step) const { return enabled() && step >= 0 && step % every_ == 0; }

  // Collective over the generation's world (every rank calls it with the same generation and
  // hosts): builds this rank's communicators with its buddy and its ward through `store`
  // (Gloo, names "snapshot/<a>-<b>", none of the training thread's). Ends the previous
  // generation first (EndGeneration); snapshots taken before stay readable. OK without any
  // communicator when snapshots are disabled or the world is 1. kInvalidArgument: rank
  // outside [0, hosts.size()), an empty host name; the communicators' errors naming the peer
  // (kDeadlineExceeded at `deadline`, kAborted for a stale store generation).
  Status StartGeneration(Store& store, const SnapshotGeneration& generation, Deadline deadline);
  // Aborts a round in flight (its local copy, if still copying, and its held copy stay
  // incomplete: the previous ones are kept), joins the background thread and drops the
  // communicators. Idempotent.
  void EndGeneration();
  // Any thread (the runtime's control thread on a failure): makes a round in flight fail at
  // once with kAborted instead of waiting on a dead peer, so the training thread blocked in
  // MaybeBegin, WaitCopied or WaitExchanged reaches its step boundary: a local copy still
  // running stops within one 32 MiB chunk (incomplete; WaitCopied says kAborted), an exchange
  // at once. Copies already complete stay, and which are complete does not change after
  // Abort returns (LocalSteps / HeldSteps may be read at once, without waiting for the round
  // to unwind); the generation's snapshots are broken until the next StartGeneration. Nothing
  // when idle.
  void Abort();

  // At the start of step `step` (training thread): when Due(step), waits for the previous
  // round to end (up to the options' timeout), then starts a round in the background: copy
  // this rank's shards and scalars into a host buffer (the caller must not change the state
  // until WaitCopied returns), then send it to the buddy while receiving the ward's copy.
  // Every rank of the generation must call it for the same steps. OK when not due.
  // kFailedPrecondition: no generation started, or the state not laid out for a rank (standby)
  // or not intact; kDeadlineExceeded: the previous round still running; the previous round's
  // error (e.g. kUnavailable naming the peer that died: the generation's snapshots are then
  // broken and every later call returns it until the next StartGeneration); kResourceExhausted
  // when a buffer cannot be allocated.
  Status MaybeBegin(int64_t step, const StateStore& state);
  // After a recovery restored `state` from this rank's local copy of (step, generation): the
  // tensors marked in `tensors` hold exactly that copy's bytes (same shard) and will not change
  // before the next MaybeBegin. If that MaybeBegin is of the same step, it writes into that
  // copy's buffer and leaves those tensors as they are when their offset is unchanged (the
  // tensors that stay here come first in a copy, so a change that keeps them keeps their
  // offsets): the first snapshot after a rollback copies only what the change moved. Only the
  // next MaybeBegin reads the note. Training thread.
  void NoteRestored(int64_t step, int64_t generation, std::vector<bool> tensors);

  // Blocks until the running round's local copy is done (OK at once when none runs): its
  // error (kInternal: a CUDA copy failed), kDeadlineExceeded at `deadline`.
  Status WaitCopied(Deadline deadline);
  // Blocks until the running round's exchange ended: OK (held copy complete), its error
  // naming the peer (kUnavailable / kAborted / kDeadlineExceeded; kDataLoss for a checksum
  // mismatch), kDeadlineExceeded if still running at `deadline` (may be called again).
  Status WaitExchanged(Deadline deadline);

  // The rank this one sends to / receives from in the current generation (-1: none).
  int buddy() const { return buddy_; }
  int ward() const { return ward_; }
  // Steps of the newest complete local / held copy (-1: none yet), and whose held copy it is
  // (a rank of held_generation()).
  int64_t local_step() const;
  int64_t held_step() const;
  int held_rank() const;
  int64_t held_generation() const;
  // Steps of the complete local / held copies of generation `generation` (at most two each),
  // newest first: what a recovery report says this rank can serve.
  std::vector<int64_t> LocalSteps(int64_t generation) const;
  std::vector<int64_t> HeldSteps(int64_t generation) const;
  // The tensors (indices, ascending) whose ward's shard every complete held copy of
  // `generation` holds: what a recovery may take from them (SnapshotHoldings::held_tensors).
  std::vector<int64_t> HeldTensors(int64_t generation) const;
  // The complete local / held copy of `step` (taken in `generation`; -1: any), or null when not
  // held (either buffer: the newest or the one before it). Valid until the next MaybeBegin or
  // StartGeneration.
  const SnapshotData* Local(int64_t step, int64_t generation = -1) const;
  const SnapshotData* Held(int64_t step, int64_t generation = -1) const;
  // Host bytes held in snapshot buffers (two local, two held).
  int64_t memory_bytes() const;
  // Bytes the newest round's local copy copied from the state (what NoteRestored spared is
  // not counted).
  int64_t copied_bytes() const;

 private:
  struct Slot {
    Buffer buffer;
    SnapshotData data;
    bool complete = false;
  };
  struct Source {  // what the copy reads
    ConstBufferView view;
    size_t offset = 0;
    bool in_place = false;  // the slot holds these bytes there already (NoteRestored)
  };
  struct Restored {  // NoteRestored's note
    int64_t step = -1;
    int64_t generation = -1;
    std::vector<bool> tensors;
  };
  struct Peer;  // a communicator with the buddy and/or the ward

  // "snapshot/<lower rank>-<higher rank>": a pair communicator's name (snapshot_exchange.cc
  // names failed peers by it).
  static std::string PairName(int a, int b);

  void Round(int64_t step, int64_t generation, std::vector<Source> sources, size_t slot,
             std::vector<bool> sent);
  Status EnsureSize(Buffer& buffer, size_t bytes);
  Status Copy(std::vector<Source>& sources, Slot& slot);
  Status Exchange(int64_t step, int64_t generation, Slot& local, size_t held_slot,
                  const std::vector<bool>& sent);  // snapshot_exchange.cc
  void JoinRound();

  int64_t every_;
  BuddySnapshotOptions options_;
  LogContext log_{"snapshot"};
  // Current generation.
  int64_t generation_ = -1;
  int rank_ = -1;
  int buddy_ = -1;
  int ward_ = -1;
  std::vector<std::string> hosts_;
  Restored restored_;
  std::unique_ptr<Communicator> to_buddy_;   // null when none
  std::unique_ptr<Communicator> from_ward_;  // null when it is to_buddy_ (buddy == ward)
  Status broken_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::array<Slot, 2> local_;
  std::array<Slot, 2> held_;
  std::thread round_;
  bool running_ = false;
  bool copied_ = true;
  std::atomic<bool> round_aborted_{false};  // Abort / EndGeneration: nothing completes
  int64_t copied_bytes_ = 0;
  Status copy_status_;
  Status exchange_status_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_RECOVERY_SNAPSHOT_H_
