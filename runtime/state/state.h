// StateStore: the runtime's side of the worker's State (morph/state.h is what training code sees):
// sealing the registration, the first generation's materialization, and what the switch engine,
// the checkpoints, the snapshots and the undo copy do to the shards (runtime/switch/switch.h).
// Thread-compatible: the training thread (inside Start and BeginStep), as State.
#ifndef MORPH_RUNTIME_STATE_STATE_H_
#define MORPH_RUNTIME_STATE_STATE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "morph/state.h"
#include "reshard/buffer.h"
#include "runtime/protocol/messages.h"

namespace morph {

class StateStore final : public State {
 public:
  StateStore() = default;
  ~StateStore() = default;


  // Copies the registered tensors and scalars into `m` (replacing m.tensors and m.scalars).
  void FillManifest(JobManifest& m) const;
  // Closes registration. Idempotent.
  void Seal();
  bool sealed() const { return sealed_; }
  // The first generation: seals, then allocates this rank's zero-filled shard of every tensor
  // under `config` (nothing when rank < 0: a standby worker), in registration order.
  // kInvalidArgument naming the tensor when it does not fit the config, rank >= world, or a
  // worker mixes host and CUDA storage; kFailedPrecondition when already materialized; an
  // allocator's error naming the tensor and its bytes (kUnimplemented/kUnavailable for CUDA
  // without CUDA support or a GPU). On error nothing stays allocated.
  Status Materialize(const ParallelConfig& config, int rank);
  // True when every tensor holds its shard for config()/rank() (false only after a change
  // failed after releasing old shards; see runtime/switch/switch.h).
  bool intact() const { return intact_; }

  // Storage for the shards of morph-owned host tensors (the runtime's host arena), instead of
  // HostAllocator. Its buffers are not page-mapped: pages_movable() is false for those tensors.
  // Before Materialize; callable from any thread.
  void SetHostAllocator(Allocator host) { host_allocator_ = std::move(host); }

  // ---- Used by the switch engine (runtime/switch/switch.cc) ----

  // The runtime: a step's update was cut short (Runtime::AbortStep after BeginUpdate), so the
  // shards no longer hold one step's values; intact() is false until the next Install.
  void MarkTorn() { intact_ = false; }
  // Tensor `index` (registration order) without a lookup; index < tensors().size().
  TensorRef TensorAt(size_t index);
  // The same for readers (checkpoints, snapshots: runtime/recovery/): they must not write
  // through the view.
  TensorRef TensorAt(size_t index) const;
  // Scalar `index` (registration order); index < scalars().size().
  std::span<const std::byte> ScalarAt(size_t index) const { return scalar_data_[index]; }
  // The runtime's undo copy (MORPH_UNDO_COPY) puts every shard and scalar back to one step's
  // values through TensorAt / MutableScalarAt, then says so: intact() is true again.
  std::span<std::byte> MutableScalarAt(size_t index) { return scalar_data_[index]; }
  void MarkWhole() { intact_ = true; }
  // Storage for a new shard of tensor `index`, from the tensor's allocator (bytes > 0), which
  // is asked for `capacity` bytes when larger (AllocationBytes). Does not change the state. The
  // allocator's error, naming the tensor.
  StatusOr<Buffer> AllocateShard(size_t index, int64_t bytes, int64_t capacity = 0) const;
  // What to ask tensor `index`'s allocator for, for its shard of `bytes` at `rank` of `config`:
  // `bytes`, or with TensorAllocator::pad_dp_shards the largest shard of its DP group (that of
  // DP rank 0 at the same pipeline and TP place) when larger.
  int64_t AllocationBytes(size_t index, const ParallelConfig& config, int rank,
                          int64_t bytes) const;
  // Drops tensor `index`'s current storage (the old shard, once it is no longer needed); the
  // state is no longer intact() until the next Install.
  void ReleaseShard(size_t index);
  // Moves tensor `index`'s current storage out (a shard that stays exactly as it is, kept in
  // place as the new shard); the state is no longer intact() until the next Install.
  Buffer TakeShard(size_t index);
  // The memory kind of the current storage of tensor `index` (its registration's kind for an
  // empty shard of a morph-owned tensor; host for an adopted tensor with no storage yet).
  MemoryKind memory_of(size_t index) const;
  // True for a tensor registered with AdoptTensor (its storage comes from the user's
  // allocator, on the training thread).
  bool adopted(size_t index) const;
  // An adopted tensor whose allocator may be called from any thread (TensorAllocator::any_thread).
  bool allocator_any_thread(size_t index) const;
  // Whether tensor `index`'s host storage can have its pages moved into a new shard's: a
  // morph-owned tensor's page-mapped buffers (MovePages), an adopted one's when its allocator
  // has TensorAllocator::move_pages.
  bool pages_movable(size_t index) const;
  // Moves `from`'s pages (an old shard of tensor `index`) to byte `offset` of `to` (its new
  // shard): MovePages for morph-owned storage (`from` is empty afterwards), the allocator's
  // move_pages for adopted storage (`from` is released as usual later). An error: nothing moved.
  Status MoveShardPages(size_t index, Buffer& from, Buffer& to, size_t offset) const;
  // The allocator's move_pages of adopted tensor `index`: `from` is (a page-aligned part of)
  // storage it gave, `to` storage it or another tensor's allocator gave. An error: nothing moved.
  Status MoveAdoptedPages(size_t index, BufferView from, BufferView to, size_t offset) const;
  // Installs the new layout: `shards[i]` / `buffers[i]` for every tensor (empty Buffer where
  // the shard is empty), laid out for `config` / `rank` (-1: none). Releases whatever storage
  // was still held.
  void Install(const ParallelConfig& config, int rank, std::vector<Shard> shards,
               std::vector<Buffer> buffers);

 private:
  Allocator host_allocator_;  // null: HostAllocator()
};

}  // namespace morph

#endif  // MORPH_RUNTIME_STATE_STATE_H_
