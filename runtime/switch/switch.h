// The switch engine: what a worker's training thread does to move from generation `from` to
// `next` once the coordinator committed the change (docs/design.md §4 "Planned change", §9
// "The switch, as built").
//
//   // on Prepare, beside the running generation (the old one keeps training):
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<PreparedSwitch> sw,
//       PrepareSwitch(manifest, me, prepare, store_next, GlooFactory(device), options, dl));
//   // at BeginStep(S), with the commit:
//   MORPH_ASSIGN_OR_RETURN(SwitchStats stats, ExecuteSwitch(*sw, commit, state, dl));
//   std::unique_ptr<GroupSet> groups = TakeGroups(*sw);   // null: this worker holds no rank
//
// PrepareSwitch does everything that does not need the state: it derives the change's plan from
// the decision (PlanForChange) and checks its digest against the coordinator's, builds the
// change communicator over every participant and the new generation's communicators, and cuts
// this participant's part of the plan into batches. ExecuteSwitch then only moves bytes:
//
//   1. The tensors are resharded in batches, in one global order every participant derives
//      alike (below). For each batch: allocate the batch's new shards (the tensor's allocator;
//      or take the ones pre-allocated in PrepareSwitch, see "Pre-allocation"), run one
//      ExecutePlan over the batch's part of the plan (one handshake round trip per pair that
//      exchanges pieces in it), release the batch's old shards (a leaver, which allocates
//      nothing, keeps them until step 4).
//   2. The scalar blobs are broadcast from participant 0 (the first surviving old rank).
//   3. The closing barrier on the change communicator: every participant's exchange completed
//      (executor.h, "Completion"). Only now may a leaver exit.
//   4. The State is switched to `next`'s config and this worker's new rank (rank -1 and no
//      storage on a leaver).
//
// Order and memory bound. Tensors are ordered by their global change of bytes
// G_t = bytes(t) * (copies_next(t) - copies_from(t)), copies = (ZeRO ? 1 : dp) * (TP-split ?
// 1 : tp): shrinking tensors first, ties by registration index; consecutive tensors form a
// batch while the sum of their largest new shard (over ranks, M_t) stays <= batch_bytes (a
// tensor beyond it forms a batch alone). For a worker with old shard bytes o_t and new n_t
// (O = Σ o_t, N = Σ n_t), during batch k after batches D_k:
//     held_k = O + Σ_{t in D_k} (n_t - o_t) + Σ_{t in B_k} n_t.
// When the worker is sign-consistent with the order — no tensor it grows (n_t > o_t) comes
// before one it shrinks (n_t < o_t) — the prefix sums Σ_{D_k}(n_t - o_t) first fall, then rise,
// so each is <= max(0, N - O), and
//     peak <= max(O, N) + E + staging,  E = max_k Σ_{B_k} n_t <= max(batch_bytes, largest n_t)
// (staging: the executor's, <= the manifest's staging_bytes, in use only inside a batch). With
// batch_bytes = 0 every tensor is its own batch and E is the largest single new shard: the
// issue's bound. Sign-consistent: joiners (O = 0), leavers (N = 0), and any worker whose shards
// of every tensor move the same way — every worker of a pure DP or pure TP change, as long as
// ZeRO ranges are even (an uneven trailing range can grow a survivor's shard by less than one
// chunk while dp grows). A PP change can make a worker grow one stage's tensors before it
// shrinks another's (no rank-independent order avoids that); the peak is then still exactly
// max_k held_k + staging, which PreparedSwitch::predicted_peak_bytes() computes before anything
// moves; SwitchStats::sign_consistent says whether the bound is guaranteed.
//
// Pre-allocation (SwitchOptions::preallocate). PrepareSwitch picks new shards in execution
// order — a prefix Q of the tensors that are not kept — while O + Σ_Q n_t <= max(max(O, N) + E,
// the peak without it), and a thread of the PreparedSwitch allocates and pre-faults
// (PrefaultHost) them in that order while the old generation still trains; PrepareSwitch does
// not wait for it (a joiner answers its prepare at once). ExecuteSwitch waits for each one
// only when its batch needs it (SwitchStats::prealloc_wait_seconds) and writes into it
// instead of allocating, so the transfer phase takes no first-touch page faults for them (on
// this VM a fresh page costs more than copying it: 0.6 GB/s against 5). The held bytes during
// batch k are then O + Σ_Q n_t - Σ_{D_k} o_t while Q reaches past k, and what they were
// without pre-allocation afterwards: the peak is max(O + Σ_Q n_t, the peak without), within
// the same bound. Shards not pre-allocated are pre-faulted when allocated (half the cost of
// faulting them by the copy or the receive). An abandoned prepare releases them.
//
// Growing in place. A tensor whose old shard here is a contiguous, in-order part of its new
// shard at a page-aligned byte offset (a ZeRO range that grows over the same frame; a TP split
// on dim 0 that merges), all of it resident per the plan, with page-mapped storage on both
// sides (HostAllocator's for 1 MiB or more): its old buffer's pages are moved into the new one
// (MovePages) instead of copied, the plan's local copies for it are dropped (counted as
// covered), and it sends from there. Pre-faulting skips that range. Memory accounting is
// unchanged (conservative: the old shard still counts until the batch ends). A switch that
// fails in a batch that moved pages has lost those old shards too (State::intact() is false).
//
// Recycling (with preallocate, not with keep_old_until_barrier): the old shards released after
// batch k go into a PagePool and back the new shards allocated for batch k+1 (already faulted
// pages, moved by mremap, no copy; what is left is unmapped once batch k+1 is allocated). So a
// page is held no longer than the accounting above says, and the bound is unchanged.
//
// Failure. Any error stops the switch on this worker and names what failed (the batch and its
// tensors; the worker and participant of a peer that disappeared, from the communicator's
// failed peers). The State then keeps its old config and rank; old shards of batches not yet
// run are intact, new shards are discarded. A change cannot be rolled back once the first batch
// released old shards (State::intact() is false then; unless keep_old_until_barrier). Recovery
// (a new generation from the survivors' intact state, or a checkpoint) is the failures issue's.
//
// Recovery (change.recovery): the plan depends on the commit (its stale participants), so
// PrepareSwitch builds only the communicators and ExecuteSwitch derives and checks the plan
// from the commit (its time counts in the stall). A stale participant's old shards are released
// first and never read; it receives its whole new state. The scalars come from the first
// participant that is not stale. A recovery from a checkpoint moves nothing between
// participants: every one installs its new shards and restores them (restore_checkpoint).
// A recovery from buddy snapshots (kSnapshot, runtime/plan/snapshot_plan.h) reads no live
// shard, but reuses its memory: a live shard that is the tensor's new shard here is written in
// place, the others' pages back the new shards (a PagePool, with `preallocate`), the rest is
// allocated and pre-faulted; then two exchanges into them — round A from each worker's own
// local copy of the snapshot step, round B from the copies the buddies hold for the lost ranks
// (SwitchOptions::snapshot) — then the scalars from the first participant serving its own
// copy, then the closing barrier. SwitchStats::shards_kept / recycled_bytes count the reuse.
//
// Device path (SwitchOptions::device; switch_device.cc; docs/design.md "The device path, as
// built"). Device-resident tensors move over a DeviceTransport on the change's union
// communicator: the next generation's world when every participant holds a rank in it and the
// step groups are on the device, else a fresh one over the participants, built last in
// PrepareSwitch (after the change communicator and the new groups, on every participant). Each
// batch runs one exchange per transport it needs: its device tensors over the union, its host
// tensors over the change transport.
//
// Device memory. SwitchStats::device counts this worker's device bytes as they are allocated and
// released: held at the start (old device shards O_d), the peak during the batches (device
// staging and the transport's bounce buffers included) and at the end (N_d), next to bound =
// max(O_d, N_d) + E_d + staging over the device tensors (guaranteed where sign-consistent, as
// above). When device.free_bytes() says the device cannot hold bound - O_d more, every old device
// shard is first copied to device.pinned_host and released; each batch copies its own back to the
// device for its exchange only, so the peak is <= N_d + 2 E_d + staging.
//
// Abandon: destroying a PreparedSwitch releases the change communicator and the new groups
// (peers still building or using them fail with kUnavailable); the State is untouched.
//
// Thread-safety: PrepareSwitch on any thread (the agent's background thread, say);
// ExecuteSwitch and TakeGroups on the training thread, one at a time; Abort from any thread.
#ifndef MORPH_RUNTIME_SWITCH_SWITCH_H_
#define MORPH_RUNTIME_SWITCH_SWITCH_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "collectives/build_cancel.h"
#include "collectives/comm_transport.h"
#include "collectives/communicator.h"
#include "collectives/device_memory.h"
#include "collectives/device_transport.h"
#include "collectives/groups.h"
#include "collectives/union_comm.h"
#include "collectives/store/store.h"
#include "reshard/executor.h"
#include "reshard/local_plan.h"
#include "runtime/state/state.h"
#include "runtime/protocol/messages.h"
#include "runtime/plan/plan_input.h"
#include "runtime/recovery/snapshot.h"

