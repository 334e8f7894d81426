// Layout: how one named tensor lives on the ranks of a ParallelConfig, and the validated
// registry of a model's tensors (docs/reshard-planner.md §1).
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
//   TensorRegistry model;
//   MORPH_RETURN_IF_ERROR(model.Add(w));
//   MORPH_RETURN_IF_ERROR(model.ValidateFor(config));
//   MORPH_ASSIGN_OR_RETURN(Shard mine, ShardOf(w, config, rank));   // empty off-stage
//
// Pure values and functions; thread-compatible. Any thread may call them.
#ifndef MORPH_RESHARD_LAYOUT_H_
#define MORPH_RESHARD_LAYOUT_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "base/parallel_config.h"
#include "base/status.h"
#include "reshard/box.h"
#include "base/dtype.h"
#include "reshard/shard.h"

namespace morph {

class Layout {
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
    return l;
  }
  Layout ZeroShard(bool on = true) const {
    Layout l = *this;
    l.zero_ = on;
    l.zero_group_ = 0;
    return l;
  }
  // Hybrid ZeRO: sharded within DP groups of `group_size` consecutive DP ranks, replicated
  // across the dp / group_size groups (group_size must divide dp of every config: validated).
  // ZeroShard(0) is ZeroShard().
  Layout ZeroShard(int group_size) const {
    Layout l = *this;
    l.zero_ = true;
    l.zero_group_ = group_size;
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
  bool zero_sharded() const { return zero_; }
  // Hybrid ZeRO group size; 0: the whole DP group (plain ZeRO), or not sharded.
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
    return !extra_layers_.empty() || tp_blocks_ != 1 || pad_multiple_ != 0 || zero_group_ != 0;
  }

  // "layer=3 tp_dim=1 zero" / "layer=0 tp_dim=none replicated"
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
};

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  Layout layout;
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

// The ZeRO padding rule above: DP rank d's range of the n flattened elements.
Interval ZeroRange(int64_t n, int dp, int d);
// The DP ranks whose ZeRO ranges hold flat indices [range.begin, range.end) (empty if the range
// is): [first, last].
struct DpSpan {
  int first = 0;
  int last = -1;
};
DpSpan ZeroRanksOf(int64_t n, int dp, Interval range);

// Config-independent checks: kInvalidArgument naming the tensor and what is wrong (empty name,
// negative layer, negative dimension, tp_dim not a dimension of the shape, byte size overflows,
// blocks < 1 or not dividing the split dimension or set without a split, a negative pad
// multiple or one set without a split or with blocks, a negative ZeRO group or one set
// without ZeRO).
Status ValidateTensorSpec(const TensorSpec& spec);
// Checks against a config, assuming ValidateTensorSpec passed: kInvalidArgument naming the
// tensor when one of its layers has no stage, tp does not divide the split dimension (each
// block of it, when block-interleaved; padded tensors always divide), the padded size
// overflows, or a hybrid ZeRO group size does not divide dp (there is no implicit regrouping:
// a DP change to a dp the group size does not divide is refused).
Status ValidateTensorForConfig(const TensorSpec& spec, const ParallelConfig& config);

// The tensor's pipeline stage under `config` (0 when stage_of_layer is empty): the stage of
// layer(). kInvalidArgument naming the tensor if a layer is out of range.
StatusOr<int> StageOf(const TensorSpec& spec, const ParallelConfig& config);
// Stage without checks: the caller validated the pair.
int StageOfUnchecked(const TensorSpec& spec, const ParallelConfig& config);
// Every stage holding the tensor, ascending, each once (unchecked).
std::vector<int> StagesOfUnchecked(const TensorSpec& spec, const ParallelConfig& config);
// Whether stage p holds the tensor (unchecked).
bool OnStageUnchecked(const TensorSpec& spec, const ParallelConfig& config, int p);

// The planning view of a spec: a block-interleaved split becomes a plain split of the block
// view (shape [.., k, L/k, ..], tp_dim + 1, blocks 1). Other specs are returned unchanged.
TensorSpec PlanningSpec(const TensorSpec& spec);
// PlanningSpec(spec).shape.
std::vector<int64_t> PlanShape(const TensorSpec& spec);
// The state: Box::FromShape(PlanShape(spec)). Frames of padded tensors extend past it.
Box StateBox(const TensorSpec& spec);
// Length of the split dimension of the planning view in `config`: padded when the layout pads,
// else its size. Caller validated the pair; the spec must be a planning spec (no blocks).
int64_t SplitLength(const TensorSpec& spec, const ParallelConfig& config);
// The number of ZeRO ranges G of a ZeRO tensor under `config` (zero_group() or dp).
int ZeroGroupSize(const Layout& layout, const ParallelConfig& config);
// A real-shape description of a planning-view box: the boxes of the real tensor (shape
// spec.shape) holding the same elements, disjoint (one box unless the box spans several blocks
// and only part of each).
std::vector<Box> RealBoxes(const TensorSpec& spec, const Box& plan_box);

// The TP-local piece that TP rank t holds before ZeRO (the whole tensor when not split), in
// planning coordinates (padded: may extend past StateBox). Caller validated the pair; t in
// [0, tp).
Box TpBoxOf(const TensorSpec& spec, const ParallelConfig& config, int t);

// Exactly what `rank` holds of the tensor, in planning coordinates: an empty shard (frame = the
// TP-local box, flat range [0,0)) when the rank's stage does not hold it. kInvalidArgument when the
// spec does not fit the config or rank is not in [0, world).
StatusOr<Shard> ShardOf(const TensorSpec& spec, const ParallelConfig& config, int rank);
// Same, without checks (the hot path of the planner; caller validated spec, config and rank).
Shard ShardOfUnchecked(const TensorSpec& spec, const ParallelConfig& config, int rank);

// Bytes of the whole tensor (shape product times dtype size, padding excluded); caller
// validated the spec.
int64_t TensorBytes(const TensorSpec& spec);
// Elements of `shard` that are state (inside StateBox(spec); all of them unless padded).
int64_t StateElements(const TensorSpec& spec, const Shard& shard);

// A model's tensors, in registration order (the index is the `tensor` of PieceMove).
class TensorRegistry {
 public:
  // kInvalidArgument (see ValidateTensorSpec) or kAlreadyExists naming a duplicate name.
  Status Add(TensorSpec spec);
  // kNotFound naming the tensor.
  StatusOr<int> IndexOf(std::string_view name) const;
  StatusOr<const TensorSpec*> Find(std::string_view name) const;
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  int size() const { return static_cast<int>(tensors_.size()); }
  // Validates `config` and every tensor against it (first error, naming the tensor).
  Status ValidateFor(const ParallelConfig& config) const;

 private:
  std::vector<TensorSpec> tensors_;
  std::map<std::string, int, std::less<>> index_;
};

}  // namespace morph

#endif  // MORPH_RESHARD_LAYOUT_H_
