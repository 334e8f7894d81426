// State: the training state a job registers with morph and morph owns — tensors (parameters,
// optimizer moments, gradients if wanted) laid out by a Layout over the current ParallelConfig,
// and small scalar blobs (step, RNG state, LR-schedule state) kept equal on every rank
// (docs/design.md §3). morph allocates each tensor's local shard, and at every reconfiguration
// replaces the shards with the ones the new configuration gives this rank (runtime/switch/switch.h),
// so training code must look its tensors up again after a change (OnReconfigure).
//
//   morph::State& s = rt->state();
//   MORPH_RETURN_IF_ERROR(s.AddTensor("layers.3.mlp.w1", {4096, 16384}, DType::kBF16,
//                                     Layout::Layer(3).SplitTP(1)));
//   MORPH_RETURN_IF_ERROR(s.AddTensor("layers.3.mlp.w1.exp_avg", {4096, 16384}, DType::kF32,
//                                     Layout::Layer(3).SplitTP(1).ZeroShard()));
//   MORPH_RETURN_IF_ERROR(s.AddScalar("step", sizeof(int64_t)));
//   ... Runtime::Start ...
//   MORPH_ASSIGN_OR_RETURN(State::TensorRef w1, s.tensor("layers.3.mlp.w1"));
//   // w1.shard says which elements this rank holds, w1.data where (empty: none here)
//
// Storage: morph-owned host memory (64-byte aligned) or CUDA memory (cudaMalloc on the current
// device), or the user's own through a TensorAllocator (AdoptTensor). Every shard is zero-filled
// when it is first allocated (Materialize); after a change it holds the resharded values. One
// memory kind per worker: every tensor's storage is host, or every one is CUDA (the reshard
// executor moves one kind per exchange); Materialize refuses a mix.
//
// Lifecycle: registration (Add*/Adopt*) until the runtime seals the state when it starts the
// first generation; then the runtime materializes the first generation's shards and swaps them
// at each change. Thread-compatible: the training thread uses it; the runtime touches it only
// from that thread (inside Start and BeginStep), so a TensorRef stays valid until the next
// BeginStep that applies a change.
#ifndef MORPH_RUNTIME_STATE_STATE_H_
#define MORPH_RUNTIME_STATE_STATE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/parallel_config.h"
#include "base/status.h"
#include "reshard/buffer.h"  // MemoryKind, BufferView, Buffer
#include "reshard/layout.h"
#include "reshard/shard.h"
#include "runtime/protocol/messages.h"

namespace morph {

// User-owned storage for a tensor's local shard: morph calls allocate(bytes) when the rank gets
// a non-empty shard (at start and at each change, in plan order) and release(view) — with the
// view allocate returned — when it no longer needs it. allocate returns at least `bytes` bytes
// (more is allowed; morph uses the first `bytes`) of one memory kind, or an error (e.g.
// kResourceExhausted), which fails the start or the change naming the tensor. Called on the
// training thread.
struct TensorAllocator {
  std::function<StatusOr<BufferView>(int64_t bytes)> allocate;
  std::function<void(BufferView)> release;
};

// Largest scalar blob (what JobManifest validation allows).
inline constexpr int64_t kMaxScalarBytes = int64_t{1} << 20;

class State {
 public:
  State();
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // ---- Registration (before Runtime::Start returns; training thread) ----

  // Registers a tensor whose shards morph allocates in `memory`. kInvalidArgument naming the
  // tensor for an invalid spec (ValidateTensorSpec's message), a duplicate name ("tensor 'x'
  // is registered twice"), or CUDA memory in a build without CUDA ("tensor 'x': CUDA memory
  // in a build without CUDA"); kFailedPrecondition ("tensor 'x' registered after Start") once
  // sealed.
  Status AddTensor(std::string name, std::vector<int64_t> shape, DType dtype, Layout layout,
                   MemoryKind memory = MemoryKind::kHost);
  // The same, with the shards' storage from `allocator` (both functions required: else
  // kInvalidArgument "tensor 'x': allocator needs allocate and release").
  Status AdoptTensor(std::string name, std::vector<int64_t> shape, DType dtype, Layout layout,
                     TensorAllocator allocator);
  // Registers a scalar blob of `bytes` bytes (zero-filled), equal on all ranks and handed to
  // joiners. kInvalidArgument naming it for an empty name, bytes < 0 or > kMaxScalarBytes, a
  // duplicate ("scalar 'x' is registered twice"); kFailedPrecondition once sealed ("scalar 'x'
  // registered after Start").
  Status AddScalar(std::string name, int64_t bytes);

  // ---- Access (training thread) ----

  struct TensorRef {
    const TensorSpec* spec = nullptr;
    Shard shard;      // what this rank holds (empty: nothing)
    BufferView data;  // its storage, shard.NumElements() * dtype size bytes; empty when none
  };
  // kNotFound naming the tensor ("no tensor 'x' is registered").
  StatusOr<TensorRef> tensor(std::string_view name);
  // The blob, writable (the training code updates it each step). kNotFound naming it.
  StatusOr<std::span<std::byte>> scalar(std::string_view name);

  const std::vector<TensorSpec>& tensors() const { return specs_; }
  const std::vector<ScalarSpec>& scalars() const { return scalar_specs_; }
  // Bytes of this rank's tensor shards held now.
  int64_t local_bytes() const;

  // ---- Used by the runtime (not by training code) ----

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
  // What the shards are laid out for: null / -1 before Materialize; rank -1 on a worker that
  // holds no rank (standby, or a leaver after its change).
  const ParallelConfig* config() const { return has_config_ ? &config_ : nullptr; }
  int rank() const { return rank_; }
  // True when every tensor holds its shard for config()/rank() (false only after a change
  // failed after releasing old shards; see runtime/switch/switch.h).
  bool intact() const { return intact_; }

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
  // Storage for a new shard of tensor `index`, from the tensor's allocator (bytes > 0).
  // Does not change the state. The allocator's error, naming the tensor.
  StatusOr<Buffer> AllocateShard(size_t index, int64_t bytes) const;
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
  // Installs the new layout: `shards[i]` / `buffers[i]` for every tensor (empty Buffer where
  // the shard is empty), laid out for `config` / `rank` (-1: none). Releases whatever storage
  // was still held.
  void Install(const ParallelConfig& config, int rank, std::vector<Shard> shards,
               std::vector<Buffer> buffers);

 private:
  struct Entry;
  Status CheckName(const std::string& name, const char* what) const;
  Status Register(TensorSpec spec, MemoryKind memory, TensorAllocator allocator, bool adopted);

  std::vector<TensorSpec> specs_;  // registration order (what tensors() returns)
  std::vector<std::unique_ptr<Entry>> entries_;
  std::vector<ScalarSpec> scalar_specs_;
  std::vector<std::vector<std::byte>> scalar_data_;
  bool sealed_ = false;
  bool has_config_ = false;
  bool intact_ = true;
  ParallelConfig config_;
  int rank_ = -1;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_STATE_STATE_H_
