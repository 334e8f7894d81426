// What the planner and executor need of a Layout beyond the public API (morph/layout.h): ZeRO
// rank spans, DP cuts (ZeRO's flat ranges, ChunkDP's rows) and TP slices (even, padded,
// torch.chunk), stage and shard computations without checks for the hot paths, the planning
// view of a block-interleaved spec, real boxes of planning boxes, and the registry of a model's
// tensors. Pure values and functions; any thread.
#ifndef MORPH_RESHARD_LAYOUT_H_
#define MORPH_RESHARD_LAYOUT_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "morph/layout.h"

namespace morph {


// The DP ranks whose ZeRO ranges hold flat indices [range.begin, range.end) (empty if the range
// is): [first, last].
struct DpSpan {
  int first = 0;
  int last = -1;
};
DpSpan ZeroRanksOf(int64_t n, int dp, Interval range);

// How a DP-sharded layout cuts the n elements of a TP-local piece (row-major) into `groups`
// ranges: `units` units of `unit` elements each, range i = unit * ZeroRange(units, groups, i).
// ZeRO: units = n, unit = 1 (flat ranges); ChunkDP: units = the piece's rows (its dimension 0),
// unit = elements per row (torch.chunk of dimension 0).
struct DpCut {
  int64_t units = 0;
  int64_t unit = 1;
  int groups = 1;
  // DP range index i's flat range in the piece.
  Interval Range(int i) const;
  // The range indices holding any of flat indices `flat` (empty span if none).
  DpSpan RanksOf(Interval flat) const;
};
// The cut of a piece of n elements whose dimension 0 has `rows` rows (unchecked; a ZeRO or
// ChunkDP layout, G from ZeroGroupSize).
DpCut DpCutOf(const Layout& layout, const ParallelConfig& config, int64_t n, int64_t rows);
// The cut of the piece `frame` (its dimension 0 is the rows).
DpCut DpCutOf(const Layout& layout, const ParallelConfig& config, const Box& frame);

// Stage without checks: the caller validated the pair.
int StageOfUnchecked(const TensorSpec& spec, const ParallelConfig& config);
// Every stage holding the tensor, ascending, each once (unchecked).
std::vector<int> StagesOfUnchecked(const TensorSpec& spec, const ParallelConfig& config);
// Whether stage p holds the tensor (unchecked).
bool OnStageUnchecked(const TensorSpec& spec, const ParallelConfig& config, int p);

// The planning view of a spec: a block-interleaved split becomes a plain split of the block
// view (shape [.., k, L/k, ..], tp_dim + 1, blocks 1). Other specs are returned unchanged.
TensorSpec PlanningSpec(const TensorSpec& spec);
// Length of the split dimension of the planning view in `config`: padded when the layout pads,
// else its size. Caller validated the pair; the spec must be a planning spec (no blocks).
int64_t SplitLength(const TensorSpec& spec, const ParallelConfig& config);
// Width of TP slices of the planning view's split dimension: SplitLength / tp, or for ChunkTP
// ceil(L / tp). TpSlice: TP rank t's slice, [t*w, (t+1)*w) clipped to SplitLength (only ChunkTP
// slices are ever clipped: short or empty at the end).
int64_t TpSliceWidth(const TensorSpec& spec, const ParallelConfig& config);
Interval TpSlice(const TensorSpec& spec, const ParallelConfig& config, int t);
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

// Same, without checks (the hot path of the planner; caller validated spec, config and rank).
Shard ShardOfUnchecked(const TensorSpec& spec, const ParallelConfig& config, int rank);

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
