// Checks of a JobManifest (runtime/protocol/messages.h), the registration agreement (docs/design.md
// §3, "Registration agreed"): the first worker's manifest defines the job's; a worker whose
// manifest differs is refused at registration with an error naming the first difference, before
// any state moves.
//
//   JobManifest m = state.Manifest();             // on each worker
//   std::string why = FirstDifference(job, m);    // coordinator: "" when equal
//   if (!why.empty()) refuse(FailedPreconditionError("registration differs from the job's: " + why));
//
// Plain values; thread-compatible; any thread.
#ifndef MORPH_RUNTIME_PLAN_MANIFEST_H_
#define MORPH_RUNTIME_PLAN_MANIFEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "morph/status.h"
#include "reshard/layout.h"
#include "runtime/protocol/messages.h"

namespace morph {

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

#endif  // MORPH_RUNTIME_PLAN_MANIFEST_H_