namespace morph {

// The device data path (docs/design.md "Device path"): which tensors live in device memory and
// how to reach the device. Every field must be equal on all participants except `memory` and
// `free_bytes`, which are this worker's.
struct SwitchDeviceOptions {
  // Per manifest tensor: its shards are device memory (e.g. State::memory_of(t) == kCuda at
  // registration). Those tensors move over a DeviceTransport on the change's union communicator
  // (collectives/union_comm.h), the others over the change transport (Gloo, shared memory); a
  // batch holding both runs one exchange on each. Empty: no device path.
  std::vector<bool> tensors;
  // Builds the union communicator when it must be fresh (NcclFactory(device); tests:
  // FakeNcclHub::Factory). Required with `tensors`.
  CommunicatorFactory factory;
  // The step groups are built on the device (NCCL): when every participant holds a rank in the
  // next generation, its world communicator carries the reshard and nothing more is built.
  bool new_world_on_device = false;
  // This worker's device (CudaDeviceMemory(device); tests: FakeDevice::Memory). Required with
  // `tensors`.
  std::function<StatusOr<std::unique_ptr<DeviceMemory>>()> memory;
  // Device bytes this worker may hold beyond its current state during the change (cudaMemGetInfo's
  // free bytes less a margin); < 0 or null: no limit. When the change needs more (its device
  // bound), the old device shards are staged to `pinned_host` first (switch.h "Device memory").
  std::function<int64_t()> free_bytes;
  // Host memory for that staging (pinned: CudaHostAllocator(); tests: HostAllocator()).
  Allocator pinned_host;
};

struct SwitchOptions {
  // Bound on new-shard bytes allocated at once beyond what is freed: tensors are resharded in
  // batches in one global order so the peak stays <= max(old, new) state + max(batch_bytes,
  // the largest single shard) + staging (see "Order and memory bound" above). Must be equal on
  // all participants (it cuts the batches).
  uint64_t batch_bytes = uint64_t{64} << 20;
  // CUDA: copy old device shards to host first and free the device, receive the new shards in
  // host memory, then copy each batch's new shards into their device storage: device memory
  // never holds more than max(old, new) state (the old shards until they are copied out, then
  // new shards only) and no staging; host memory holds the old device state and one batch. Every
  // exchange then moves host memory (Gloo can; NCCL cannot). On host tensors it only adds one copy.
  // Compile-checked here (no GPU on the build machines).
  bool stage_old_in_host = false;
  // Release old shards only after the closing barrier: a failed switch then leaves the whole
  // old state intact (rollback possible), at the cost of holding old and new state together.
  bool keep_old_until_barrier = false;
  // Pre-allocation (see "Pre-allocation" above): (tensor index, bytes) -> the storage
  // State::AllocateShard gives that tensor's new shard (HostAllocator's for morph-owned host
  // tensors, the tensor's allocator for adopted ones), callable from PrepareSwitch's thread.
  // Null: nothing is pre-allocated (CUDA state, adopted tensors whose allocator belongs to the
  // training thread). Ignored with stage_old_in_host and for recoveries. Adopted tensors'
  // shards never come from the page pool (their storage is the allocator's).
  ShardAllocator preallocate;
  // Per manifest tensor: its storage is its allocator's and cannot have its pages moved
  // (StateStore::pages_movable: adopted without TensorAllocator::move_pages), so it is never
  // grown in place ("Growing in place"): the resident part is copied, and
  // pre-allocation faults in the whole new shard so that the copy lands in resident pages
  // (first touch costs about ten times a copy on these VMs: design.md "Fresh pages"). Empty:
  // every tensor's storage is morph's.
  std::vector<bool> fixed_storage;
  // chunk_bytes and staging_bytes come from the manifest (they are part of the plan digest);
  // the other fields (rounds in flight, strided messages) from here.
  ExecutorOptions executor;
  CommTransportOptions transport;
  // Bounds each transport group, the scalar broadcast and the closing barrier (the deadline
  // passed to ExecuteSwitch bounds the whole switch too).
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  SwitchDeviceOptions device;
  // Ends this prepare from any thread (ChangeBuilder::AbortFrom): PrepareSwitch checks it
  // between its builds and returns kAborted; factories made with it (NcclFactory(device,
  // cancel), FakeNcclHub::Factory(process, cancel)) end a creation in progress at its next poll.
  std::shared_ptr<BuildCancel> cancel;
  // The new step groups' factory when it is not PrepareSwitch's `factory` (the runtime's NCCL
  // one made with `cancel`, so that an abort ends their creation too). Null: `factory`.
  CommunicatorFactory groups_factory;
  // Tests: called on the training thread after batch `k` (0-based) moved and released its old
  // shards, before the next. Fault injection only.
  std::function<void(int batch)> after_batch;
  // A recovery from a checkpoint (RecoveryDecision::kCheckpoint): fills every shard and scalar
  // of the State, already installed for the new config and rank, from the checkpoint at
  // `path`. Null: such a recovery fails with kFailedPrecondition.
  std::function<Status(const std::string& path, StateStore& state)> restore_checkpoint;
  // A recovery from buddy snapshots (RecoveryDecision::kSnapshot): this worker's complete copy
  // of `step` of the generation the change starts from, its own (held = false) or the one it
  // holds for its ward (held = true); null when it has none. Called on the training thread;
  // the copy must stay valid until ExecuteSwitch returns. Null function: such a recovery fails
  // with kFailedPrecondition.
  std::function<const SnapshotData*(int64_t step, bool held)> snapshot;
  // The running generation's step communicators can shrink (capabilities().shrink: NCCL's
  // ncclCommShrink). Then a recovery in which ranks only leave — this worker keeps a rank, and
  // `next`'s ranks are `from`'s survivors in their order, nobody joining — builds no new groups
  // here: ShrinkGroups derives them from the previous ones at the switch (no unique id, no
  // rendezvous; dead ranks do not block it). Planned changes always build theirs here, beside
  // the running generation: a shrink needs the running communicators, which the training thread
  // uses until S, and would put its cost into the stall.
  bool previous_groups_can_shrink = false;
  // After such a recovery applied here: the tensors (by index) whose new shard here is their
  // shard in this worker's own copy of `step` and was written from that copy alone, so that
  // they hold exactly its bytes (BuddySnapshotter::NoteRestored). Training thread; may be null.
  std::function<void(int64_t step, std::vector<bool> tensors)> restored_from_own_snapshot;
};

struct SwitchTimings {
  double communicators = 0;  // PrepareSwitch: change communicator, transport, new groups
  double plan = 0;           // PrepareSwitch: PlanForChange, digest, local plan, batches
  double transfer = 0;       // ExecuteSwitch: the batches
  double resume = 0;         // ExecuteSwitch: scalars, closing barrier, State swap
};                           // seconds

struct SwitchStats {
  SwitchTimings seconds;
  int64_t bytes_sent = 0, bytes_received = 0, bytes_copied = 0;
  // Most tensor-state bytes this worker held at once during the switch (old shards not yet
  // released + new shards allocated; in stage_old_in_host mode host copies count too), and the
  // most executor staging in use during one batch (added to the batch's state bytes, the peak
  // of the sum is peak_bytes).
  int64_t peak_state_bytes = 0;
  int64_t peak_staging_bytes = 0;
  int64_t peak_bytes = 0;
  // max(old, new) + largest batch's new bytes here + the manifest's staging_bytes; guaranteed
  // when sign_consistent (see above).
  int64_t bound_bytes = 0;
  bool sign_consistent = true;
  int64_t old_bytes = 0, new_bytes = 0;
  int64_t largest_shard_bytes = 0;  // largest single new shard here
  int64_t largest_batch_bytes = 0;  // E above
  int batches = 0;
  // Tensors whose new shard here equals the old one: kept in their buffer (no copy).
  int shards_kept = 0;
  // New shards allocated and pre-faulted in PrepareSwitch (SwitchOptions::preallocate).
  int64_t preallocated_bytes = 0;
  double prealloc_wait_seconds = 0;  // ExecuteSwitch waiting for the pre-allocation thread
  // New-shard bytes backed by pages of old shards released in the batch before (PagePool).
  int64_t recycled_bytes = 0;
  // Tensors whose old shard's pages became the resident part of the new one (MovePages).
  int shards_grown = 0;
  // Bytes this worker received from same-host peers over the change transport's shared memory,
  // by path (CommTransport::shm_stats): mapped from the sender's ShmArena segment (memcpy), or
  // by process_vm_readv (the sender's buffer was not from an arena).
  int64_t shm_mapped_bytes = 0, shm_vm_readv_bytes = 0;
  int shards_preallocated = 0;
  // Where the transfer phase went (seconds, summed over the batches): allocating new shards,
  // and the executor's local copies, packing, waits on the transport and unpacking.
  double alloc_seconds = 0, copy_seconds = 0, pack_seconds = 0, wait_seconds = 0,
         unpack_seconds = 0;
  double executor_seconds = 0;  // the executor's total (the above + handshakes, validation)
  double release_seconds = 0;   // releasing old shards
  // The device path (SwitchOptions::device; "Device memory" above): this worker's device-memory
  // figures by phase next to their bound, counted as the switch allocates and releases (tests
  // check them against the fake device's own count).
  struct Device {
    std::string union_source;  // where the union communicator came from; empty: no device path
    int64_t old_bytes = 0, new_bytes = 0;  // device state before / after
    int64_t largest_batch_bytes = 0;       // largest batch's new device shard bytes here
    // The manifest's executor staging plus the device transport's bounce buffers (host
    // messages through device memory, measured: a few KiB).
    int64_t staging_bytes = 0;
    // max(old, new) + largest batch + staging: the peak when the device holds it all.
    int64_t bound_bytes = 0;
    int64_t free_bytes = -1;    // what SwitchDeviceOptions::free_bytes said (-1: no limit)
    int64_t staged_bytes = 0;   // old device shards staged to pinned host memory (0: none)
    int64_t prepare_bytes = 0;  // held when the transfer starts (the old device shards)
    int64_t transfer_peak_bytes = 0;  // most held during the batches, device staging included
    int64_t resume_bytes = 0;   // held when the switch returns (the new device shards)
    int64_t bytes_sent = 0, bytes_received = 0;  // over the device transport
  } device;

