// Layout: how one named tensor lives on the ranks of a ParallelConfig, and the validated
// registry of a model's tensors (docs/reshard-planner.md).
//
// A layout is (a) a layer, which the config's stage_of_layer maps to a pipeline stage, (b) a TP
// split: none (every TP rank holds the whole tensor) or a dimension cut into tp equal slices in
// TP-rank order, and (c) a DP treatment: replicated on every DP rank, or ZeRO flat-sharded: the
// TP-local piece, flattened row-major, cut into dp contiguous ranges in DP-rank order.
//
// ZeRO padding rule: with n elements in the TP-local piece, chunk = ceil(n / dp) and DP rank d
// holds [min(d*chunk, n), min((d+1)*chunk, n)). Trailing ranges may be short or empty; nothing
// is physically padded (so a DP rank's local buffer is exactly its range, possibly 0 bytes).
//
//   TensorSpec w{"layers.3.mlp.w1", DType::kBF16, {4096, 16384},
//                Layout::Layer(3).SplitTP(1).ZeroShard()};
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
    return l;
  }

  int layer() const { return layer_; }
  // The split dimension, or -1 when every TP rank holds the whole tensor.
  int tp_dim() const { return tp_dim_; }
  bool tp_split() const { return tp_dim_ >= 0; }
  bool zero_sharded() const { return zero_; }

  // "layer=3 tp_dim=1 zero" / "layer=0 tp_dim=none replicated"
  std::string ToString() const;
  friend bool operator==(const Layout&, const Layout&) = default;

 private:
  int layer_ = 0;
  int tp_dim_ = -1;
  bool zero_ = false;
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
// negative layer, negative dimension, tp_dim not a dimension of the shape, byte size overflows).
Status ValidateTensorSpec(const TensorSpec& spec);
// Checks against a config, assuming ValidateTensorSpec passed: kInvalidArgument naming the
// tensor when its layer has no stage or tp does not divide the split dimension.
Status ValidateTensorForConfig(const TensorSpec& spec, const ParallelConfig& config);

// The tensor's pipeline stage under `config` (0 when stage_of_layer is empty).
// kInvalidArgument naming the tensor if the layer is out of range.
StatusOr<int> StageOf(const TensorSpec& spec, const ParallelConfig& config);
// Stage without checks: the caller validated the pair.
int StageOfUnchecked(const TensorSpec& spec, const ParallelConfig& config);

// The TP-local piece that TP rank t holds before ZeRO (the whole tensor when not split).
// Caller validated the pair; t in [0, tp).
Box TpBoxOf(const TensorSpec& spec, const ParallelConfig& config, int t);

// Exactly what `rank` holds of the tensor: an empty shard (frame = the TP-local box, flat range
// [0,0)) when the rank's stage does not hold it. kInvalidArgument when the spec does not fit the
// config or rank is not in [0, world).
StatusOr<Shard> ShardOf(const TensorSpec& spec, const ParallelConfig& config, int rank);
// Same, without checks (the hot path of the planner; caller validated spec, config and rank).
Shard ShardOfUnchecked(const TensorSpec& spec, const ParallelConfig& config, int rank);

// Bytes of the whole tensor (shape product times dtype size); caller validated the spec.
int64_t TensorBytes(const TensorSpec& spec);

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
