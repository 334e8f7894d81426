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
#ifndef MORPH_STATE_H_
#define MORPH_STATE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "morph/api.h"
#include "morph/buffer.h"
#include "morph/dtype.h"
#include "morph/layout.h"
#include "morph/parallel_config.h"
#include "morph/status.h"

namespace morph {

// User-owned storage for a tensor's local shard: morph calls allocate(bytes) when the rank gets
// a non-empty shard (at start and at each change, in plan order) and release(view) — with the
// view allocate returned — when it no longer needs it. allocate returns at least `bytes` bytes
// (more is allowed; morph uses the first `bytes`) of one memory kind, or an error (e.g.
// kResourceExhausted), which fails the start or the change naming the tensor. Called on the
// training thread, unless `any_thread`.
struct MORPH_API TensorAllocator {
  std::function<StatusOr<BufferView>(int64_t bytes)> allocate;
  std::function<void(BufferView)> release;
  // Both functions may be called from any thread, concurrently with the training thread (they
  // take no lock the training thread holds while it calls into morph). Host tensors whose
  // allocators all say so get their new shards allocated and pre-faulted while the old
  // generation trains, as morph-owned ones do (docs/design.md "Pre-allocation").
  bool any_thread = false;
  // Optional, host storage: moves the pages of `from` (storage allocate gave, holding an old
  // shard that morph releases once the change is applied, or a page-aligned part of it) to byte
  // `offset` of `to` (storage allocate gave for a new shard, possibly another tensor's), without
  // copying, and returns true; false when it cannot (then morph copies, or faults in fresh
  // pages). `offset` is page-aligned and `to` has room for `from` rounded up to whole pages.
  // morph calls it (1) when an old shard is a contiguous part of the new one — a ZeRO range
  // growing, a dim-0 TP split merging (docs/design.md "Growing in place") — and (2) with
  // pre-allocation on, to back a new shard with the pages of old shards released in the batch
  // before ("Recycling"). Afterwards `from`'s bytes belong to `to`: what a view the program
  // kept of the old shard shows is the allocator's to say (the Python package's host blocks
  // keep it readable, its writes its own: python/src/host_blocks.cc).
  std::function<bool(BufferView from, BufferView to, size_t offset)> move_pages;
  // For a DP-sharded tensor (ChunkDP, ZeroShard): allocate every shard with room for the
  // largest of its DP group (the first: torch.chunk and the ZeRO rule cut the trailing ones
  // short), as FSDP2 pads every rank's shard to the rows of the first. allocate() is then asked
  // for that many bytes (never fewer than the shard's); the bytes past this rank's shard are the
  // allocator's: morph never reads or writes them. An empty shard is not allocated.
  bool pad_dp_shards = false;
};

// Largest scalar blob (what JobManifest validation allows).
inline constexpr int64_t kMaxScalarBytes = int64_t{1} << 20;

// A named blob of scalar state (step counters, RNG state, LR-schedule state) kept equal on all
// ranks and handed to joiners. Its size is fixed at registration.
struct MORPH_API ScalarSpec {
  std::string name;
  int64_t bytes = 0;
  friend bool operator==(const ScalarSpec&, const ScalarSpec&) = default;
};

// The runtime owns the one State of a worker (Runtime::state()); training code registers into it
// inside Runtime::Start's declare function and reads it afterwards.
class MORPH_API State {
 public:
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

  // What the shards are laid out for: null / -1 before the first generation; rank -1 on a
  // worker that holds no rank (standby, or a leaver after its change).
  const ParallelConfig* config() const { return has_config_ ? &config_ : nullptr; }
  int rank() const { return rank_; }
 protected:
  // Only the runtime's StateStore (runtime/state/state.h) is a State.
  State();
  ~State();

  struct Entry;
  Status CheckName(const std::string& name, const char* what) const;
  Status Register(TensorSpec spec, MemoryKind memory, TensorAllocator allocator, bool adopted);
  TensorRef RefAt(size_t index) const;  // tensor `index` (registration order) without a lookup


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

#endif  // MORPH_STATE_H_
