// Layout: how one named tensor lives on the ranks of a ParallelConfig, and the validated
// registry of a model's tensors (docs/reshard-planner.md §1). Part of the public API (<morph/morph.h>).
//
// A layout is (a) a layer, which the config's stage_of_layer maps to a pipeline stage, or
// several layers (tied embeddings: Layers({0, L-1})), each of whose stages holds a full replica,
// (b) a TP split: none (every TP rank holds the whole tensor) or a dimension cut into tp equal
// slices in TP-rank order, optionally block-interleaved (SplitTPBlocks: the dimension is k
// blocks, fused QKV or gate/up, and TP rank t holds the t-th slice of each block, in block
// order) and optionally padded (PadToMultiple(m): the split dimension's logical size L is
// padded to a multiple of m * tp; padding elements are not state), and (c) a DP treatment:
// replicated on every DP rank, or ZeRO flat-sharded: the TP-local piece, flattened row-major,
// cut into dp contiguous ranges in DP-rank order, or hybrid ZeRO (ZeroShard(g), HSDP): cut into
// g ranges, DP rank d holding range d % g, so each range has dp / g live replicas.
//
// ZeRO padding rule: with n elements in the TP-local piece and G = g (or dp), chunk =
// ceil(n / G) and DP rank d holds [min(i*chunk, n), min((i+1)*chunk, n)) for i = d % G. Trailing
// ranges may be short or empty; nothing is physically padded.
//
// PyTorch's layouts (torch.chunk semantics: chunk size c = ceil(n / parts), part i holds
// [min(i*c, n), min((i+1)*c, n)), the last parts short or empty, nothing padded):
//   - ChunkTP(dim): DTensor's Shard(dim) on the TP mesh dimension; tp need not divide dim.
//   - ChunkDP() / ChunkDP(g): FSDP2's Shard(0) over DP (HSDP with g): dimension 0 of the
//     TP-local piece cut into G chunks of rows, DP rank d holding chunk d % G. With a TP split
//     this is FSDP2+TP (DP chunks the TP-local tensor, as FSDP2 does with a DTensor's local
//     tensor; torch's _StridedShard when both cut dimension 0).
// In Shard form a ChunkDP piece is again a flat range of the TP-local frame (whole rows).
//
// Planning coordinates. A block-interleaved tensor is planned in its block view: the split
// dimension of size L becomes two, [k, L/k], and the TP split cuts the second one (PlanShape).
// Row-major order is unchanged, so a local buffer and a global linear index mean the same bytes
// in both views; ShardOf and every Box of a plan are in the block view. A padded tensor's frames
// extend past L up to the config's padded size; only elements below L are state (StateBox).
//
//   TensorSpec w{"layers.3.mlp.w1", DType::kBF16, {4096, 16384},
//                Layout::Layer(3).SplitTP(1).ZeroShard()};
//   TensorSpec qkv{"layers.3.qkv", DType::kBF16, {3 * 4096, 4096},
//                  Layout::Layer(3).SplitTPBlocks(0, 3)};
//   TensorSpec emb{"embed", DType::kBF16, {50257, 4096},
//                  Layout::Layers({0, 23}).SplitTP(0).PadToMultiple(128)};
//   TensorSpec wq{"layers.3.attn.wq", DType::kBF16, {4096, 4096},   // ColwiseParallel + FSDP2
//                 Layout::Layer(3).ChunkTP(0).ChunkDP()};
//   TensorRegistry model;
//   MORPH_RETURN_IF_ERROR(model.Add(w));
//   MORPH_RETURN_IF_ERROR(model.ValidateFor(config));
//   MORPH_ASSIGN_OR_RETURN(Shard mine, ShardOf(w, config, rank));   // empty off-stage
//
// Pure values and functions; thread-compatible. Any thread may call them.
#ifndef MORPH_LAYOUT_H_
#define MORPH_LAYOUT_H_

#include "morph/api.h"

#include <cstdint>
#include <string>
#include <vector>

#include "morph/box.h"
#include "morph/dtype.h"
#include "morph/parallel_config.h"
#include "morph/shard.h"
#include "morph/status.h"

