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

// How a tensor is described to the checkpoint format: planning coordinates (layout.h), padded
// frames bounded by the config's padded size.
TensorInfo InfoFor(const TensorSpec& spec, const ParallelConfig& config) {
  const TensorSpec plan = PlanningSpec(spec);
  TensorInfo info{spec.name, spec.dtype, plan.shape, {}};
  if (plan.layout.pad_multiple() > 0) {
    info.padded_shape = plan.shape;
    const size_t k = static_cast<size_t>(plan.layout.tp_dim());
    info.padded_shape[k] = SplitLength(plan, config);
  }
  return info;
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

struct Entry {
  int64_t step = 0;
  int64_t generation = 0;
  std::string path;
  bool operator<(const Entry& o) const {
    return std::tie(step, generation) < std::tie(o.step, o.generation);
  }
};

// A decimal number as CheckpointPath writes one: digits only (no sign, no blank), no leading
// zero. kOther for anything else; kTooBig for such digits beyond int64.
enum class Number { kOk, kTooBig, kOther };
Number ParseDecimal(std::string_view s, int64_t* v) {
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return Number::kOther;
  for (char c : s) {
    if (c < '0' || c > '9') return Number::kOther;
  }
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
  if (ec == std::errc::result_out_of_range) return Number::kTooBig;
  return ec == std::errc() && end == s.data() + s.size() ? Number::kOk : Number::kOther;
}

// Checkpoint folders under `dir`, oldest first (empty when `dir` does not exist), and those named
// like one whose numbers are out of range (a step beyond int64, a generation beyond
// kMaxCheckpointGeneration). Any other name is not a checkpoint folder: not listed.
struct Listing {
  std::vector<Entry> folders;
  std::vector<std::string> out_of_range;
};
Listing ListCheckpoints(const std::string& dir) {
  Listing out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const size_t g = name.find("-g", 5);
    if (!name.starts_with("step-") || g == std::string::npos || !e.is_directory(ec)) continue;
    int64_t step = 0, gen = 0;
    const Number s = ParseDecimal(std::string_view(name).substr(5, g - 5), &step);
    const Number n = ParseDecimal(std::string_view(name).substr(g + 2), &gen);
    if (s == Number::kOther || n == Number::kOther) continue;
    if (s == Number::kTooBig || n == Number::kTooBig || gen > kMaxCheckpointGeneration) {
      out.out_of_range.push_back(e.path().string());
    } else {
      out.folders.push_back({step, gen, e.path().string()});
    }
  }
  std::sort(out.folders.begin(), out.folders.end());
  std::sort(out.out_of_range.begin(), out.out_of_range.end());
  return out;
}

