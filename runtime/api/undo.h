// UndoCopy (MORPH_UNDO_COPY, Options::undo_copy): a copy of this rank's shards and scalars taken
// at every BeginUpdate, so that a recovery can put a worker back to the step before its last
// update. Why it is needed: a failure can stop ranks on either side of a step's update (the
// commit vote, an allreduce, completes on the ranks that got every vote, while a peer that died
// sending its vote leaves the others without it); a piece whose other replica was on the dead
// worker then exists at no single step. Docs: docs/design.md "Failures, as built".
//
// Host storage only (a tensor in CUDA memory: no copy is taken, with one warning). Memory: one
// more copy of the rank's state, allocated once and reused while the layout stays. Training
// thread only.
#ifndef MORPH_RUNTIME_API_UNDO_H_
#define MORPH_RUNTIME_API_UNDO_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/api/state.h"

namespace morph {

class UndoCopy {
 public:
  // Copies `state` (the values of step `step`, laid out for generation `generation`).
  // kFailedPrecondition naming the tensor when one is not in host memory (nothing is kept).
  Status Take(State& state, int64_t step, int64_t generation);
  // The step the copy can put back into `state` now: -1 when there is none, or it was taken in
  // another generation's layout, or a shard's size changed (a failed switch released it).
  int64_t StepFor(State& state, int64_t generation);
  // Puts the copy back (StepFor must have returned its step): every shard and scalar, and the
  // state is whole again.
  void PutBack(State& state);

 private:
  int64_t step_ = -1;
  int64_t generation_ = -1;
  std::vector<std::vector<std::byte>> tensors_;
  std::vector<std::vector<std::byte>> scalars_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_API_UNDO_H_
