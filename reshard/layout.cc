#include "reshard/layout.h"

#include <algorithm>

namespace morph {

std::string Layout::ToString() const {
  return "layer=" + std::to_string(layer_) +
         " tp_dim=" + (tp_dim_ >= 0 ? std::to_string(tp_dim_) : std::string("none")) +
         (zero_ ? " zero" : " replicated");
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

namespace {

Status Bad(const TensorSpec& spec, const std::string& what) {
  return InvalidArgumentError("tensor '" + spec.name + "': " + what);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

Status ValidateTensorSpec(const TensorSpec& spec) {
  if (spec.name.empty()) return InvalidArgumentError("tensor with an empty name");
  if (spec.layout.layer() < 0) {
    return Bad(spec, "layer=" + std::to_string(spec.layout.layer()) + " must be >= 0");
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
  return Status();
}

Status ValidateTensorForConfig(const TensorSpec& spec, const ParallelConfig& config) {
  MORPH_RETURN_IF_ERROR(StageOf(spec, config).status());
  if (spec.layout.tp_split()) {
    const int64_t len = spec.shape[static_cast<size_t>(spec.layout.tp_dim())];
    if (len % config.tp != 0) {
      return Bad(spec, "dimension " + std::to_string(spec.layout.tp_dim()) + " of size " +
                           std::to_string(len) +
                           " is not divisible by tp=" + std::to_string(config.tp));
    }
  }
  return Status();
}

StatusOr<int> StageOf(const TensorSpec& spec, const ParallelConfig& config) {
  const int layer = spec.layout.layer();
  if (config.stage_of_layer.empty()) return 0;
  if (layer < 0 || layer >= static_cast<int>(config.stage_of_layer.size())) {
    return Bad(spec, "layer=" + std::to_string(layer) + " is not in [0, " +
                         std::to_string(config.stage_of_layer.size()) +
                         ") (the config's stage_of_layer)");
  }
  return config.stage_of_layer[static_cast<size_t>(layer)];
}

int StageOfUnchecked(const TensorSpec& spec, const ParallelConfig& config) {
  if (config.stage_of_layer.empty()) return 0;
  return config.stage_of_layer[static_cast<size_t>(spec.layout.layer())];
}

Box TpBoxOf(const TensorSpec& spec, const ParallelConfig& config, int t) {
  Box box = Box::FromShape(spec.shape);
  if (spec.layout.tp_split()) {
    Interval& dim = box.dim(spec.layout.tp_dim());
    const int64_t slice = dim.end / config.tp;
    dim = {slice * t, slice * (t + 1)};
  }
  return box;
}

Shard ShardOfUnchecked(const TensorSpec& spec, const ParallelConfig& config, int rank) {
  const ParallelConfig::Coords c = config.CoordsOf(rank);
  Shard s;
  s.frame = TpBoxOf(spec, config, c.t);
  if (StageOfUnchecked(spec, config) != c.p) return s;
  int64_t n = 1;
  for (const Interval& i : s.frame.dims()) n *= i.size();
  if (spec.layout.zero_sharded()) {
    Interval r = ZeroRange(n, config.dp, c.d);
    s.flat_begin = r.begin;
    s.flat_end = r.end;
  } else {
    s.flat_end = n;
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