// Whether nothing in `path` (the folder, its rank and temporary folders, their files) was
// modified in the last `ms` milliseconds. False when anything cannot be read.
bool UnchangedFor(const std::string& path, int64_t ms) {
  const auto since = fs::file_time_type::clock::now() - std::chrono::milliseconds(ms);
  std::error_code ec;
  if (fs::last_write_time(path, ec) > since || ec) return false;
  for (auto it = fs::recursive_directory_iterator(path, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (it->last_write_time(ec) > since || ec) return false;
  }
  return !ec;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

StatusOr<std::vector<CheckpointPiece>> CheckpointPieces(const State& state,
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
    pieces.push_back({InfoFor(specs[i], config), ref.shard, ConstBufferView(ref.data)});
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

std::string CheckpointPath(const std::string& dir, int64_t step, int64_t generation) {
  return dir + "/step-" + std::to_string(step) + "-g" + std::to_string(generation);
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

Status PeriodicCheckpointer::MaybeSave(int64_t step, int64_t generation, const State& state,
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

StatusOr<CheckpointRef> LatestCompleteCheckpoint(const std::string& dir, int64_t min_generation) {
  std::vector<Entry> all = ListCheckpoints(dir).folders;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->generation < min_generation) continue;
    StatusOr<CheckpointReader> r = CheckpointReader::Open(it->path);
    if (r.ok() && r->step() == it->step) return CheckpointRef{it->step, it->generation, it->path};
  }
  return NotFoundError(
      "no complete checkpoint in " + dir +
      (min_generation > 0 ? " of generation " + std::to_string(min_generation) + " or later" : "") +
      (all.empty() ? "" : " (" + std::to_string(all.size()) + " folders)"));
}

StatusOr<CheckpointRef> NewestIntactCheckpoint(
    const std::string& dir,
    const std::function<Status(const CheckpointReader&, const std::string& path)>& check,
    std::vector<SkippedCheckpoint>* skipped) {
  const std::vector<Entry> all = ListCheckpoints(dir).folders;
  std::vector<SkippedCheckpoint> passed;
  std::optional<CheckpointRef> found;
  for (auto it = all.rbegin(); it != all.rend() && !found; ++it) {
    const CheckpointRef ref{it->step, it->generation, it->path};
    StatusOr<CheckpointReader> r = CheckpointReader::Open(it->path);
    if (r.status().code() == StatusCode::kFailedPrecondition ||
        r.status().code() == StatusCode::kNotFound) {
      continue;  // incomplete (a save cut short, or still being written), or gone
    }
    if (!r.ok()) {
      passed.push_back({ref, r.status()});
    } else if (r->step() != it->step) {
      passed.push_back({ref, DataLossError("it holds step " + std::to_string(r->step()) +
                                           ", its name says " + std::to_string(it->step))});
    } else {
      if (check) {
        MORPH_RETURN_IF_ERROR(check(*r, it->path));
      }
      Status intact = r->Verify();
      if (intact.ok()) {
        found = ref;
      } else {
        passed.push_back({ref, std::move(intact)});
      }
    }
  }
  if (skipped) skipped->insert(skipped->end(), passed.begin(), passed.end());
  if (found) return *found;
  if (!passed.empty()) {
    return DataLossError(
        "no complete checkpoint in " + dir + " is intact: the newest, " + passed.front().ref.path +
        ": " + std::string(passed.front().why.message()) +
        (passed.size() > 1 ? " (and " + std::to_string(passed.size() - 1) + " older ones)" : ""));
  }
  return NotFoundError("no complete checkpoint in " + dir);
}

StatusOr<int64_t> NewestCheckpointGeneration(const std::string& dir) {
  const Listing listing = ListCheckpoints(dir);
  if (!listing.out_of_range.empty()) {
    return FailedPreconditionError(
        "checkpoint folder " + listing.out_of_range.front() +
        " names a step beyond 2^63 - 1 or a generation beyond " +
        std::to_string(kMaxCheckpointGeneration) +
        ": a job numbers its generations after the newest one there and cannot count past it "
        "(rename or remove the folder)");
  }
  int64_t newest = 0;
  for (const Entry& e : listing.folders) newest = std::max(newest, e.generation);
  return newest;
}

StatusOr<int> PruneCheckpoints(const std::string& dir, int keep, int64_t min_generation,
                               int64_t idle_ms) {
  keep = std::max(1, keep);
  std::vector<Entry> own;  // oldest first
  for (Entry& e : ListCheckpoints(dir).folders) {
    if (e.generation >= min_generation) own.push_back(std::move(e));
  }
  std::vector<bool> complete(own.size());
  std::map<int64_t, int64_t> newest_complete_step;  // by generation
  int64_t newest_complete_generation = -1;
  for (size_t i = 0; i < own.size(); ++i) {
    complete[i] = CheckpointReader::Open(own[i].path).ok();
    if (!complete[i]) continue;
    int64_t& newest =
        newest_complete_step.try_emplace(own[i].generation, own[i].step).first->second;
    newest = std::max(newest, own[i].step);
    newest_complete_generation = std::max(newest_complete_generation, own[i].generation);
  }
  // Newest first: the first `keep` complete ones stay; the oldest of them bounds the rest.
  int kept = 0;
  size_t oldest_kept = own.size();
  for (size_t j = own.size(); j-- > 0 && kept < keep;) {
    if (!complete[j]) continue;
    ++kept;
    oldest_kept = j;
  }
  // An incomplete save nobody can still be writing (see the header).
  auto abandoned = [&](const Entry& e) {
    auto it = newest_complete_step.find(e.generation);
    if (it != newest_complete_step.end() && it->second > e.step) return true;
    return newest_complete_generation > e.generation && UnchangedFor(e.path, idle_ms);
  };
  int deleted = 0;
  if (oldest_kept == own.size()) return deleted;  // no complete one: nothing may go
  for (size_t j = 0; j < oldest_kept; ++j) {
    if (!complete[j] && !abandoned(own[j])) continue;
    std::error_code ec;
    fs::remove_all(own[j].path, ec);
    if (ec) {
      return InternalError("deleting old checkpoint " + own[j].path + ": " + ec.message());
    }
    ++deleted;
  }
  return deleted;
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
  MORPH_RETURN_IF_ERROR(reader.Read(InfoFor(spec, config), whole,
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

Status CheckCheckpointMatches(const CheckpointReader& reader, const std::string& path,
                              const std::vector<TensorSpec>& tensors,
                              const std::vector<ScalarSpec>& scalars) {
  std::map<std::string, const TensorInfo*, std::less<>> saved;
  for (const TensorInfo& t : reader.tensors()) saved.emplace(t.name, &t);
  const auto differ = [&](const std::string& what) {
    return FailedPreconditionError("checkpoint " + path +
                                   " does not match the registered state: " + what);
  };
  size_t expected = 0;
  for (const TensorSpec& spec : tensors) {
    ++expected;
    // Planning coordinates: the shape the checkpoint format saw (InfoFor without padding).
    const TensorSpec want = PlanningSpec(spec);
    auto it = saved.find(spec.name);
    if (it == saved.end()) return differ("tensor '" + spec.name + "' is not in it");
    if (it->second->dtype != spec.dtype) {
      return differ("tensor '" + spec.name + "' is " + std::string(DTypeName(spec.dtype)) +
                    ", saved as " + std::string(DTypeName(it->second->dtype)));
    }
    if (it->second->shape != want.shape) {
      return differ("tensor '" + spec.name + "' has shape " + ShapeString(want.shape) +
                    ", saved as " + ShapeString(it->second->shape));
    }
  }
  for (const ScalarSpec& sc : scalars) {
    ++expected;
    const std::string name = std::string(kScalarTensorPrefix) + sc.name;
    auto it = saved.find(name);
    if (it == saved.end()) return differ("scalar '" + sc.name + "' is not in it");
    const std::vector<int64_t> want{sc.bytes};
    if (it->second->dtype != DType::kU8 || it->second->shape != want) {
      return differ("scalar '" + sc.name + "' has " + std::to_string(sc.bytes) +
                    " bytes, saved as " + ShapeString(it->second->shape) + " " +
                    std::string(DTypeName(it->second->dtype)));
    }
  }
  if (saved.size() != expected) {
    for (const TensorInfo& t : reader.tensors()) {
      bool known = false;
      for (const TensorSpec& spec : tensors) known = known || spec.name == t.name;
      for (const ScalarSpec& sc : scalars) {
        known = known || t.name == std::string(kScalarTensorPrefix) + sc.name;
      }
      if (!known) return differ("it holds '" + t.name + "', which is not registered");
    }
  }
  return Status::Ok();
}

Status RestoreFromCheckpoint(const std::string& path, State& state) {
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
    MORPH_RETURN_IF_ERROR(reader.Read(InfoFor(*ref.spec, config), ref.shard, ref.data))
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
