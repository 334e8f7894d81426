#include "reshard/layout.h"

#include <algorithm>
#include <limits>

namespace morph {

std::string Layout::ToString() const {
  std::string s = "layer=" + std::to_string(layer_);
  for (int l : extra_layers_) s += "," + std::to_string(l);
  s += " tp_dim=" + (tp_dim_ >= 0 ? std::to_string(tp_dim_) : std::string("none"));
  if (tp_chunk_) s += " tp_chunk";
  if (tp_blocks_ != 1) s += " blocks=" + std::to_string(tp_blocks_);
  if (pad_multiple_ != 0) s += " pad_multiple=" + std::to_string(pad_multiple_);
  s += dp_chunk_ ? " dp_chunk" : zero_ ? " zero" : " replicated";
  if (zero_group_ != 0) s += " zero_group=" + std::to_string(zero_group_);
  return s;
}

Interval ZeroRange(int64_t n, int dp, int d) {
  const int64_t chunk = dp > 0 ? (n + dp - 1) / dp : n;
  return {std::min<int64_t>(chunk * d, n), std::min<int64_t>(chunk * (d + 1), n)};
}

DpSpan ZeroRanksOf(int64_t n, int dp, Interval range) {
  if (range.empty() || n <= 0) return {};
  const int64_t chunk = (n + dp - 1) / dp;
  return {static_cast<int>(range.begin / chunk), static_cast<int>((range.end - 1) / chunk)};
}

Interval DpCut::Range(int i) const {
  const Interval r = ZeroRange(units, groups, i);
  return {r.begin * unit, r.end * unit};
}

DpSpan DpCut::RanksOf(Interval flat) const {
  if (flat.empty() || units <= 0) return {};
  return ZeroRanksOf(units, groups, {flat.begin / unit, (flat.end - 1) / unit + 1});
}

DpCut DpCutOf(const Layout& layout, const ParallelConfig& config, int64_t n, int64_t rows) {
  DpCut c{n, 1, ZeroGroupSize(layout, config)};
  if (layout.dp_chunked() && n > 0 && rows > 0) {
    c.unit = n / rows;
    c.units = rows;
  }
  return c;
}

DpCut DpCutOf(const Layout& layout, const ParallelConfig& config, const Box& frame) {
  int64_t n = 1;
  for (const Interval& i : frame.dims()) n *= i.size();
  return DpCutOf(layout, config, n, frame.rank() > 0 ? frame.dim(0).size() : 1);
}

namespace {

Status Bad(const TensorSpec& spec, const std::string& what) {
  return InvalidArgumentError("tensor '" + spec.name + "': " + what);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// The torch.chunk layouts' own checks (ChunkTP, ChunkDP).
Status ValidateChunks(const TensorSpec& spec) {
  const Layout& l = spec.layout;
  if (l.tp_chunked() && !l.tp_split()) {
    return Bad(spec, "tp_chunk (ChunkTP) needs a TP split (tp_dim)");
  }
  if (l.tp_chunked() && l.tp_blocks() > 1) {
    return Bad(spec, "tp_chunk (ChunkTP) with blocks=" + std::to_string(l.tp_blocks()) +
                         " is not supported (use SplitTPBlocks, whose blocks divide evenly)");
  }
  if (l.tp_chunked() && l.pad_multiple() > 0) {
    return Bad(spec, "tp_chunk (ChunkTP) with pad_multiple=" + std::to_string(l.pad_multiple()) +
                         " is not supported (torch.chunk slices are uneven, not padded)");
  }
  if (l.dp_chunked() && !l.zero_sharded()) {
    return Bad(spec, "dp_chunk (ChunkDP) is a DP sharding and needs the DP-sharded flag");
  }
  if (l.dp_chunked() && spec.shape.empty()) {
    return Bad(spec,
               "dp_chunk (ChunkDP) cuts dimension 0 and needs a tensor of rank >= 1, "
               "not a scalar (shape [])");
  }
  if (l.dp_chunked() && l.tp_blocks() > 1 && l.tp_dim() == 0) {
    return Bad(spec, "dp_chunk (ChunkDP) with blocks=" + std::to_string(l.tp_blocks()) +
                         " on dimension 0 is not supported (block-interleave another dimension)");
  }
  return Status();
}

}  // namespace

Status ValidateTensorSpec(const TensorSpec& spec) {
  if (spec.name.empty()) return InvalidArgumentError("tensor with an empty name");
  for (int layer : spec.layout.layers()) {
    if (layer < 0) return Bad(spec, "layer=" + std::to_string(layer) + " must be >= 0");
  }
  int64_t bytes = DTypeSize(spec.dtype);
  for (size_t i = 0; i < spec.shape.size(); ++i) {
    if (spec.shape[i] < 0) {
      return Bad(spec, "shape " + ShapeString(spec.shape) + " has negative dimension " +
                           std::to_string(i));
    }
    auto b = CheckedMul(bytes, spec.shape[i], "byte size");
    if (!b.ok()) return Bad(spec, "shape " + ShapeString(spec.shape) + " is too large");
    bytes = *b;
  }
  const int tp_dim = spec.layout.tp_dim();
  if (spec.layout.tp_split() && tp_dim >= static_cast<int>(spec.shape.size())) {
    return Bad(spec, "tp_dim=" + std::to_string(tp_dim) + " is not a dimension of shape " +
                         ShapeString(spec.shape));
  }
  if (tp_dim < -1) return Bad(spec, "tp_dim=" + std::to_string(tp_dim) + " is negative");
  const Layout& l = spec.layout;
  if (l.tp_blocks() < 1) {
    return Bad(spec, "blocks=" + std::to_string(l.tp_blocks()) + " must be >= 1");
  }
  if (l.tp_blocks() > 1 && !l.tp_split()) {
    return Bad(spec, "blocks=" + std::to_string(l.tp_blocks()) + " needs a TP split (tp_dim)");
  }
  if (l.tp_blocks() > 1 && spec.shape[static_cast<size_t>(tp_dim)] % l.tp_blocks() != 0) {
    return Bad(spec, "dimension " + std::to_string(tp_dim) + " of size " +
                         std::to_string(spec.shape[static_cast<size_t>(tp_dim)]) +
                         " is not divisible by blocks=" + std::to_string(l.tp_blocks()));
  }
  if (l.pad_multiple() < 0) {
    return Bad(spec, "pad_multiple=" + std::to_string(l.pad_multiple()) + " must be >= 0");
  }
  if (l.pad_multiple() > 0 && !l.tp_split()) {
    return Bad(spec, "pad_multiple=" + std::to_string(l.pad_multiple()) +
                         " pads the TP-split dimension and needs a TP split (tp_dim)");
  }
  if (l.pad_multiple() > 0 && l.tp_blocks() > 1) {
    return Bad(spec, "pad_multiple with blocks=" + std::to_string(l.tp_blocks()) +
                         " is not supported (pad a dimension that is not block-interleaved)");
  }
  if (l.zero_group() < 0) {
    return Bad(spec, "zero_group=" + std::to_string(l.zero_group()) + " must be >= 0");
  }
  if (l.zero_group() > 0 && !l.zero_sharded()) {
    return Bad(spec, "zero_group=" + std::to_string(l.zero_group()) + " needs ZeRO sharding");
  }
  return ValidateChunks(spec);
}

Status ValidateTensorForConfig(const TensorSpec& spec, const ParallelConfig& config) {
  MORPH_RETURN_IF_ERROR(StageOf(spec, config).status());
  const Layout& l = spec.layout;
  if (l.tp_split()) {
    const int64_t len = spec.shape[static_cast<size_t>(l.tp_dim())];
    if (l.pad_multiple() > 0) {
      const int64_t unit = int64_t{l.pad_multiple()} * config.tp;
      if (len > std::numeric_limits<int64_t>::max() - unit) {
        return Bad(spec,
                   "padded size of dimension " + std::to_string(l.tp_dim()) + " overflows int64");
      }
      const int64_t padded = (len + unit - 1) / unit * unit;
      int64_t bytes = DTypeSize(spec.dtype);
      for (size_t i = 0; i < spec.shape.size(); ++i) {
        auto b = CheckedMul(bytes, i == size_t(l.tp_dim()) ? padded : spec.shape[i]);
        if (!b.ok()) return Bad(spec, "padded size is too large");
        bytes = *b;
      }
    } else if (l.tp_blocks() > 1 && (len / l.tp_blocks()) % config.tp != 0) {
      return Bad(spec, "block size " + std::to_string(len / l.tp_blocks()) + " of dimension " +
                           std::to_string(l.tp_dim()) + " (" + std::to_string(l.tp_blocks()) +
                           " blocks) is not divisible by tp=" + std::to_string(config.tp));
    } else if (!l.tp_chunked() && len % config.tp != 0) {
      return Bad(spec, "dimension " + std::to_string(l.tp_dim()) + " of size " +
                           std::to_string(len) +
                           " is not divisible by tp=" + std::to_string(config.tp));
    }
  }
  if (l.zero_sharded() && l.zero_group() > 0 &&
      (l.zero_group() > config.dp || config.dp % l.zero_group() != 0)) {
    return Bad(spec, "zero_group=" + std::to_string(l.zero_group()) +
                         " does not divide dp=" + std::to_string(config.dp) +
                         (l.dp_chunked() ? " (hybrid ChunkDP" : " (hybrid ZeRO") +
                         " needs dp to be a multiple of its group size)");
  }
  return Status();
}

StatusOr<int> StageOf(const TensorSpec& spec, const ParallelConfig& config) {
  if (config.stage_of_layer.empty()) return 0;
  for (int layer : spec.layout.layers()) {
    if (layer < 0 || layer >= static_cast<int>(config.stage_of_layer.size())) {
      return Bad(spec, "layer=" + std::to_string(layer) + " is not in [0, " +
                           std::to_string(config.stage_of_layer.size()) +
                           ") (the config's stage_of_layer)");
    }
  }
  return config.stage_of_layer[static_cast<size_t>(spec.layout.layer())];
}

int StageOfUnchecked(const TensorSpec& spec, const ParallelConfig& config) {
  if (config.stage_of_layer.empty()) return 0;
  return config.stage_of_layer[static_cast<size_t>(spec.layout.layer())];
}

std::vector<int> StagesOfUnchecked(const TensorSpec& spec, const ParallelConfig& config) {
  std::vector<int> out{StageOfUnchecked(spec, config)};
  if (config.stage_of_layer.empty()) return out;
  for (int l : spec.layout.extra_layers()) {
    out.push_back(config.stage_of_layer[static_cast<size_t>(l)]);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

bool OnStageUnchecked(const TensorSpec& spec, const ParallelConfig& config, int p) {
  if (StageOfUnchecked(spec, config) == p) return true;
  if (config.stage_of_layer.empty()) return false;
  for (int l : spec.layout.extra_layers()) {
    if (config.stage_of_layer[static_cast<size_t>(l)] == p) return true;
  }
  return false;
}

TensorSpec PlanningSpec(const TensorSpec& spec) {
  const int k = spec.layout.tp_blocks();
  if (k <= 1 || !spec.layout.tp_split()) return spec;
  TensorSpec p = spec;
  const size_t dim = static_cast<size_t>(spec.layout.tp_dim());
  p.shape[dim] = k;
  p.shape.insert(p.shape.begin() + static_cast<std::ptrdiff_t>(dim) + 1, spec.shape[dim] / k);
  p.layout = spec.layout.SplitTPBlocks(static_cast<int>(dim) + 1, 1);
  return p;
}

std::vector<int64_t> PlanShape(const TensorSpec& spec) {
  if (spec.layout.tp_blocks() <= 1) return spec.shape;
  return PlanningSpec(spec).shape;
}

Box StateBox(const TensorSpec& spec) { return Box::FromShape(PlanShape(spec)); }

int64_t SplitLength(const TensorSpec& spec, const ParallelConfig& config) {
  const int64_t len = spec.shape[static_cast<size_t>(spec.layout.tp_dim())];
  if (spec.layout.pad_multiple() <= 0) return len;
  const int64_t unit = int64_t{spec.layout.pad_multiple()} * config.tp;
  return (len + unit - 1) / unit * unit;
}

int64_t TpSliceWidth(const TensorSpec& spec, const ParallelConfig& config) {
  if (spec.layout.tp_chunked()) {
    const int64_t len = spec.shape[static_cast<size_t>(spec.layout.tp_dim())];
    return (len + config.tp - 1) / config.tp;
  }
  return SplitLength(spec, config) / config.tp;
}

Interval TpSlice(const TensorSpec& spec, const ParallelConfig& config, int t) {
  const int64_t w = TpSliceWidth(spec, config), end = SplitLength(spec, config);
  return {std::min(w * t, end), std::min(w * (t + 1), end)};
}

int ZeroGroupSize(const Layout& layout, const ParallelConfig& config) {
  return layout.zero_group() > 0 ? layout.zero_group() : config.dp;
}

std::vector<Box> RealBoxes(const TensorSpec& spec, const Box& plan_box) {
  if (spec.layout.tp_blocks() <= 1 || !spec.layout.tp_split()) return {plan_box};
  const int k = spec.layout.tp_dim();
  const int64_t block = spec.shape[static_cast<size_t>(k)] / spec.layout.tp_blocks();
  const Interval blocks = plan_box.dim(k), in = plan_box.dim(k + 1);
  auto real = [&](Interval j, Interval r) {
    std::vector<Interval> dims(plan_box.dims().begin(), plan_box.dims().end());
    dims.erase(dims.begin() + k);
    dims[static_cast<size_t>(k)] = {j.begin * block + r.begin, (j.end - 1) * block + r.end};
    return Box(std::move(dims));
  };
  if (plan_box.empty()) return {};
  std::vector<Box> out;
  // One real box when the in-block range is the whole block (consecutive blocks merge), or when
  // one block is touched; else one per block.
  if ((in.begin == 0 && in.end == block) || blocks.size() == 1) {
    out.push_back(real(blocks, in));
    return out;
  }
  for (int64_t j = blocks.begin; j < blocks.end; ++j) out.push_back(real({j, j + 1}, in));
  return out;
}

Box TpBoxOf(const TensorSpec& spec, const ParallelConfig& config, int t) {
  if (spec.layout.tp_blocks() > 1) return TpBoxOf(PlanningSpec(spec), config, t);
  Box box = Box::FromShape(spec.shape);
  if (spec.layout.tp_split()) box.dim(spec.layout.tp_dim()) = TpSlice(spec, config, t);
  return box;
}

Shard ShardOfUnchecked(const TensorSpec& spec, const ParallelConfig& config, int rank) {
  if (spec.layout.tp_blocks() > 1) return ShardOfUnchecked(PlanningSpec(spec), config, rank);
  const ParallelConfig::Coords c = config.CoordsOf(rank);
  Shard s;
  s.frame = TpBoxOf(spec, config, c.t);
  if (!OnStageUnchecked(spec, config, c.p)) return s;
  if (spec.layout.zero_sharded()) {
    const DpCut cut = DpCutOf(spec.layout, config, s.frame);
    const Interval r = cut.Range(c.d % cut.groups);
    s.flat_begin = r.begin;
    s.flat_end = r.end;
  } else {
    s.flat_end = 1;
    for (const Interval& i : s.frame.dims()) s.flat_end *= i.size();
  }
  return s;
}

StatusOr<Shard> ShardOf(const TensorSpec& spec, const ParallelConfig& config, int rank) {
  MORPH_RETURN_IF_ERROR(config.Validate());
  MORPH_RETURN_IF_ERROR(ValidateTensorSpec(spec));
  MORPH_RETURN_IF_ERROR(ValidateTensorForConfig(spec, config));
  if (rank < 0 || rank >= config.world()) {
    return InvalidArgumentError("rank=" + std::to_string(rank) +
                                " is not in [0, world=" + std::to_string(config.world()) + ")");
  }
  return ShardOfUnchecked(spec, config, rank);
}

int64_t TensorBytes(const TensorSpec& spec) {
  int64_t n = DTypeSize(spec.dtype);
  for (int64_t d : spec.shape) n *= d;
  return n;
}

int64_t StateElements(const TensorSpec& spec, const Shard& shard) {
  if (spec.layout.pad_multiple() <= 0) return shard.NumElements();
  const Box state = StateBox(spec);
  if (state.Contains(shard.frame)) return shard.NumElements();
  int64_t n = 0;
  for (const Box& b : IntersectShard(shard, state)) {
    int64_t e = 1;
    for (const Interval& i : b.dims()) e *= i.size();
    n += e;
  }
  return n;
}

Status TensorRegistry::Add(TensorSpec spec) {
  MORPH_RETURN_IF_ERROR(ValidateTensorSpec(spec));
  if (index_.count(spec.name)) {
    return AlreadyExistsError("tensor '" + spec.name + "' is already registered");
  }
  index_.emplace(spec.name, size());
  tensors_.push_back(std::move(spec));
  return Status();
}

StatusOr<int> TensorRegistry::IndexOf(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return NotFoundError("unknown tensor '" + std::string(name) + "'");
  return it->second;
}

StatusOr<const TensorSpec*> TensorRegistry::Find(std::string_view name) const {
  MORPH_ASSIGN_OR_RETURN(int i, IndexOf(name));
  return &tensors_[static_cast<size_t>(i)];
}

Status TensorRegistry::ValidateFor(const ParallelConfig& config) const {
  MORPH_RETURN_IF_ERROR(config.Validate());
  for (const TensorSpec& t : tensors_) MORPH_RETURN_IF_ERROR(ValidateTensorForConfig(t, config));
  return Status();
}

}  // namespace morph