  // Adds one executor run (a batch, a round): bytes, the phases' seconds and the staging peak.
  void AddExecutor(const ExecutorStats& r);
};

struct DeviceTally;  // switch_internal.h

// Built between Prepare and S, beside the running generation (DynaTrain-style masking).
class PreparedSwitch {
 public:
  ~PreparedSwitch();

  const Generation& from() const { return from_; }
  const Generation& next() const { return next_; }
  bool first_generation() const { return from_.id == 0; }
  int participant() const { return participant_; }  // index in change.participants
  int num_participants() const { return num_participants_; }
  int old_rank() const { return old_rank_; }  // -1: joiner / spare
  int new_rank() const { return new_rank_; }  // -1: leaver / spare
  // This participant's part of the plan (empty for the first generation) and its batches
  // (tensor indices, in execution order).
  const LocalPlan& plan() const { return plan_; }
  const std::vector<std::vector<int32_t>>& batches() const { return batches_; }
  // held_k maximized over the batches (see "Order and memory bound"), without staging.
  int64_t predicted_peak_bytes() const { return predicted_peak_; }
  const SwitchStats& planned() const { return planned_; }  // byte figures known before S
  // After ExecuteSwitch failed at its closing barrier only: the exchange had completed, so this
  // participant holds the whole new state (installed in the State at once unless
  // keep_old_until_barrier kept the old one intact; AdoptNewState installs it then). If the
  // change applied elsewhere (Outcome), the worker follows: AdoptNewState, then TakeGroups.
  bool new_state_complete() const { return new_complete_; }

