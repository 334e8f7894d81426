#include "runtime/recovery/checkpointer.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "reshard/layout.h"
#include "reshard/strided_copy.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace morph {
namespace {

namespace fs = std::filesystem;

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Whether `rank` is the holder of its shard of `spec` that saves it: the first replica.
bool SavesReplica(const TensorSpec& spec, const ParallelConfig& config, int rank) {
  const ParallelConfig::Coords c = config.CoordsOf(rank);
  const Layout& l = spec.layout;
  if (!l.tp_split() && c.t != 0) return false;
  const int groups = l.zero_sharded() ? ZeroGroupSize(l, config) : 1;
  if (c.d >= groups) return false;
  const std::vector<int> stages = StagesOfUnchecked(spec, config);
  return !stages.empty() && stages.front() == c.p;
}

}  // namespace

// How a tensor is described to the checkpoint format: planning coordinates (layout.h), padded
// frames bounded by the config's padded size.
TensorInfo CheckpointTensorInfo(const TensorSpec& spec, const ParallelConfig& config) {
  const TensorSpec plan = PlanningSpec(spec);
  TensorInfo info{spec.name, spec.dtype, plan.shape, {}};
  if (plan.layout.pad_multiple() > 0) {
    info.padded_shape = plan.shape;
    const size_t k = static_cast<size_t>(plan.layout.tp_dim());
    info.padded_shape[k] = SplitLength(plan, config);
  }
  return info;
}


StatusOr<std::vector<CheckpointPiece>> CheckpointPieces(const StateStore& state,
                                                        const ParallelConfig& config, int rank) {
  std::vector<CheckpointPiece> pieces;
  const std::vector<TensorSpec>& specs = state.tensors();
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name.starts_with(kScalarTensorPrefix)) {
      return InvalidArgumentError("checkpoint: tensor '" + specs[i].name + "' uses the prefix '" +
                                  std::string(kScalarTensorPrefix) + "' reserved for scalars");
    }
    const State::TensorRef ref = state.TensorAt(i);
    if (ref.shard.empty() || !SavesReplica(specs[i], config, rank)) continue;
    pieces.push_back({CheckpointTensorInfo(specs[i], config), ref.shard, ConstBufferView(ref.data)});
  }
  if (rank == 0) {
    for (size_t i = 0; i < state.scalars().size(); ++i) {
      const ScalarSpec& sc = state.scalars()[i];
      TensorInfo info{std::string(kScalarTensorPrefix) + sc.name, DType::kU8, {sc.bytes}, {}};
      MORPH_ASSIGN_OR_RETURN(Shard whole, Shard::Whole(Box::FromShape({sc.bytes})));
      const std::span<const std::byte> blob = state.ScalarAt(i);
      pieces.push_back(
          {std::move(info), whole, ConstBufferView(blob.data(), blob.size(), MemoryKind::kHost)});
    }
  }
  return pieces;
}

PeriodicCheckpointer::PeriodicCheckpointer(std::string dir, int64_t every, int keep,
                                           int64_t wait_ms, uint64_t max_bytes_per_second)
    : dir_(std::move(dir)),
      every_(every),
      keep_(std::max(1, keep)),
      wait_ms_(wait_ms),
      max_bytes_per_second_(max_bytes_per_second) {}

PeriodicCheckpointer::~PeriodicCheckpointer() {
  running_.reset();  // joins the writer
  JoinRetention();
}

void PeriodicCheckpointer::JoinRetention() {
  if (retention_.joinable()) retention_.join();
}

void PeriodicCheckpointer::StartRetention() {
  JoinRetention();
  const int64_t floor = first_generation_ > 0 ? first_generation_ : lowest_saved_generation_;
  retention_ = std::thread([dir = dir_, keep = keep_, floor, log = log_] {
    StatusOr<int> n = PruneCheckpoints(dir, keep, floor);
    if (!n.ok()) {
      MORPH_LOG(WARNING, log) << "checkpoint retention in " << dir << ": " << n.status();
    } else if (*n > 0) {
      MORPH_VLOG(1, log) << "checkpoint retention deleted " << *n << " folders in " << dir;
    }
  });
}

