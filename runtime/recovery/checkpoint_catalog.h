// The checkpoint folders of a job (runtime/recovery/checkpointer.h writes them): how they are
// named, which is the newest complete (or intact) one, whether one matches the job's
// registration, and retention. Reads folders and manifests only: the coordinator uses it
// without any worker code (no State).
//
//   MORPH_ASSIGN_OR_RETURN(CheckpointRef ref, LatestCompleteCheckpoint(dir));
//   MORPH_ASSIGN_OR_RETURN(int64_t g, NewestCheckpointGeneration(dir));  // number after it
//   MORPH_ASSIGN_OR_RETURN(int deleted, PruneCheckpoints(dir, /*keep=*/2, first_generation));
//
// On disk: <dir>/step-<step>-g<generation>/rank-NNNNN/{data.bin,checksums.bin,manifest.json}.
// The generation is part of the name because a rollback re-reaches steps already saved (or half
// saved) by an older generation, whose folders must never be mixed with the new ones.
#ifndef MORPH_RUNTIME_RECOVERY_CHECKPOINT_CATALOG_H_
#define MORPH_RUNTIME_RECOVERY_CHECKPOINT_CATALOG_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "morph/status.h"
#include "reshard/checkpoint.h"
#include "runtime/protocol/messages.h"

namespace morph {

// The tensor name under which a scalar blob is saved.
inline constexpr std::string_view kScalarTensorPrefix = "scalar:";

struct CheckpointRef {
  int64_t step = 0;
  int64_t generation = 0;
  std::string path;  // <dir>/step-<step>-g<generation>
};

// The folder of a checkpoint: <dir>/step-<step>-g<generation>.
std::string CheckpointPath(const std::string& dir, int64_t step, int64_t generation);

// The newest complete checkpoint under `dir` (CheckpointReader::Open succeeds; any world size),
// newest by (step, generation), among those of generation >= `min_generation` (a job's own:
// a job started on a folder of an earlier run's checkpoints numbers its generations after
// theirs, NewestCheckpointGeneration). kNotFound naming `dir` when there is none (or no such
// folder). Any thread.
StatusOr<CheckpointRef> LatestCompleteCheckpoint(const std::string& dir,
                                                 int64_t min_generation = 0);

// A checkpoint NewestIntactCheckpoint passed over, and why (kDataLoss: a block that does not
// match its checksum, an unreadable manifest, a truncated file, ...).
struct SkippedCheckpoint {
  CheckpointRef ref;
  Status why;
};

// Resume at start: the newest checkpoint under `dir` (any generation; newest by (step,
// generation)) that is complete and intact. Newest first, each folder is opened (an incomplete
// one, a save cut short, is passed over without a word), given to `check` (e.g. the job's
// registration, CheckCheckpointMatches; its error is returned at once: the newest complete
// checkpoint decides whether the job may start at all), then verified whole
// (CheckpointReader::Verify: its data is read once). A complete one that is damaged (Open or
// Verify fails otherwise) is appended to `skipped` (newest first) and the next older one is
// tried. kNotFound naming `dir` when there is no complete checkpoint; kDataLoss naming the
// newest damaged one when every complete one is damaged. Any thread.
StatusOr<CheckpointRef> NewestIntactCheckpoint(
    const std::string& dir,
    const std::function<Status(const CheckpointReader&, const std::string& path)>& check,
    std::vector<SkippedCheckpoint>* skipped);

// The largest generation a checkpoint folder may name. A job started on a folder numbers its
// generations after the newest one there and must have room to count on: 2^62 leaves more
// generations than any job makes (where 2^63 - 1 would wrap to a negative number).
inline constexpr int64_t kMaxCheckpointGeneration = int64_t{1} << 62;

// The highest generation any checkpoint folder under `dir` names, complete or not (0: none, or
// no such folder). A job that starts on `dir` numbers its generations above it, so that its
// folders never share a name with an earlier run's. A checkpoint folder is named exactly as
// CheckpointPath names it: "step-<step>-g<generation>", both decimal digits without sign or
// leading zero; other names (step-+5-g1, step-05-g1, step-5-g1.old, ...) are not checkpoint
// folders: never counted, loaded or deleted. kFailedPrecondition naming the folder when one is
// named so but its step does not fit in 64 bits or its generation exceeds
// kMaxCheckpointGeneration (the job must not start: it could not number its generations after
// it). Any thread.
StatusOr<int64_t> NewestCheckpointGeneration(const std::string& dir);

// Whether the checkpoint `reader` (at `path`) holds exactly `tensors` and `scalars`: the same
// names, dtypes and (planning) shapes, nothing else. kFailedPrecondition "checkpoint P does not
// match the registered state: tensor 'T' has shape [..], saved as [..]" (or "is F32, saved as
// ...", "is not in it", "it holds 'X', which is not registered"), naming the first difference
// in registration order. Any thread.
Status CheckCheckpointMatches(const CheckpointReader& reader, const std::string& path,
                              const std::vector<TensorSpec>& tensors,
                              const std::vector<ScalarSpec>& scalars);

// How long nothing in an incomplete checkpoint folder of an ended generation must have changed
// before retention takes its save for abandoned (PruneCheckpoints): a writer still alive writes
// its data file continuously, so ten minutes of silence means it died or hangs.
inline constexpr int64_t kAbandonedSaveIdleMs = 10 * 60 * 1000;

// Retention: deletes checkpoint folders under `dir`, considering only those of generation >=
// `min_generation` (the job's own: a job numbers its generations above every folder there when
// it starts, so an earlier run's folders are never touched, whatever their steps). Among those,
// by (step, generation):
//   - the newest `keep` complete ones stay (keep < 1 is taken as 1); older complete ones go;
//   - an incomplete one older than the oldest kept complete one goes only when no rank of its
//     generation can still be writing it: a later step of the same generation is complete (each
//     rank of it saved that step, and a rank saves its steps one after the other), or, for a
//     generation that ended during the save, a later generation has a complete checkpoint and
//     nothing in the folder changed for `idle_ms` (a save killed, or hung, with its generation);
//   - nothing newer than the oldest kept complete one is touched, nor anything when there is no
//     complete one.
// Called by one process (rank 0). Returns the number of folders deleted, or the first deletion
// error (kInternal naming the folder). Any thread.
StatusOr<int> PruneCheckpoints(const std::string& dir, int keep, int64_t min_generation,
                               int64_t idle_ms = kAbandonedSaveIdleMs);

}  // namespace morph

#endif  // MORPH_RUNTIME_RECOVERY_CHECKPOINT_CATALOG_H_
