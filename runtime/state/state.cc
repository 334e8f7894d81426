#include "runtime/state/state.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>

#include "base/cuda_check.h"
#endif

namespace morph {

struct State::Entry {
  MemoryKind memory = MemoryKind::kHost;  // morph-owned storage
  bool adopted = false;
  TensorAllocator allocator;  // adopted only
  Shard shard;                // for config_/rank_
  Buffer data;                // empty when the shard is empty (or released)
};

State::State() = default;
State::~State() = default;

Status State::CheckName(const std::string& name, const char* what) const {
  if (sealed_) {
    return FailedPreconditionError(std::string(what) + " '" + name + "' registered after Start");
  }
  return Status::Ok();
}

Status State::Register(TensorSpec spec, MemoryKind memory, TensorAllocator allocator,
                       bool adopted) {
  MORPH_RETURN_IF_ERROR(CheckName(spec.name, "tensor"));
  MORPH_RETURN_IF_ERROR(ValidateTensorSpec(spec));
  for (const TensorSpec& t : specs_) {
    if (t.name == spec.name) {
      return InvalidArgumentError("tensor '" + spec.name + "' is registered twice");
    }
  }
  if (adopted && (!allocator.allocate || !allocator.release)) {
    return InvalidArgumentError("tensor '" + spec.name + "': allocator needs allocate and release");
  }
#if !MORPH_WITH_CUDA
  if (!adopted && memory == MemoryKind::kCuda) {
    return InvalidArgumentError("tensor '" + spec.name + "': CUDA memory in a build without CUDA");
  }
#endif
  auto e = std::make_unique<Entry>();
  e->memory = memory;
  e->adopted = adopted;
  e->allocator = std::move(allocator);
  specs_.push_back(std::move(spec));
  entries_.push_back(std::move(e));
  return Status::Ok();
}

Status State::AddTensor(std::string name, std::vector<int64_t> shape, DType dtype, Layout layout,
                        MemoryKind memory) {
  return Register(TensorSpec{std::move(name), dtype, std::move(shape), layout}, memory, {},
                  /*adopted=*/false);
}

Status State::AdoptTensor(std::string name, std::vector<int64_t> shape, DType dtype, Layout layout,
                          TensorAllocator allocator) {
  return Register(TensorSpec{std::move(name), dtype, std::move(shape), layout}, MemoryKind::kHost,
                  std::move(allocator), /*adopted=*/true);
}

Status State::AddScalar(std::string name, int64_t bytes) {
  MORPH_RETURN_IF_ERROR(CheckName(name, "scalar"));
  if (name.empty()) return InvalidArgumentError("scalar with an empty name");
  if (bytes < 0 || bytes > kMaxScalarBytes) {
    return InvalidArgumentError("scalar '" + name + "': " + std::to_string(bytes) +
                                " bytes, must be in [0, " + std::to_string(kMaxScalarBytes) + "]");
  }
  for (const ScalarSpec& s : scalar_specs_) {
    if (s.name == name) return InvalidArgumentError("scalar '" + name + "' is registered twice");
  }
  scalar_specs_.push_back(ScalarSpec{std::move(name), bytes});
  scalar_data_.emplace_back(static_cast<size_t>(bytes), std::byte{0});
  return Status::Ok();
}

State::TensorRef StateStore::TensorAt(size_t index) { return RefAt(index); }

State::TensorRef StateStore::TensorAt(size_t index) const { return RefAt(index); }

State::TensorRef State::RefAt(size_t index) const {
  const Entry& e = *entries_[index];
  TensorRef r;
  r.spec = &specs_[index];
  r.shard = e.shard;
  if (e.data.size() > 0) r.data = e.data.view();
  return r;
}

StatusOr<State::TensorRef> State::tensor(std::string_view name) {
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].name == name) return RefAt(i);
  }
  return NotFoundError("no tensor '" + std::string(name) + "' is registered");
}

StatusOr<std::span<std::byte>> State::scalar(std::string_view name) {
  for (size_t i = 0; i < scalar_specs_.size(); ++i) {
    if (scalar_specs_[i].name == name) return std::span<std::byte>(scalar_data_[i]);
  }
  return NotFoundError("no scalar '" + std::string(name) + "' is registered");
}

int64_t State::local_bytes() const {
  int64_t total = 0;
  for (const auto& e : entries_) total += static_cast<int64_t>(e->data.size());
  return total;
}

void StateStore::FillManifest(JobManifest& m) const {
  m.tensors = specs_;
  m.scalars = scalar_specs_;
}

void StateStore::Seal() { sealed_ = true; }

namespace {

Status ZeroFill(BufferView v) {
  if (v.bytes == 0) return Status::Ok();
  if (v.kind == MemoryKind::kHost) {
    std::memset(v.data, 0, v.bytes);
    return Status::Ok();
  }
#if MORPH_WITH_CUDA
  MORPH_CUDA_RETURN_IF_ERROR(cudaMemset(v.data, 0, v.bytes)) << "zero-filling a shard";
  return Status::Ok();
#else
  return FailedPreconditionError("CUDA memory in a build without CUDA");
#endif
}

}  // namespace

int64_t StateStore::AllocationBytes(size_t index, const ParallelConfig& config, int rank,
                                    int64_t bytes) const {
  const Entry& e = *entries_[index];
  const TensorSpec& spec = specs_[index];
  if (!e.adopted || !e.allocator.pad_dp_shards || !spec.layout.zero_sharded() || rank < 0 ||
      bytes == 0) {
    return bytes;
  }
  ParallelConfig::Coords c = config.CoordsOf(rank);
  c.d = 0;
  const int64_t first =
      ShardOfUnchecked(spec, config, config.RankOf(c)).NumElements() * DTypeSize(spec.dtype);
  return std::max(bytes, first);
}