Status PeriodicCheckpointer::FinishSave(Deadline deadline) {
  if (!running_) return Status::Ok();
  Status s = running_->Wait(deadline);
  if (s.code() == StatusCode::kDeadlineExceeded && deadline.Expired()) {
    return DeadlineExceededError("checkpoint of step " + std::to_string(running_step_) +
                                 " is still being written to " + dir_);
  }
  running_.reset();
  if (!s.ok()) {
    ++saves_failed_;
    last_error_ = s.WithContext("checkpoint of step " + std::to_string(running_step_));
    MORPH_LOG(WARNING, log_) << last_error_;
  } else if (running_rank_ == 0) {
    StartRetention();
  }
  return s;
}

Status PeriodicCheckpointer::Flush(Deadline deadline) {
  Status s = FinishSave(deadline);
  if (s.code() == StatusCode::kDeadlineExceeded && running_) return s;
  JoinRetention();
  return s;
}

Status PeriodicCheckpointer::MaybeSave(int64_t step, int64_t generation, const StateStore& state,
                                       int rank, int world, const ParallelConfig& config) {
  if (!Due(step)) return Status::Ok();
  const auto t0 = std::chrono::steady_clock::now();
  log_.Set(generation, rank, world);
  if (world != config.world() || rank < 0 || rank >= world) {
    return InvalidArgumentError("checkpoint: rank " + std::to_string(rank) + " of world " +
                                std::to_string(world) + " does not fit config " +
                                config.ToString());
  }
  if (state.config() == nullptr || !(*state.config() == config) || state.rank() != rank) {
    return FailedPreconditionError(
        "checkpoint: the state is laid out for " +
        (state.config() ? state.config()->ToString() : std::string("nothing")) + " rank " +
        std::to_string(state.rank()) + ", not " + config.ToString() + " rank " +
        std::to_string(rank));
  }
  if (!state.intact()) {
    return FailedPreconditionError("checkpoint: the state is not intact (a change failed)");
  }
  // The previous save first: every rank saves every due step, so no step is left with some
  // ranks' folders missing forever.
  last_wait_seconds_ = 0;
  if (running_) {
    const auto w0 = std::chrono::steady_clock::now();
    Status s = FinishSave(Deadline::AfterMs(wait_ms_));
    if (s.code() == StatusCode::kDeadlineExceeded && running_) return s;
    const double waited = SecondsSince(w0);
    last_wait_seconds_ = waited;
    if (waited > 1.0 && !warned_slow_) {
      warned_slow_ = true;
      MORPH_LOG(WARNING, log_) << "checkpoint of step " << step << " waited " << waited
                               << " s for the previous save to finish writing: the disk is slower"
                               << " than every " << every_ << " steps";
    }
  }
  MORPH_ASSIGN_OR_RETURN(std::vector<CheckpointPiece> pieces,
                         CheckpointPieces(state, config, rank));
  int64_t bytes = 0;
  for (const CheckpointPiece& p : pieces) bytes += static_cast<int64_t>(p.data.bytes);
  CheckpointSaveOptions options;
  options.snapshot = true;
  options.snapshot_pool = pool_;
  options.max_bytes_per_second = max_bytes_per_second_;
  const std::string config_json = "{\"dp\": " + std::to_string(config.dp) +
                                  ", \"tp\": " + std::to_string(config.tp) +
                                  ", \"pp\": " + std::to_string(config.pp) +
                                  ", \"generation\": " + std::to_string(generation) + "}";
  const std::string path = CheckpointPath(dir_, step, generation);
  MORPH_ASSIGN_OR_RETURN(running_,
                         SaveCheckpointAsync(path, rank, world, step, config_json, pieces, options),
                         "checkpoint of step " << step);
  running_step_ = step;
  running_rank_ = rank;
  if (lowest_saved_generation_ < 0 || generation < lowest_saved_generation_) {
    lowest_saved_generation_ = generation;
  }
  ++saves_started_;
  last_step_ = step;
  last_snapshot_bytes_ = bytes;
  last_blocking_seconds_ = SecondsSince(t0);
  MORPH_VLOG(1, log_) << "checkpoint of step " << step << ": " << bytes << " bytes snapshotted in "
                      << last_blocking_seconds_ << " s, writing to " << path;
  return Status::Ok();
}

