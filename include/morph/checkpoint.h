// Layout-free checkpoints of the registered state (docs/design.md §6): each rank of a generation
// writes its part, and the checkpoint reads back into any configuration. The runtime takes its
// own periodic ones (Options::checkpoint_dir / checkpoint_every) as the last resort of a
// recovery; these calls are for a program's own (an evaluation, a comparison across changes).
//
//   // every rank of the generation, at a step's start (before its update):
//   MORPH_RETURN_IF_ERROR(morph::SaveCheckpoint("/ckpt/step-100", rt->state(), step));
//   // later, in any configuration: this rank's shard of one tensor, as State::tensor holds it
//   MORPH_ASSIGN_OR_RETURN(morph::State::TensorRef w, rt->state().tensor("w"));
//   MORPH_RETURN_IF_ERROR(morph::ReadCheckpointShard("/ckpt/step-100", rt->state(), "w", buf));
//
// Training thread (they read the state).
#ifndef MORPH_CHECKPOINT_H_
#define MORPH_CHECKPOINT_H_

#include <string>
#include <string_view>

#include "morph/api.h"
#include "morph/buffer.h"
#include "morph/state.h"
#include "morph/status.h"
#include "morph/step.h"

namespace morph {

// Writes this rank's part of a checkpoint of `state` as of the start of `step` into `dir`: the
// first replica of each piece it holds (DP rank 0 or the first hybrid ZeRO group, TP rank 0 of an
// unsplit tensor, the first stage holding a tied tensor) and, on rank 0, every scalar, so that
// the parts of every rank together hold each tensor once. Every rank of the generation calls
// it with the same `dir`; the checkpoint is complete once every rank's part is written. Blocks
// until this rank's part is on disk (atomic: a reader sees all of it or none). kInvalidArgument
// for a step that is done() or a worker that holds no rank; the write's errors (kInternal naming
// the file).
MORPH_API Status SaveCheckpoint(const std::string& dir, const State& state, const Step& step);

// Reads into `dst` the elements of tensor `name` that this rank holds now (State::tensor(name):
// its shard, in the state's current configuration, whatever the checkpoint's was), from the
// checkpoint at `dir`. `dst` holds the shard's bytes (host or CUDA memory). kNotFound: no such
// tensor registered, or not saved; kFailedPrecondition: the checkpoint is incomplete; kDataLoss:
// a checksum mismatch or a piece no rank saved; kInvalidArgument: `dst` is too small.
MORPH_API Status ReadCheckpointShard(const std::string& dir, const State& state,
                                     std::string_view name, BufferView dst);

}  // namespace morph

#endif  // MORPH_CHECKPOINT_H_