StatusOr<Buffer> StateStore::AllocateShard(size_t index, int64_t bytes, int64_t capacity) const {
  const Entry& e = *entries_[index];
  const std::string& name = specs_[index].name;
  const int64_t ask = std::max(bytes, capacity);
  const auto context = [&] {
    return "allocating " + std::to_string(ask) + " bytes for tensor '" + name + "'";
  };
  if (!e.adopted) {
    Allocator alloc = e.memory == MemoryKind::kCuda ? CudaAllocator()
                      : host_allocator_               ? host_allocator_
                                                      : HostAllocator();
    StatusOr<Buffer> b = alloc(static_cast<size_t>(bytes));
    if (!b.ok()) return b.status().WithContext(context());
    return b;
  }
  StatusOr<BufferView> v = e.allocator.allocate(ask);
  if (!v.ok()) return v.status().WithContext(context());
  const BufferView got = *v;
  if (got.data == nullptr || got.bytes < static_cast<size_t>(ask)) {
    if (got.data != nullptr) e.allocator.release(got);
    return InvalidArgumentError(context() + ": the allocator returned " +
                                std::to_string(got.bytes) + " bytes" +
                                (got.data == nullptr ? " at null" : ""));
  }
  auto release = e.allocator.release;
  return Buffer::Adopt(got.data, static_cast<size_t>(bytes), got.kind,
                       [release, got](void*) { release(got); });
}

void StateStore::ReleaseShard(size_t index) {
  Entry& e = *entries_[index];
  if (e.data.size() > 0 || !e.shard.empty()) intact_ = false;
  e.data = Buffer();
}

Buffer StateStore::TakeShard(size_t index) {
  Entry& e = *entries_[index];
  if (e.data.size() > 0 || !e.shard.empty()) intact_ = false;
  return std::move(e.data);
}

bool StateStore::adopted(size_t index) const { return entries_[index]->adopted; }

bool StateStore::allocator_any_thread(size_t index) const {
  return entries_[index]->adopted && entries_[index]->allocator.any_thread;
}

bool StateStore::pages_movable(size_t index) const {
  const Entry& e = *entries_[index];
  return e.adopted ? static_cast<bool>(e.allocator.move_pages)
                   : e.memory == MemoryKind::kHost && !host_allocator_;
}

Status StateStore::MoveShardPages(size_t index, Buffer& from, Buffer& to, size_t offset) const {
  const Entry& e = *entries_[index];
  if (!e.adopted) return MovePages(from, to, offset);
  return MoveAdoptedPages(index, from.view(), to.view(), offset);
}

Status StateStore::MoveAdoptedPages(size_t index, BufferView from, BufferView to,
                                    size_t offset) const {
  const Entry& e = *entries_[index];
  if (!e.adopted || !e.allocator.move_pages || !e.allocator.move_pages(from, to, offset)) {
    return UnimplementedError("tensor '" + specs_[index].name + "': its allocator did not move " +
                              std::to_string(from.bytes) + " bytes of an old shard's pages");
  }
  return Status::Ok();
}

MemoryKind StateStore::memory_of(size_t index) const {
  const Entry& e = *entries_[index];
  if (e.data.size() > 0) return e.data.kind();
  return e.adopted ? MemoryKind::kHost : e.memory;
}

void StateStore::Install(const ParallelConfig& config, int rank, std::vector<Shard> shards,
                    std::vector<Buffer> buffers) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    entries_[i]->data = std::move(buffers[i]);
    entries_[i]->shard = std::move(shards[i]);
  }
  config_ = config;
  has_config_ = true;
  rank_ = rank;
  intact_ = true;
}

Status StateStore::Materialize(const ParallelConfig& config, int rank) {
  Seal();
  if (has_config_) {
    return FailedPreconditionError("state already materialized for " + config_.ToString() +
                                   " rank " + std::to_string(rank_));
  }
  MORPH_RETURN_IF_ERROR(config.Validate());
  if (rank >= config.world()) {
    return InvalidArgumentError("rank " + std::to_string(rank) + " is outside config " +
                                config.ToString());
  }
  const size_t n = specs_.size();
  std::vector<Shard> shards(n);
  std::vector<Buffer> buffers(n);
  std::optional<MemoryKind> kind;
  std::string first_of_kind;
  for (size_t i = 0; i < n; ++i) {
    const TensorSpec& spec = specs_[i];
    MORPH_RETURN_IF_ERROR(ValidateTensorForConfig(spec, config));
    if (rank < 0) continue;  // standby: nothing here
    shards[i] = ShardOfUnchecked(spec, config, rank);
    const int64_t bytes = shards[i].NumElements() * DTypeSize(spec.dtype);
    if (bytes == 0) continue;
    MORPH_ASSIGN_OR_RETURN(buffers[i], AllocateShard(i, bytes, AllocationBytes(i, config, rank, bytes)));
    if (!kind) {
      kind = buffers[i].kind();
      first_of_kind = spec.name;
    } else if (*kind != buffers[i].kind()) {
      return InvalidArgumentError("tensor '" + spec.name + "' is stored in " +
                                  std::string(MemoryKindName(buffers[i].kind())) + " memory but '" +
                                  first_of_kind + "' in " + std::string(MemoryKindName(*kind)) +
                                  ": one memory kind per worker");
    }
    MORPH_RETURN_IF_ERROR(ZeroFill(buffers[i].view())) << "tensor '" << spec.name << "'";
  }
  Install(config, rank, std::move(shards), std::move(buffers));
  return Status::Ok();
}

}  // namespace morph
