// morph/checkpoint.h over the runtime's checkpointer (runtime/recovery/checkpointer.h) and the
// layout-free format (reshard/checkpoint.h).
#include "morph/checkpoint.h"

#include "reshard/checkpoint.h"
#include "reshard/layout.h"
#include "runtime/recovery/checkpointer.h"
#include "runtime/state/state.h"

namespace morph {
namespace {

// The runtime's State is its StateStore (State's constructor is the store's alone).
const StateStore& Store(const State& state) { return static_cast<const StateStore&>(state); }

std::string ConfigJson(const ParallelConfig& c) {
  return "{\"dp\": " + std::to_string(c.dp) + ", \"tp\": " + std::to_string(c.tp) +
         ", \"pp\": " + std::to_string(c.pp) + "}";
}

}  // namespace

Status SaveCheckpoint(const std::string& dir, const State& state, const Step& step) {
  if (step.done() || step.rank() < 0) {
    return InvalidArgumentError("SaveCheckpoint: this worker holds no rank at step " +
                                std::to_string(step.index()));
  }
  MORPH_ASSIGN_OR_RETURN(std::vector<CheckpointPiece> pieces,
                         CheckpointPieces(Store(state), step.config(), step.rank()));
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointSave> save,
                         SaveCheckpointAsync(dir, step.rank(), step.world_size(), step.index(),
                                             ConfigJson(step.config()), pieces));
  return save->Wait(Deadline::Infinite());
}

Status ReadCheckpointShard(const std::string& dir, const State& state, std::string_view name,
                           BufferView dst) {
  MORPH_ASSIGN_OR_RETURN(State::TensorRef ref, const_cast<State&>(state).tensor(name));
  if (ref.shard.empty()) return Status::Ok();
  const int64_t bytes = ref.shard.NumElements() * DTypeSize(ref.spec->dtype);
  if (static_cast<int64_t>(dst.bytes) < bytes) {
    return InvalidArgumentError("ReadCheckpointShard: tensor '" + std::string(name) + "': dst holds " +
                                std::to_string(dst.bytes) + " bytes, its shard " +
                                std::to_string(bytes));
  }
  const ParallelConfig* config = state.config();
  if (config == nullptr) {
    return FailedPreconditionError("ReadCheckpointShard: the state holds no layout yet");
  }
  MORPH_ASSIGN_OR_RETURN(CheckpointReader reader, CheckpointReader::Open(dir));
  return reader.Read(CheckpointTensorInfo(*ref.spec, *config), ref.shard, dst);
}

}  // namespace morph
