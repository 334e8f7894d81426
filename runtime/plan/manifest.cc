#include "runtime/plan/manifest.h"

#include <set>
#include <sstream>

#include "morph/dtype.h"

namespace morph {
namespace {

std::string Shape(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::string Ints(const std::vector<int>& s) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "}";
  return os.str();
}

template <typename T>
std::string Diff(const std::string& field, const T& a, const T& b) {
  std::ostringstream os;
  os << field << ": " << a << " vs " << b;
  return os.str();
}

std::string TensorDifference(const TensorSpec& a, const TensorSpec& b, size_t index) {
  std::string head = "tensor '" + a.name + "' (#" + std::to_string(index) + "): ";
  if (a.name != b.name) return "tensor #" + std::to_string(index) + ": '" + a.name + "' vs '" +
                                b.name + "' (registration order differs or a tensor is missing)";
  if (a.dtype != b.dtype) {
    return head + "dtype " + std::string(DTypeName(a.dtype)) + " vs " +
           std::string(DTypeName(b.dtype));
  }
  if (a.shape != b.shape) return head + "shape " + Shape(a.shape) + " vs " + Shape(b.shape);
  if (!(a.layout == b.layout)) {
    return head + "layout " + a.layout.ToString() + " vs " + b.layout.ToString();
  }
  return "";
}

}  // namespace

Status ValidateManifest(const JobManifest& m) {
  if (m.backend != "gloo" && m.backend != "nccl") {
    return InvalidArgumentError("backend: '" + m.backend + "' is not gloo or nccl");
  }
  std::set<std::string, std::less<>> names;
  for (const TensorSpec& t : m.tensors) {
    MORPH_RETURN_IF_ERROR(ValidateTensorSpec(t));
    if (!names.insert(t.name).second) {
      return InvalidArgumentError("tensor '" + t.name + "' is registered twice");
    }
  }
  std::set<std::string, std::less<>> scalars;
  for (const ScalarSpec& s : m.scalars) {
    if (s.name.empty()) return InvalidArgumentError("scalar state: empty name");
    if (s.bytes < 0 || s.bytes > kMaxScalarBytes) {
      return InvalidArgumentError("scalar '" + s.name + "': size " + std::to_string(s.bytes) +
                                  " bytes is outside [0, 1 MiB]");
    }
    if (!scalars.insert(s.name).second) {
      return InvalidArgumentError("scalar '" + s.name + "' is registered twice");
    }
  }
  if (m.dataset_samples < 1) {
    return InvalidArgumentError("dataset_samples: must be at least 1, got " +
                                std::to_string(m.dataset_samples));
  }
  if (m.model.global_batch < 1) {
    return InvalidArgumentError("model.global_batch: must be at least 1, got " +
                                std::to_string(m.model.global_batch));
  }
  return Status();
}

std::string FirstDifference(const JobManifest& a, const JobManifest& b) {
  const ModelShape &ma = a.model, &mb = b.model;
  if (ma.num_layers != mb.num_layers) return Diff("model.num_layers", ma.num_layers, mb.num_layers);
  if (ma.num_heads != mb.num_heads) return Diff("model.num_heads", ma.num_heads, mb.num_heads);
  if (ma.tp_candidates != mb.tp_candidates) {
    return "model.tp_candidates: " + Ints(ma.tp_candidates) + " vs " + Ints(mb.tp_candidates);
  }
  if (ma.pp_candidates != mb.pp_candidates) {
    return "model.pp_candidates: " + Ints(ma.pp_candidates) + " vs " + Ints(mb.pp_candidates);
  }
  if (ma.global_batch != mb.global_batch) {
    return Diff("model.global_batch", ma.global_batch, mb.global_batch);
  }
  if (ma.micro_batches != mb.micro_batches) {
    return Diff("model.micro_batches", ma.micro_batches, mb.micro_batches);
  }
  if (ma.zero_stage != mb.zero_stage) return Diff("model.zero_stage", ma.zero_stage, mb.zero_stage);
  if (ma.device_memory_bytes != mb.device_memory_bytes) {
    return Diff("model.device_memory_bytes", ma.device_memory_bytes, mb.device_memory_bytes);
  }
  size_t n = std::min(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < n; ++i) {
    std::string d = TensorDifference(a.tensors[i], b.tensors[i], i);
    if (!d.empty()) return d;
  }
  if (a.tensors.size() != b.tensors.size()) {
    const auto& longer = a.tensors.size() > b.tensors.size() ? a.tensors : b.tensors;
    return "tensor count: " + std::to_string(a.tensors.size()) + " vs " +
           std::to_string(b.tensors.size()) + " (first unmatched: '" + longer[n].name + "')";
  }
  size_t k = std::min(a.scalars.size(), b.scalars.size());
  for (size_t i = 0; i < k; ++i) {
    if (a.scalars[i].name != b.scalars[i].name) {
      return "scalar #" + std::to_string(i) + ": '" + a.scalars[i].name + "' vs '" +
             b.scalars[i].name + "'";
    }
    if (a.scalars[i].bytes != b.scalars[i].bytes) {
      return "scalar '" + a.scalars[i].name + "': " + std::to_string(a.scalars[i].bytes) +
             " bytes vs " + std::to_string(b.scalars[i].bytes) + " bytes";
    }
  }
  if (a.scalars.size() != b.scalars.size()) {
    const auto& longer = a.scalars.size() > b.scalars.size() ? a.scalars : b.scalars;
    return "scalar count: " + std::to_string(a.scalars.size()) + " vs " +
           std::to_string(b.scalars.size()) + " (first unmatched: '" + longer[k].name + "')";
  }
  if (a.dataset_samples != b.dataset_samples) {
    return Diff("dataset_samples", a.dataset_samples, b.dataset_samples);
  }
  if (a.dataset_seed != b.dataset_seed) return Diff("dataset_seed", a.dataset_seed, b.dataset_seed);
  if (a.dataset_shuffle != b.dataset_shuffle) {
    return Diff("dataset_shuffle", a.dataset_shuffle, b.dataset_shuffle);
  }
  if (a.chunk_bytes != b.chunk_bytes) {
    return Diff("chunk_bytes (MORPH_RESHARD_CHUNK_BYTES)", a.chunk_bytes, b.chunk_bytes);
  }
  if (a.staging_bytes != b.staging_bytes) {
    return Diff("staging_bytes (MORPH_RESHARD_STAGING_BYTES)", a.staging_bytes, b.staging_bytes);
  }
  if (a.backend != b.backend) return Diff("backend (MORPH_BACKEND)", a.backend, b.backend);
  return "";
}

StatusOr<int64_t> StateBytesOfRank(const JobManifest& m, const ParallelConfig& config, int rank) {
  int64_t total = 0;
  for (const TensorSpec& t : m.tensors) {
    MORPH_RETURN_IF_ERROR(ValidateTensorForConfig(t, config));
    Shard s = ShardOfUnchecked(t, config, rank);
    total += s.NumElements() * DTypeSize(t.dtype);
  }
  return total;
}

}  // namespace morph