  // Blocks until the background pre-allocation is done (tests; ExecuteSwitch waits per shard).
  void WaitForPreallocation();

  // Makes a running ExecuteSwitch (and every later one) fail with kAborted: aborts the change
  // communicator and the new groups. Any thread, but not concurrently with TakeGroups.
  void Abort();

  // PrepareSwitch built no new groups: ShrinkGroups makes them from the previous generation's
  // (SwitchOptions::previous_groups_can_shrink).
  bool shrinks_groups() const { return shrink_groups_; }

 private:
  friend StatusOr<std::unique_ptr<PreparedSwitch>> PrepareSwitch(const JobManifest&, WorkerId,
                                                                 const PrepareMsg&, Store&,
                                                                 const CommunicatorFactory&,
                                                                 const SwitchOptions&, Deadline);
  friend StatusOr<SwitchStats> ExecuteSwitch(PreparedSwitch&, const CommitMsg&, StateStore&, Deadline);
  friend class SwitchExecution;
  friend std::unique_ptr<GroupSet> TakeGroups(PreparedSwitch&);
  friend Status ShrinkGroups(PreparedSwitch&, std::unique_ptr<GroupSet>, Deadline);
  friend Status PlanSwitch(PreparedSwitch&, const ChangePlan&, const SwitchOptions&);
  friend void PlanPreallocation(PreparedSwitch&);
  friend void MarkApplied(PreparedSwitch&);
  friend void FillPreallocation(PreparedSwitch&, const ShardAllocator&);
  friend Buffer TakePreallocated(PreparedSwitch&, size_t);
  friend int64_t PredictPeak(const PreparedSwitch&, bool keep_old);
  friend Status PrepareDevicePath(PreparedSwitch&, Store&, Deadline);
  friend void PlanDeviceBytes(PreparedSwitch&);
  friend bool OnDevice(const PreparedSwitch&, size_t);
  friend StatusOr<ExecutorStats> RunBatch(PreparedSwitch&, const LocalPlan&,
                                          const std::vector<int32_t>&,
                                          std::span<const OldShardData>,
                                          std::span<const NewShardData>, SwitchStats&, int64_t*,
                                          Deadline);
  friend StatusOr<int64_t> StageOldDeviceShards(PreparedSwitch&, StateStore&,
                                                std::vector<ConstBufferView>&,
                                                std::vector<Buffer>&, DeviceTally&);
  friend Status ReturnStagedForBatch(PreparedSwitch&, StateStore&, size_t,
                                     std::vector<ConstBufferView>&, Buffer&, DeviceTally&);
  friend bool ShouldStageOld(PreparedSwitch&, SwitchStats&);
  friend StatusOr<SwitchStats> RestoreFromCheckpoint(PreparedSwitch&, const CommitMsg&, StateStore&,
                                                     Deadline);
  friend StatusOr<SwitchStats> RestoreFromSnapshots(PreparedSwitch&, const CommitMsg&, StateStore&,
                                                    Deadline);
  PreparedSwitch() = default;

