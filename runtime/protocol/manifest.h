// JobManifest: what every worker of a job registers with the coordinator, and what must be equal
// on all of them (docs/design.md §3, "Registration agreed"): the model's constraints for the
// config planner, the registered tensors (names, shapes, dtypes, layouts), the scalar state
// blobs, the dataset, and the executor options that cut reshard messages. The first worker's
// manifest defines the job's; a worker whose manifest differs is refused at registration with
// an error naming the first difference, before any state moves.
//
//   JobManifest m = state.Manifest();             // on each worker
//   std::string why = FirstDifference(job, m);    // coordinator: "" when equal
//   if (!why.empty()) refuse(FailedPreconditionError("registration differs from the job's: " + why));
//
// Plain values; thread-compatible; any thread.
#ifndef MORPH_RUNTIME_PROTOCOL_MANIFEST_H_
#define MORPH_RUNTIME_PROTOCOL_MANIFEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "reshard/layout.h"

namespace morph {

// A named blob of scalar state (step counters, RNG state, LR-schedule state) kept equal on all
// ranks and handed to joiners. Its size is fixed at registration.
struct ScalarSpec {
  std::string name;
  int64_t bytes = 0;
  friend bool operator==(const ScalarSpec&, const ScalarSpec&) = default;
};

// The config planner's inputs that come from the model (runtime/coordinator/config_planner.h's
// ModelConstraints without its callbacks).
struct ModelShape {
  int num_layers = 1;
  int num_heads = 0;
  std::vector<int> tp_candidates = {1};
  std::vector<int> pp_candidates = {1};
  int64_t global_batch = 1;
  int micro_batches = 1;
  int zero_stage = 0;
  // Per-rank memory available for registered state (0: unlimited). A config fits when every
  // rank's registered shards fit.
  int64_t device_memory_bytes = 0;
  friend bool operator==(const ModelShape&, const ModelShape&) = default;
};

struct JobManifest {
  ModelShape model;
  std::vector<TensorSpec> tensors;  // registration order
  std::vector<ScalarSpec> scalars;  // registration order
  int64_t dataset_samples = 1;      // DatasetSpec::num_samples
  uint64_t dataset_seed = 0;
  bool dataset_shuffle = true;
  // ExecutorOptions that cut messages; equal everywhere (they are part of the plan digest).
  uint64_t chunk_bytes = uint64_t{4} << 20;
  uint64_t staging_bytes = uint64_t{256} << 20;
  // The step communicators' backend ("gloo", "nccl": Options::backend): a group cannot mix them,
  // so a worker with another one is refused at registration instead of timing out in a
  // rendezvous.
  std::string backend = "gloo";
  friend bool operator==(const JobManifest&, const JobManifest&) = default;
};

// kInvalidArgument naming the tensor or field: a tensor that does not validate
// (ValidateTensorSpec), a duplicate tensor or scalar name, an empty scalar name, a scalar of
// negative size or over 1 MiB, dataset_samples < 1, global_batch < 1, a backend other than
// "gloo" or "nccl".
Status ValidateManifest(const JobManifest& m);

// "" when `a` == `b`; otherwise the first difference, naming it, e.g.
// "tensor 'layers.0.w' (#3): shape [4, 8] vs [4, 16]", "tensor count: 12 vs 11 (first missing:
// 'head.w')", "scalar 'rng': 16 bytes vs 8 bytes", "model.global_batch: 512 vs 256".
std::string FirstDifference(const JobManifest& a, const JobManifest& b);

// Bytes of registered tensor state rank `rank` holds under `config` (Σ of its shards).
// kInvalidArgument when a tensor does not fit the config (ValidateTensorForConfig).
StatusOr<int64_t> StateBytesOfRank(const JobManifest& m, const ParallelConfig& config, int rank);

}  // namespace morph

#endif  // MORPH_RUNTIME_PROTOCOL_MANIFEST_H_
