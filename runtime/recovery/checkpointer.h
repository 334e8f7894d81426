// Periodic asynchronous checkpoints of a State in the layout-free format (reshard/checkpoint.h):
// the last resort of the failure recovery (docs/design.md §4 "Failure") when every replica of a
// piece is lost, and the source of a cold restart. Loadable into any configuration.
//
//   PeriodicCheckpointer ckpt(opts.checkpoint_dir, opts.checkpoint_every, opts.checkpoint_keep);
//   // at the start of every step, on every rank of the generation (training thread):
//   MORPH_RETURN_IF_ERROR(ckpt.MaybeSave(step, generation, state, rank, world, config));
//   ...
//   // recovery / cold start, any configuration:
//   MORPH_ASSIGN_OR_RETURN(CheckpointRef ref, LatestCompleteCheckpoint(opts.checkpoint_dir));
//   MORPH_RETURN_IF_ERROR(RestoreFromCheckpoint(ref.path, state));   // state at ref.step
//
// On disk: <dir>/step-<step>-g<generation>/rank-NNNNN/{data.bin,checksums.bin,manifest.json}.
// The generation is part of the name because a rollback re-reaches steps already saved (or half
// saved) by an older generation, whose folders must never be mixed with the new ones. What a
// checkpoint of step s holds: the state at the start of step s (before its update), i.e. after
// s steps.
// Each rank saves one replica of what it holds — a piece held by several ranks (DP replicas,
// TP ranks of an unsplit tensor, hybrid-ZeRO groups, stages of a tied tensor) is saved by the
// first holder only (DP rank < ZeRO group count, TP rank 0 of an unsplit tensor, the first
// stage holding it) — so the saved pieces cover each tensor exactly once. Rank 0 also saves
// each scalar blob as a 1-D kU8 tensor named "scalar:<name>" (scalars are equal on all ranks).
#ifndef MORPH_RUNTIME_RECOVERY_CHECKPOINTER_H_
#define MORPH_RUNTIME_RECOVERY_CHECKPOINTER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "morph/deadline.h"
#include "base/logging.h"
#include "morph/parallel_config.h"
#include "morph/status.h"
#include "reshard/checkpoint.h"
#include "runtime/recovery/checkpoint_catalog.h"
#include "runtime/state/state.h"

namespace morph {

// How a tensor is described to the checkpoint format: planning coordinates (reshard/layout.h),
// padded frames bounded by `config`'s padded size.
TensorInfo CheckpointTensorInfo(const TensorSpec& spec, const ParallelConfig& config);

// What `rank` saves of `state` (laid out for `config`/`rank`) into a checkpoint: the first
// replica of each of its shards (see above) and, on rank 0, every scalar, as pieces viewing the
// state's own buffers (valid until the state changes). kInvalidArgument for a tensor named
// "scalar:...". Any thread that may read the state.
StatusOr<std::vector<CheckpointPiece>> CheckpointPieces(const StateStore& state,
                                                        const ParallelConfig& config, int rank);

class PeriodicCheckpointer {
 public:
  // Saves every `every` steps into `dir`, keeping the newest `keep` complete checkpoints
  // (keep < 1 is taken as 1). Disabled (MaybeSave does nothing) when `dir` is empty or
  // every <= 0. `wait_ms` bounds MaybeSave's wait for a previous save still writing.
  // `max_bytes_per_second` caps each save's write rate (CheckpointSaveOptions; 0: no limit).
  PeriodicCheckpointer(std::string dir, int64_t every, int keep, int64_t wait_ms = 600000,
                       uint64_t max_bytes_per_second = 0);
  // Waits for the running save and retention pass (a save cannot be cut short).
  ~PeriodicCheckpointer();
  PeriodicCheckpointer(const PeriodicCheckpointer&) = delete;
  PeriodicCheckpointer& operator=(const PeriodicCheckpointer&) = delete;

  bool enabled() const { return !dir_.empty() && every_ > 0; }
  // Whether MaybeSave(step, ...) saves.
  bool Due(int64_t step) const { return enabled() && step >= 0 && step % every_ == 0; }

