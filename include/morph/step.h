// Step: one training step as the runtime hands it out at BeginStep (docs/design.md §3): the
// step's index, this rank's place in the current generation, its communicators and its samples.
// The global batch is fixed for the run: a rank trains `micro_batches()` micro-batches of at most
// Options::micro_batch samples, so that the DP ranks together consume exactly the step's global
// batch whatever dp is (gradient accumulation absorbs DP changes; scale the loss by
// 1 / global_batch()).
//
// A Step is a view valid until the next BeginStep; it is the training thread's.
#ifndef MORPH_STEP_H_
#define MORPH_STEP_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "morph/api.h"
#include "morph/communicator.h"
#include "morph/parallel_config.h"

namespace morph {

class GroupSet;
class DatasetCursor;

// This rank's samples of one step (its DP slice of the global batch, in the job's fixed global
// sample order).
struct MORPH_API RankBatch {
  int64_t first_position = 0;  // this rank's first position in the global stream
  std::vector<int64_t> samples;
  // `samples` cut into consecutive micro-batches of at most micro_batch samples (empty when
  // this rank has no sample this step: dp > B).
  std::vector<std::vector<int64_t>> micro_batches;
};


class MORPH_API Step {
 public:
  Step() = default;

  // True when this worker left the job at this boundary (nothing to train; Finished()).
  bool done() const { return done_; }
  int64_t index() const { return index_; }
  int64_t generation() const { return generation_; }
  // True on the first step of a generation this worker switched into at this BeginStep.
  bool reconfigured() const { return reconfigured_; }

  const ParallelConfig& config() const { return *config_; }
  int rank() const { return rank_; }
  int world_size() const { return config_->world(); }
  ParallelConfig::Coords coords() const { return config_->CoordsOf(rank_); }

  // The communicators of this generation (GroupSet, collectives/groups.h).
  Communicator& world() const;
  Communicator& dp() const;
  Communicator& tp() const;
  Communicator& pp() const;
  // The shared owner of one of the four above, for owners with lifetimes of their own (a
  // language binding's process group): the object stays valid after this generation ended,
  // aborted then (every later call returns kAborted), instead of being freed under its user.
  // Null for a communicator that is not one of this step's.
  std::shared_ptr<Communicator> Shared(const Communicator& c) const;

  // This rank's samples for this step (its DP slice of the global batch), computed on first use.
  const RankBatch& batch() const;
  const std::vector<int64_t>& samples() const { return batch().samples; }
  int micro_batches() const { return static_cast<int>(batch().micro_batches.size()); }
  int64_t global_batch() const;

 private:
  friend struct StepAccess;
  static const ParallelConfig kNoConfig;
  bool done_ = false;
  bool reconfigured_ = false;
  int64_t index_ = 0;
  int64_t generation_ = 0;
  const ParallelConfig* config_ = &kNoConfig;
  int rank_ = -1;
  int64_t micro_batch_ = 1;
  GroupSet* groups_ = nullptr;
  const DatasetCursor* cursor_ = nullptr;
  mutable bool batch_ready_ = false;
  mutable RankBatch batch_;
};

}  // namespace morph

#endif  // MORPH_STEP_H_