Status LoadBoxFromCheckpoint(const CheckpointReader& reader, const TensorSpec& spec,
                             const ParallelConfig& config, const Shard& shard, BufferView dst,
                             const Box& box) {
  const std::string what = "loading " + box.ToString() + " of tensor '" + spec.name + "'";
  MORPH_ASSIGN_OR_RETURN(StridedView to, ViewOf(shard, box), what << " into " << shard.ToString());
  const int es = DTypeSize(spec.dtype);
  if (dst.bytes != static_cast<size_t>(shard.NumElements() * es)) {
    return InvalidArgumentError(what + ": the buffer has " + std::to_string(dst.bytes) +
                                " bytes, shard " + shard.ToString() + " needs " +
                                std::to_string(shard.NumElements() * es));
  }
  MORPH_ASSIGN_OR_RETURN(Shard whole, Shard::Whole(box));
  std::vector<char> tmp(static_cast<size_t>(whole.NumElements() * es));
  MORPH_RETURN_IF_ERROR(reader.Read(CheckpointTensorInfo(spec, config), whole,
                                    BufferView{tmp.data(), tmp.size(), MemoryKind::kHost}))
      << what;
  MORPH_ASSIGN_OR_RETURN(CopyGeometry g, MakeCopyGeometry(to, ContiguousView(box.shape())));
  if (dst.kind == MemoryKind::kHost) {
    HostStridedCopy(g, dst.data, tmp.data(), es, 0, g.num_elements);
    return Status::Ok();
  }
#if MORPH_WITH_CUDA
  // Row by row: lost pieces are rare and small next to a whole restore.
  for (int64_t e = 0; e < g.num_elements; e += g.row) {
    int64_t off = g.dst_offset, rem = e / g.row;
    for (int d = g.outer_rank - 1; d >= 0; --d) {
      off += (rem % g.outer_shape[d]) * g.dst_stride[d];
      rem /= g.outer_shape[d];
    }
    const cudaError_t err = cudaMemcpy(static_cast<char*>(dst.data) + off * es, tmp.data() + e * es,
                                       static_cast<size_t>(g.row * es), cudaMemcpyHostToDevice);
    if (err != cudaSuccess) return InternalError(what + ": " + cudaGetErrorString(err));
  }
  return Status::Ok();
#else
  return FailedPreconditionError(what + ": CUDA memory in a build without CUDA");
#endif
}

Status RestoreFromCheckpoint(const std::string& path, StateStore& state) {
  if (state.config() == nullptr || state.rank() < 0) {
    return FailedPreconditionError("restoring " + path +
                                   ": the state holds no shards (not materialized, or standby)");
  }
  MORPH_ASSIGN_OR_RETURN(CheckpointReader reader, CheckpointReader::Open(path));
  const ParallelConfig& config = *state.config();
  // Registration agreement first, naming the first difference; nothing is written before.
  MORPH_RETURN_IF_ERROR(CheckCheckpointMatches(reader, path, state.tensors(), state.scalars()));
  for (size_t i = 0; i < state.tensors().size(); ++i) {
    State::TensorRef ref = state.TensorAt(i);
    if (ref.shard.empty()) continue;
    MORPH_RETURN_IF_ERROR(reader.Read(CheckpointTensorInfo(*ref.spec, config), ref.shard, ref.data))
        << "restoring tensor '" << ref.spec->name << "' " << ref.shard.ToString() << " from "
        << path;
  }
  for (const ScalarSpec& sc : state.scalars()) {
    MORPH_ASSIGN_OR_RETURN(std::span<std::byte> blob, state.scalar(sc.name));
    MORPH_ASSIGN_OR_RETURN(Shard whole, Shard::Whole(Box::FromShape({sc.bytes})));
    MORPH_RETURN_IF_ERROR(reader.Read(std::string(kScalarTensorPrefix) + sc.name, DType::kU8, whole,
                                      BufferView{blob.data(), blob.size(), MemoryKind::kHost}))
        << "restoring scalar '" << sc.name << "' from " << path;
  }
  return Status::Ok();
}

}  // namespace morph