  // Called at the start of step `step` on every rank of the generation, training thread, with
  // the generation's rank, world (= config.world()) and config. When Due(step): waits for this
  // rank's previous save if it is still writing (up to wait_ms: a disk slower than the interval
  // slows training down to its speed rather than skipping saves, which would leave some ranks'
  // folders of a step missing forever; logged as a WARNING once), copies this rank's pieces into
  // a host snapshot (one CheckpointSnapshotPool reused from save to save) and returns; the
  // write runs on a background thread. A previous save that failed is logged (WARNING) and
  // counted (saves_failed(), last_error()) but does not fail this call: the next save is still
  // attempted. On rank 0 it then starts a retention pass in the background (PruneCheckpoints
  // over the job's generations: see set_first_generation).
  // Returns: OK (also when not due); kInvalidArgument: rank outside [0, world), world !=
  // config.world(), a tensor named "scalar:..."; kFailedPrecondition: the state is not laid out
  // for (config, rank) or not intact; kDeadlineExceeded: the previous save still writing after
  // wait_ms (nothing started); SaveCheckpointAsync's errors (e.g. kResourceExhausted for the
  // snapshot) with the step as context.
  Status MaybeSave(int64_t step, int64_t generation, const StateStore& state, int rank, int world,
                   const ParallelConfig& config);

  // Waits for the running save (and rank 0's retention pass after it): its Status (OK when
  // none), kDeadlineExceeded if still running at `deadline` (may be called again). Training
  // thread.
  Status Flush(Deadline deadline);

  // The job's first generation (WelcomeMsg::first_generation): retention considers only
  // folders of generation >= it, so an earlier run's checkpoints in `dir` are never deleted.
  // Until set (or when `generation` <= 0): the lowest generation this checkpointer has saved.
  // Training thread.
  void set_first_generation(int64_t generation) { first_generation_ = generation; }

  // Statistics (training thread).
  int64_t saves_started() const { return saves_started_; }
  int64_t saves_failed() const { return saves_failed_; }
  const Status& last_error() const { return last_error_; }
  int64_t last_started_step() const { return last_step_; }
  // Seconds the last MaybeSave that saved kept the caller (wait + snapshot copy), and of those
  // the wait for the previous save.
  double last_blocking_seconds() const { return last_blocking_seconds_; }
  double last_wait_seconds() const { return last_wait_seconds_; }
  // Bytes of the last snapshot (this rank's saved pieces and scalars).
  int64_t last_snapshot_bytes() const { return last_snapshot_bytes_; }

 private:
  // Ends the running save (up to `deadline`): records its failure. kDeadlineExceeded when it
  // is still running.
  Status FinishSave(Deadline deadline);
  void StartRetention();
  void JoinRetention();

  std::string dir_;
  int64_t every_;
  int keep_;
  int64_t wait_ms_;
  uint64_t max_bytes_per_second_;
  LogContext log_{"checkpoint"};
  std::shared_ptr<CheckpointSnapshotPool> pool_ = std::make_shared<CheckpointSnapshotPool>();
  std::unique_ptr<CheckpointSave> running_;
  int64_t first_generation_ = 0;
  int64_t lowest_saved_generation_ = -1;
  int64_t running_step_ = -1;
  int running_rank_ = -1;
  std::thread retention_;
  bool warned_slow_ = false;
  int64_t saves_started_ = 0;
  int64_t saves_failed_ = 0;
  Status last_error_;
  int64_t last_step_ = -1;
  double last_blocking_seconds_ = 0;
  double last_wait_seconds_ = 0;
  int64_t last_snapshot_bytes_ = 0;
};

// Fills every shard `state` holds for its current config/rank (already allocated) and every
// scalar from the checkpoint at `path` (a folder CheckpointPath names). kNotFound: no such
// folder; CheckpointReader::Open's errors (kFailedPrecondition incomplete, kDataLoss naming
// the tensor and the first box no saved piece holds); kFailedPrecondition naming the first
// difference when the checkpoint's tensors or scalars (names, dtypes, shapes, sizes) differ
// from the state's registration; kDataLoss from reads (checksum, truncation); kFailedPrecondition
// when the state holds no layout (not materialized). Training thread (it writes the state).
Status RestoreFromCheckpoint(const std::string& path, StateStore& state);

// Fills only `box` (planning coordinates, e.g. a LocalPlan's `lost` piece) of `shard` of tensor
// `spec` in `dst` (the shard's storage, host or CUDA, laid out for `config`) from `reader`;
// the rest of `dst` is left as it is. kInvalidArgument when `box` is not wholly held by
// `shard`; CheckpointReader::Read's errors (kNotFound: the tensor is not saved; kDataLoss).
// Any thread; distinct boxes may be loaded concurrently.
Status LoadBoxFromCheckpoint(const CheckpointReader& reader, const TensorSpec& spec,
                             const ParallelConfig& config, const Shard& shard, BufferView dst,
                             const Box& box);

}  // namespace morph

#endif  // MORPH_RUNTIME_RECOVERY_CHECKPOINTER_H_