namespace morph {

class MORPH_API Layout {
 public:
  // Layer 0, not split, replicated.
  Layout() = default;
  static Layout Layer(int layer) {
    Layout l;
    l.layer_ = layer;
    return l;
  }
  // Builders return a modified copy: Layout::Layer(3).SplitTP(1).ZeroShard().
  Layout SplitTP(int dim) const {
    Layout l = *this;
    l.tp_dim_ = dim;
    l.tp_chunk_ = false;
    return l;
  }
  // DTensor's Shard(dim) on the TP mesh dimension: torch.chunk semantics, so tp need not divide
  // the dimension (length n, c = ceil(n / tp)): TP rank t holds [min(t*c, n), min((t+1)*c, n)),
  // the last slices shorter or empty. Not combined with blocks or padding.
  Layout ChunkTP(int dim) const {
    Layout l = *this;
    l.tp_dim_ = dim;
    l.tp_chunk_ = true;
    return l;
  }
  Layout ZeroShard(bool on = true) const {
    Layout l = *this;
    l.zero_ = on;
    l.zero_group_ = 0;
    l.dp_chunk_ = false;
    return l;
  }
  // Hybrid ZeRO: sharded within DP groups of `group_size` consecutive DP ranks, replicated
  // across the dp / group_size groups (group_size must divide dp of every config: validated).
  // ZeroShard(0) is ZeroShard().
  Layout ZeroShard(int group_size) const {
    Layout l = *this;
    l.zero_ = true;
    l.zero_group_ = group_size;
    l.dp_chunk_ = false;
    return l;
  }
  // FSDP2's Shard(0) over the DP dimension: dimension 0 of the TP-local piece (length n,
  // c = ceil(n / G)) is cut torch.chunk-style, DP rank d holding rows [min(i*c, n),
  // min((i+1)*c, n)) for i = d % G, G = group_size or dp (0: the whole DP group; a group size is
  // HSDP, as for ZeroShard(g)). A DP-sharded layout like ZeroShard: zero_sharded() is true.
  Layout ChunkDP(int group_size = 0) const {
    Layout l = ZeroShard(group_size);
    l.dp_chunk_ = true;
    return l;
  }
  // Tensors on several stages: `layers` (at least one; the first is layer()). Every stage that
  // holds one of them holds a full replica (tied embeddings on the first and last stage).
  static Layout Layers(std::vector<int> layers) {
    Layout l;
    if (!layers.empty()) {
      l.layer_ = layers[0];
      l.extra_layers_.assign(layers.begin() + 1, layers.end());
    }
    return l;
  }
  Layout AlsoOnLayer(int layer) const {
    Layout l = *this;
    l.extra_layers_.push_back(layer);
    return l;
  }
  // A block-interleaved TP split: dimension `dim` is `blocks` equal blocks (fused QKV: 3, or
  // q/k/v groups; fused gate/up: 2) and TP rank t holds the t-th of tp slices of each block.
  Layout SplitTPBlocks(int dim, int blocks) const {
    Layout l = *this;
    l.tp_dim_ = dim;
    l.tp_chunk_ = false;
    l.tp_blocks_ = blocks;
    return l;
  }
  // Pads the split dimension (logical size L) to P = ceil(L / (multiple * tp)) * multiple * tp
  // (Megatron's vocabulary padding); TP rank t's slice is [t*P/tp, (t+1)*P/tp). Elements at
  // L and beyond are padding: never moved, never saved, zero-filled by the executor.
  Layout PadToMultiple(int multiple) const {
    Layout l = *this;
    l.pad_multiple_ = multiple;
    return l;
  }

