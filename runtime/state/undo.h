// UndoCopy (MORPH_UNDO_COPY, Options::undo_copy): a copy of this rank's shards and scalars taken
// at every BeginUpdate, so that a recovery can put a worker back to the step before its last
// update. Why it is needed: a failure can stop ranks on either side of a step's update (the
// commit vote, an allreduce, completes on the ranks that got every vote, while a peer that died
// sending its vote leaves the others without it); a piece whose other replica was on the dead
// worker then exists at no single step. Docs: docs/design.md "Failures, as built".
//
// The copy overlaps the step's forward/backward: Begin (at BeginStep, once the program has
// shown that it calls BeginUpdate) starts it on a background thread into a spare buffer, Take
// (at BeginUpdate) waits for it and makes it the copy; the state does not change in between
// (runtime.h, BeginUpdate). A step that ends without Take (AbortStep before its update) drops
// the copy in flight (Cancel), and the previous step's copy stays what StepFor and PutBack
// use, exactly as if nothing had been begun. Without Begin, Take copies on the caller's thread.
//
// Host storage only (a tensor in CUDA memory: no copy is taken, with one warning). Memory: two
// more copies of the rank's state (the copy and the spare one being made), allocated once and
// reused while the layout stays. Training thread only (the background thread is internal).
#ifndef MORPH_RUNTIME_STATE_UNDO_H_
#define MORPH_RUNTIME_STATE_UNDO_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "morph/status.h"
#include "runtime/state/state.h"

namespace morph {

class UndoCopy {
 public:
  UndoCopy() = default;
  ~UndoCopy();  // Cancel()
  UndoCopy(const UndoCopy&) = delete;
  UndoCopy& operator=(const UndoCopy&) = delete;

  // Starts copying `state` (the values of step `step`, laid out for generation `generation`) in
  // the background; the caller must not change the state until Take or Cancel. A copy already
  // in flight is cancelled first. kFailedPrecondition naming the tensor when one is not in host
  // memory (nothing begun; Take then returns the same error).
  Status Begin(const StateStore& state, int64_t step, int64_t generation);
  // Makes the copy of step `step` the one StepFor and PutBack use: the one begun for that step
  // and generation (waits for it), else a copy made now. kFailedPrecondition naming the tensor
  // when one is not in host memory (the previous copy is dropped: StepFor returns -1).
  Status Take(StateStore& state, int64_t step, int64_t generation);
  // Stops a copy in flight (within one chunk of its memcpy) and drops it; the last taken copy
  // stays. Nothing when none is in flight.
  void Cancel();
  // The step the copy can put back into `state` now: -1 when there is none, or it was taken in
  // another generation's layout, or a shard's size changed (a failed switch released it).
  int64_t StepFor(StateStore& state, int64_t generation);
  // Puts the copy back (StepFor must have returned its step): every shard and scalar, and the
  // state is whole again.
  void PutBack(StateStore& state);

 private:
  struct Slot {
    int64_t step = -1;
    int64_t generation = -1;
    std::vector<std::vector<std::byte>> tensors;
    std::vector<std::vector<std::byte>> scalars;
  };
  struct Source {
    const std::byte* data;
    size_t bytes;
  };

  // Sizes `slot` for `state` and lists what to copy; kFailedPrecondition for CUDA storage.
  static Status Prepare(const StateStore& state, Slot& slot, std::vector<Source>& tensors);
  // Copies `tensors` into `slot` (false: cancelled) and the scalars.
  bool Fill(const std::vector<Source>& tensors, Slot& slot);

  std::array<Slot, 2> slots_;
  int taken_ = -1;  // the slot holding the copy StepFor and PutBack use
  std::thread worker_;
  std::atomic<bool> cancel_{false};
  bool in_flight_ = false;
  int in_flight_slot_ = -1;
  bool in_flight_ok_ = false;  // written by the worker, read after join
  int64_t in_flight_step_ = -1;
  int64_t in_flight_generation_ = -1;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_STATE_UNDO_H_