  JobManifest manifest_;
  WorkerId me_ = 0;
  Generation from_, next_;
  ChangeParticipants change_;
  std::vector<WorkerId> participants_;
  SwitchOptions options_;
  ExecutorOptions executor_;
  int participant_ = -1, num_participants_ = 0, old_rank_ = -1, new_rank_ = -1;
  LocalPlan plan_;
  std::vector<std::vector<int32_t>> batches_;
  std::vector<LocalPlan> batch_plans_;
  int64_t predicted_peak_ = 0;
  std::vector<bool> kept_;  // per tensor: new shard == old shard here, kept in place
  std::vector<int64_t> grow_offset_;  // per tensor: grown in place at this byte offset, or -1
  // Pre-allocation: which tensors (their position in prealloc_order_, or -1), the order the
  // background thread fills them in, and the buffers it published (under prealloc_mu_).
  std::vector<int> pre_pos_;
  std::vector<int32_t> prealloc_order_;
  int64_t prealloc_bytes_ = 0;
  std::mutex prealloc_mu_;
  std::condition_variable prealloc_cv_;
  std::vector<Buffer> prealloc_;
  size_t prealloc_done_ = 0;
  std::atomic<bool> prealloc_stop_{false};
  std::thread prealloc_thread_;  // joined by the destructor
  SwitchStats planned_;
  std::unique_ptr<Communicator> change_comm_;
  std::unique_ptr<CommTransport> transport_;
  std::unique_ptr<GroupSet> groups_;
  // The device path (switch_device.cc): the union communicator (its `comm` may be groups_'s
  // world) and the transport over it; declared after groups_ so they go first.
  UnionComm union_;
  std::unique_ptr<DeviceTransport> device_transport_;
  // ShrinkGroups: the old ranks that are not in `next`, and what PrepareSwitch was given.
  bool shrink_groups_ = false;
  std::vector<int> leaving_;
  std::mutex groups_mu_;  // groups_ between ShrinkGroups and Abort()
  // Under groups_mu_: this participant passed the closing barrier, so the change is applied and
  // groups_ are the new generation's: Abort() (an abort of the old generation) leaves them be.
  bool applied_ = false;
  Store* store_ = nullptr;
  CommunicatorFactory factory_;
  std::atomic<bool> aborted_{false};
  bool executed_ = false;
  bool new_complete_ = false;  // the exchange completed, the barrier failed
  std::vector<Shard> pending_shards_;  // not yet installed (keep_old_until_barrier)
  std::vector<Buffer> pending_buffers_;
  bool pending_install_ = false;
  friend Status AdoptNewState(PreparedSwitch&, StateStore&);
};

// Installs the new state a switch that failed only at its closing barrier completed
// (new_state_complete()), when the change applied elsewhere. kFailedPrecondition otherwise.
// Training thread.
Status AdoptNewState(PreparedSwitch& prepared, StateStore& state);

// `prepare.next.plan_digest` is checked first, before any communicator is built:
// kFailedPrecondition "plan digest mismatch: coordinator <hex>, computed <hex> (<parts>)" where
// <parts> lists this worker's digest parts (the coordinator ships only their combination).
// Then: kInvalidArgument when `me` is not a participant or the decision is inconsistent
// (PlanForChange's message); kDataLoss naming a tensor and box no surviving participant holds;
// the factory's / store's errors (kDeadlineExceeded at `deadline`, kAborted when the store moved
// past next.id) naming the communicator. Collective: every participant calls it (the change
// communicator), and every worker holding a rank in `next` builds the new groups.
// `store` is generation next.id's; must outlive the PreparedSwitch. The first generation
// (from.id == 0) builds only the new groups; ExecuteSwitch then materializes the State.
StatusOr<std::unique_ptr<PreparedSwitch>> PrepareSwitch(const JobManifest& manifest, WorkerId me,
                                                        const PrepareMsg& prepare, Store& store,
                                                        const CommunicatorFactory& factory,
                                                        const SwitchOptions& options,
                                                        Deadline deadline);

// At BeginStep(S). kFailedPrecondition when `commit` is not the prepared change (generation,
// config, ranks, digest or participants differ), when it runs twice, or when `state` is not laid
// out for this worker's old rank in `from` (or holds shards on a joiner), or its tensors differ
// from the manifest (naming the first difference); kAborted after Abort(); otherwise the
// executor's and communicators' statuses with context "switch to generation G: batch k of K
// (tensors 'a', ...)" / "scalar broadcast" / "closing barrier", and — where the communicator
// knows them — the failed peers as "participant P (worker W)". What the State holds after an
// error: see "Failure" above. Collective over the participants.
StatusOr<SwitchStats> ExecuteSwitch(PreparedSwitch& prepared, const CommitMsg& commit, StateStore& state,
                                    Deadline deadline);

// The new generation's communicators (null when this worker holds no rank in `next`, or after
// the first call). Call after ExecuteSwitch succeeded.
std::unique_ptr<GroupSet> TakeGroups(PreparedSwitch& prepared);

// When prepared.shrinks_groups(): the new generation's groups from `previous` (the running
// generation's GroupSet, consumed whatever happens) by GroupBuilder::Rebuild in kFailure mode:
// the world shrunk without the leaving ranks, DP/TP/PP split from it; TakeGroups returns them.
// Collective over the workers holding a rank in `next`; call it before ExecuteSwitch, so that
// a failure fails the switch. kFailedPrecondition when the prepare builds its groups itself or
// `previous` is not the generation the change starts from; Rebuild's errors. Training thread.
Status ShrinkGroups(PreparedSwitch& prepared, std::unique_ptr<GroupSet> previous,
                    Deadline deadline);

}  // namespace morph

#endif  // MORPH_RUNTIME_SWITCH_SWITCH_H_