  int layer() const { return layer_; }
  // The split dimension, or -1 when every TP rank holds the whole tensor.
  int tp_dim() const { return tp_dim_; }
  bool tp_split() const { return tp_dim_ >= 0; }
  // Whether the TP split is ChunkTP's (torch.chunk: uneven slices allowed).
  bool tp_chunked() const { return tp_chunk_; }
  // DP-sharded: ZeRO flat ranges, or ChunkDP's rows of dimension 0 (dp_chunked()).
  bool zero_sharded() const { return zero_; }
  bool dp_chunked() const { return dp_chunk_; }
  // Hybrid group size of a DP-sharded layout; 0: the whole DP group, or not sharded.
  int zero_group() const { return zero_group_; }
  // Every layer holding the tensor, layer() first.
  std::vector<int> layers() const {
    std::vector<int> v{layer_};
    v.insert(v.end(), extra_layers_.begin(), extra_layers_.end());
    return v;
  }
  const std::vector<int>& extra_layers() const { return extra_layers_; }
  int tp_blocks() const { return tp_blocks_; }
  int pad_multiple() const { return pad_multiple_; }
  // True when any field beyond layer/tp_dim/zero is set (they enter the digest only then).
  bool extended() const {
    return !extra_layers_.empty() || tp_blocks_ != 1 || pad_multiple_ != 0 || zero_group_ != 0 ||
           chunked();
  }
  // ChunkTP or ChunkDP (the torch layouts; they enter the digest only when set).
  bool chunked() const { return tp_chunk_ || dp_chunk_; }

  // "layer=3 tp_dim=1 zero" / "layer=0 tp_dim=none replicated" /
  // "layer=0 tp_dim=1 tp_chunk dp_chunk zero_group=2"
  std::string ToString() const;
  friend bool operator==(const Layout&, const Layout&) = default;

 private:
  int layer_ = 0;
  std::vector<int> extra_layers_;
  int tp_dim_ = -1;
  int tp_blocks_ = 1;
  int pad_multiple_ = 0;
  bool zero_ = false;
  int zero_group_ = 0;
  bool tp_chunk_ = false;
  bool dp_chunk_ = false;
};

struct MORPH_API TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  Layout layout;
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

// The ZeRO padding rule above: DP rank d's range of the n flattened elements.
MORPH_API Interval ZeroRange(int64_t n, int dp, int d);

// Config-independent checks: kInvalidArgument naming the tensor and what is wrong (empty name,
// negative layer, negative dimension, tp_dim not a dimension of the shape, byte size overflows,
// blocks < 1 or not dividing the split dimension or set without a split, a negative pad
// multiple or one set without a split or with blocks, a negative ZeRO group or one set
// without ZeRO, ChunkTP with blocks or padding, ChunkDP on a scalar or with blocks on dim 0).
MORPH_API Status ValidateTensorSpec(const TensorSpec& spec);
// Checks against a config, assuming ValidateTensorSpec passed: kInvalidArgument naming the
// tensor when one of its layers has no stage, tp does not divide the split dimension (each
// block of it, when block-interleaved; padded and ChunkTP tensors need not), the padded size
// overflows, or a hybrid ZeRO group size does not divide dp (there is no implicit regrouping:
// a DP change to a dp the group size does not divide is refused).
MORPH_API Status ValidateTensorForConfig(const TensorSpec& spec, const ParallelConfig& config);

// The tensor's pipeline stage under `config` (0 when stage_of_layer is empty): the stage of
// layer(). kInvalidArgument naming the tensor if a layer is out of range.
MORPH_API StatusOr<int> StageOf(const TensorSpec& spec, const ParallelConfig& config);

// The planning shape (see above): the shape, with a block-interleaved split dimension of size
// L made two, [k, L/k]. A shard's frame and boxes are in it.
MORPH_API std::vector<int64_t> PlanShape(const TensorSpec& spec);
// The state: Box::FromShape(PlanShape(spec)). Frames of padded tensors extend past it.
MORPH_API Box StateBox(const TensorSpec& spec);

// Exactly what `rank` holds of the tensor, in planning coordinates: an empty shard (frame = the
// TP-local box, flat range [0,0)) when the rank's stage does not hold it. kInvalidArgument when the
// spec does not fit the config or rank is not in [0, world).
MORPH_API StatusOr<Shard> ShardOf(const TensorSpec& spec, const ParallelConfig& config, int rank);

// Bytes of the whole tensor (shape product times dtype size, padding excluded); caller
// validated the spec.
MORPH_API int64_t TensorBytes(const TensorSpec& spec);
// Elements of `shard` that are state (inside StateBox(spec); all of them unless padded).
MORPH_API int64_t StateElements(const TensorSpec& spec, const Shard& shard);

}  // namespace morph

#endif  // MORPH_LAYOUT_H_
