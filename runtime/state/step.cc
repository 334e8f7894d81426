#include "morph/step.h"

#include "collectives/groups.h"
#include "morph/dataset_cursor.h"

namespace morph {

const ParallelConfig Step::kNoConfig{};

Communicator& Step::world() const { return groups_->world(); }
Communicator& Step::dp() const { return groups_->dp(); }
Communicator& Step::tp() const { return groups_->tp(); }
Communicator& Step::pp() const { return groups_->pp(); }
std::shared_ptr<Communicator> Step::Shared(const Communicator& c) const {
  return groups_ != nullptr ? groups_->Shared(c) : nullptr;
}

const RankBatch& Step::batch() const {
  if (!batch_ready_ && cursor_ != nullptr && rank_ >= 0) {
    ParallelConfig::Coords c = config_->CoordsOf(rank_);
    batch_ = cursor_->BatchFor(index_, config_->dp, c.d, micro_batch_);
    batch_ready_ = true;
  }
  return batch_;
}

int64_t Step::global_batch() const { return cursor_ ? cursor_->spec().global_batch : 0; }

}  // namespace morph
