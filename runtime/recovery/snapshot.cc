#include "runtime/recovery/snapshot.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <map>
#include <tuple>
#include <utility>

#include "collectives/gloo/gloo_communicator.h"
#include "reshard/layout.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace morph {
namespace {

constexpr size_t kAlign = 64;
// Per memcpy (CUDA: per cudaMemcpy); an abort is seen between two (Abort).
constexpr size_t kCopyChunk = size_t{32} << 20;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

Status CopyOut(char* dst, ConstBufferView src, size_t offset, size_t n) {
  if (src.kind == MemoryKind::kHost) {
    std::memcpy(dst, static_cast<const char*>(src.data) + offset, n);
    return Status::Ok();
  }
#if MORPH_WITH_CUDA
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, src.data) == cudaSuccess && attr.device >= 0) {
    cudaSetDevice(attr.device);
  }
  const cudaError_t e =
      cudaMemcpy(dst, static_cast<const char*>(src.data) + offset, n, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    return InternalError(std::string("copying a shard to the snapshot: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
#else
  return FailedPreconditionError("a shard is in CUDA memory but morph was built without CUDA");
#endif
}

// Newest complete slot, or -1.
template <typename S>
int Newest(const std::array<S, 2>& slots) {
  int best = -1;
  for (int i = 0; i < 2; ++i) {
    // By (generation, step): after a rollback a later generation's copy is newer than an
    // older generation's copy of a later step.
    if (slots[i].complete &&
        (best < 0 || std::pair(slots[i].data.generation, slots[i].data.step) >
                         std::pair(slots[best].data.generation, slots[best].data.step))) {
      best = i;
    }
  }
  return best;
}

Status CopyIn(BufferView dst, const void* src, size_t n) {
  if (dst.kind == MemoryKind::kHost) {
    std::memcpy(dst.data, src, n);
    return Status::Ok();
  }
#if MORPH_WITH_CUDA
  const cudaError_t e = cudaMemcpy(dst.data, src, n, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    return InternalError(std::string("copying a snapshot into a shard: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
#else
  return FailedPreconditionError("a shard is in CUDA memory but morph was built without CUDA");
#endif
}

}  // namespace

Status RestoreFromSnapshot(const SnapshotData& snap, StateStore& state) {
  const std::string what = "restoring the snapshot of step " + std::to_string(snap.step) +
                           " (rank " + std::to_string(snap.rank) + ")";
  const auto differ = [&](const std::string& why) {
    return FailedPreconditionError(what + ": the state differs: " + why);
  };
  if (state.config() == nullptr || !(*state.config() == snap.config) || state.rank() != snap.rank) {
    return differ("it is laid out for " +
                  (state.config() ? state.config()->ToString() : std::string("nothing")) +
                  " rank " + std::to_string(state.rank()) + ", the snapshot for " +
                  snap.config.ToString() + " rank " + std::to_string(snap.rank));
  }
  if (state.tensors().size() != snap.shards.size() ||
      state.scalars().size() != snap.scalars.size()) {
    return differ(std::to_string(state.tensors().size()) + " tensors and " +
                  std::to_string(state.scalars().size()) + " scalars, the snapshot " +
                  std::to_string(snap.shards.size()) + " and " +
                  std::to_string(snap.scalars.size()));
  }
  for (size_t i = 0; i < snap.shards.size(); ++i) {
    const State::TensorRef r = state.TensorAt(i);
    if (!(r.shard == snap.shards[i]) || r.data.bytes != snap.tensors[i].bytes) {
      return differ("tensor '" + r.spec->name + "' holds " + r.shard.ToString() +
                    ", the snapshot " + snap.shards[i].ToString());
    }
  }
  for (size_t k = 0; k < snap.scalars.size(); ++k) {
    if (state.ScalarAt(k).size() != snap.scalars[k].size()) {
      return differ("scalar '" + state.scalars()[k].name + "' has " +
                    std::to_string(state.ScalarAt(k).size()) + " bytes, the snapshot " +
                    std::to_string(snap.scalars[k].size()));
    }
  }
  for (size_t i = 0; i < snap.shards.size(); ++i) {
    const State::TensorRef r = state.TensorAt(i);
    if (r.data.bytes == 0) continue;
    MORPH_RETURN_IF_ERROR(CopyIn(r.data, snap.tensors[i].data, r.data.bytes))
        << what << ", tensor '" << r.spec->name << "'";
  }
  for (size_t k = 0; k < snap.scalars.size(); ++k) {
    MORPH_ASSIGN_OR_RETURN(std::span<std::byte> blob, state.scalar(state.scalars()[k].name));
    std::copy(snap.scalars[k].begin(), snap.scalars[k].end(), blob.begin());
  }
  return Status::Ok();
}

std::vector<int> BuddyRanks(std::span<const std::string> host_of_rank) {
  const int n = static_cast<int>(host_of_rank.size());
  std::vector<std::string> hosts;
  std::map<std::string, std::vector<int>> ranks_on;
  for (int r = 0; r < n; ++r) {
    auto& v = ranks_on[host_of_rank[r]];
    if (v.empty()) hosts.push_back(host_of_rank[r]);
    v.push_back(r);
  }
  std::vector<int> order;
  size_t largest = 0;
  for (const std::string& h : hosts) {
    const auto& v = ranks_on[h];
    order.insert(order.end(), v.begin(), v.end());
    largest = std::max(largest, v.size());
  }
  const int shift = static_cast<int>(largest) < n ? static_cast<int>(largest) : 1;
  std::vector<int> buddy(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) buddy[order[j]] = order[(j + shift) % n];
  return buddy;
}

std::vector<bool> BuddyCopiedTensors(std::span<const TensorSpec> tensors,
                                     const ParallelConfig& config, int rank,
                                     std::span<const std::string> host_of_rank) {
  std::vector<bool> out(tensors.size(), true);
  const int world = config.world();
  if (rank < 0 || rank >= world || host_of_rank.size() != static_cast<size_t>(world)) return out;
  const std::string& mine = host_of_rank[static_cast<size_t>(rank)];
  const bool one_host = std::all_of(host_of_rank.begin(), host_of_rank.end(),
                                    [&](const std::string& h) { return h == mine; });
  const ParallelConfig::Coords me = config.CoordsOf(rank);
  // The replicas of a piece differ from this rank only along the axes the layout replicates
  // over: its stages, every TP rank when not split, the DP ranks of the same ZeRO range.
  using Pattern = std::tuple<std::vector<int>, bool, int>;  // stages, TP split, DP stride
  std::map<Pattern, bool> copied;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Layout& l = tensors[i].layout;
    std::vector<int> stages = StagesOfUnchecked(tensors[i], config);
    if (std::find(stages.begin(), stages.end(), me.p) == stages.end()) {
      out[i] = false;  // no piece here
      continue;
    }
    const int stride = l.zero_sharded() ? std::max(1, ZeroGroupSize(l, config)) : 1;
    Pattern key{std::move(stages), l.tp_split(), stride};
    auto [it, fresh] = copied.emplace(key, true);
    if (fresh) {
      for (int p : std::get<0>(key)) {
        for (int d = me.d % stride; d < config.dp && it->second; d += stride) {
          for (int t = 0; t < config.tp && it->second; ++t) {
            if (l.tp_split() && t != me.t) continue;
            const int q = config.RankOf({p, d, t});
            if (q != rank && (one_host || host_of_rank[static_cast<size_t>(q)] != mine)) {
              it->second = false;  // another failure domain holds this piece
            }
          }
        }
      }
    }
    out[i] = it->second;
  }
  return out;
}

std::string BuddySnapshotter::PairName(int a, int b) {
  return "snapshot/" + std::to_string(std::min(a, b)) + "-" + std::to_string(std::max(a, b));
}

BuddySnapshotter::BuddySnapshotter(int64_t every, BuddySnapshotOptions options)
    : every_(every), options_(std::move(options)) {
  if (options_.chunk_bytes == 0) options_.chunk_bytes = size_t{32} << 20;
  if (options_.chunks_per_group == 0) options_.chunks_per_group = 1;
}

BuddySnapshotter::~BuddySnapshotter() { EndGeneration(); }

void BuddySnapshotter::JoinRound() {
  if (round_.joinable()) round_.join();
}

void BuddySnapshotter::EndGeneration() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_) {
      round_aborted_.store(true);
      if (to_buddy_) to_buddy_->Abort();
      if (from_ward_) from_ward_->Abort();
    }
  }
  JoinRound();
  {
    std::lock_guard<std::mutex> lock(mu_);  // Abort() reads them
    to_buddy_.reset();
    from_ward_.reset();
  }
  generation_ = -1;
  buddy_ = ward_ = -1;
  broken_ = Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  copy_status_ = Status::Ok();
  exchange_status_ = Status::Ok();
  copied_ = true;
}

void BuddySnapshotter::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!running_) return;
  round_aborted_.store(true);
  if (to_buddy_) to_buddy_->Abort();
  if (from_ward_) from_ward_->Abort();
}

Status BuddySnapshotter::StartGeneration(Store& store, const SnapshotGeneration& g,
                                         Deadline deadline) {
  EndGeneration();
  const int world = static_cast<int>(g.hosts.size());
  if (g.rank < 0 || g.rank >= world) {
    return InvalidArgumentError("snapshot: rank " + std::to_string(g.rank) +
                                " outside a world of " + std::to_string(world));
  }
  for (size_t r = 0; r < g.hosts.size(); ++r) {
    if (g.hosts[r].empty()) {
      return InvalidArgumentError("snapshot: rank " + std::to_string(r) + " has no host name");
    }
  }
  log_.Set(g.generation, g.rank, world);
  generation_ = g.generation;
  rank_ = g.rank;
  hosts_ = g.hosts;
  if (!enabled() || world == 1) return Status::Ok();
  const std::vector<int> buddies = BuddyRanks(g.hosts);
  buddy_ = buddies[static_cast<size_t>(g.rank)];
  for (int r = 0; r < world; ++r) {
    if (buddies[static_cast<size_t>(r)] == g.rank) ward_ = r;
  }
  auto make = [&](int peer) -> StatusOr<std::unique_ptr<Communicator>> {
    StatusOr<std::unique_ptr<GlooCommunicator>> c = GlooCommunicator::Create(
        store, PairName(g.rank, peer), g.rank < peer ? 0 : 1, 2, options_.device, deadline);
    if (!c.ok()) {
      return c.status().WithContext("snapshot communicator with rank " + std::to_string(peer) +
                                    " (host " + g.hosts[static_cast<size_t>(peer)] + ")");
    }
    return std::unique_ptr<Communicator>(std::move(c).value());
  };
  // Both at once: the pairs form a cycle, so building them one after the other could wait on
  // a peer that waits on its own other pair.
  StatusOr<std::unique_ptr<Communicator>> ward_comm = std::unique_ptr<Communicator>();
  std::thread ward_thread;
  if (ward_ != buddy_) ward_thread = std::thread([&] { ward_comm = make(ward_); });
  StatusOr<std::unique_ptr<Communicator>> buddy_comm = make(buddy_);
  if (ward_thread.joinable()) ward_thread.join();
  if (!buddy_comm.ok() || !ward_comm.ok()) {
    const Status s = !buddy_comm.ok() ? buddy_comm.status() : ward_comm.status();
    generation_ = -1;
    buddy_ = ward_ = -1;
    return s;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);  // Abort() reads them
    to_buddy_ = std::move(buddy_comm).value();
    from_ward_ = std::move(ward_comm).value();
  }
  MORPH_VLOG(1, log_) << "snapshots: buddy rank " << buddy_ << " (host "
                      << hosts_[static_cast<size_t>(buddy_)] << "), ward rank " << ward_;
  return Status::Ok();
}

Status BuddySnapshotter::MaybeBegin(int64_t step, const StateStore& state) {
  Restored restored = std::move(restored_);  // only the next call may use it
  restored_ = Restored();
  if (!Due(step)) return Status::Ok();
  if (generation_ < 0) {
    return FailedPreconditionError("snapshot of step " + std::to_string(step) +
                                   ": no generation started");
  }
  if (state.rank() != rank_ || state.config() == nullptr || !state.intact()) {
    return FailedPreconditionError("snapshot of step " + std::to_string(step) +
                                   ": the state is not laid out for rank " + std::to_string(rank_) +
                                   (state.intact() ? "" : " (not intact)"));
  }
  MORPH_RETURN_IF_ERROR(WaitExchanged(Deadline::After(options_.timeout)))
      << "snapshot of step " << step << ": the previous round";
  JoinRound();
  if (!broken_.ok()) return broken_;

  // Layout of the copy: the tensors that stay here, then those that go to the buddy, then
  // the scalars (so what is sent is one suffix), each 64-byte aligned; a layout change that
  // keeps the first tensors keeps their offsets (the adoption below). Sources are in tensor
  // order, then scalars (Copy fills the views by that index).
  std::vector<bool> sent = to_buddy_
                               ? BuddyCopiedTensors(state.tensors(), *state.config(), rank_, hosts_)
                               : std::vector<bool>(state.tensors().size(), false);
  const size_t nt = state.tensors().size();
  std::vector<Source> sources(nt + state.scalars().size());
  SnapshotData d;
  d.generation = generation_;
  d.step = step;
  d.rank = rank_;
  d.config = *state.config();
  size_t off = 0;
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) d.sent_offset = static_cast<int64_t>(off);
    for (size_t i = 0; i < nt; ++i) {
      if (sent[i] != (pass == 1)) continue;
      const State::TensorRef ref = state.TensorAt(i);
      sources[i] = {ConstBufferView(ref.data), off};
      off = AlignUp(off + ref.data.bytes);
    }
  }
  for (size_t k = 0; k < state.scalars().size(); ++k) {
    const std::span<const std::byte> blob = state.ScalarAt(k);
    sources[nt + k] = {ConstBufferView(blob.data(), blob.size(), MemoryKind::kHost), off};
    off = AlignUp(off + blob.size());
  }
  for (size_t i = 0; i < nt; ++i) {
    d.shards.push_back(state.TensorAt(i).shard);
    d.tensors.emplace_back(nullptr, sources[i].view.bytes, MemoryKind::kHost);
  }
  d.scalars.resize(state.scalars().size());
  d.bytes = static_cast<int64_t>(off);
  d.sent_bytes = to_buddy_ ? d.bytes - d.sent_offset : 0;
  std::lock_guard<std::mutex> lock(mu_);
  const int newest_local = Newest(local_);
  size_t ls = newest_local == 0 ? 1 : 0;
  // Adoption (NoteRestored): the state was just restored from this rank's local copy of this
  // step, and the tensors it lists hold exactly that copy's bytes: the new copy goes into
  // that slot, and those tensors, at the same offset with the same shard, are not copied
  // again (a copy of the previous generation is never read once the change applied). A
  // sample of each is compared first.
  if (restored.step == step) {
    for (size_t i = 0; i < local_.size(); ++i) {
      const Slot& old = local_[i];
      if (!old.complete || old.data.step != step || old.data.generation != restored.generation ||
          old.data.shards.size() != nt || old.buffer.data() == nullptr) {
        continue;
      }
      ls = i;
      const char* obase = static_cast<const char*>(old.buffer.data());
      for (size_t t = 0; t < nt && t < restored.tensors.size(); ++t) {
        const ConstBufferView& was = old.data.tensors[t];
        const Source& src = sources[t];
        if (!restored.tensors[t] || src.view.bytes == 0 || src.view.kind != MemoryKind::kHost ||
            !(old.data.shards[t] == d.shards[t]) || was.bytes != src.view.bytes ||
            static_cast<const char*>(was.data) - obase != static_cast<ptrdiff_t>(src.offset)) {
          continue;
        }
        const size_t n = std::min<size_t>(src.view.bytes, 64);
        const char* live = static_cast<const char*>(src.view.data);
        const char* kept = static_cast<const char*>(was.data);
        if (std::memcmp(live, kept, n) == 0 &&
            std::memcmp(live + src.view.bytes - n, kept + src.view.bytes - n, n) == 0) {
          sources[t].in_place = true;
        }
      }
      break;
    }
  }
  local_[ls].complete = false;
  local_[ls].data = std::move(d);
  running_ = true;
  copied_ = false;
  round_aborted_.store(false);
  copy_status_ = Status::Ok();
  exchange_status_ = Status::Ok();
  round_ = std::thread([this, step, gen = generation_, sources = std::move(sources), ls,
                        sent = std::move(sent)]() mutable {
    Round(step, gen, std::move(sources), ls, std::move(sent));
  });
  return Status::Ok();
}

// A buffer that must grow (a new layout after a change) keeps its pages, already faulted in:
// only the growth is new memory (on this VM a fresh page costs about as much as copying it).
Status BuddySnapshotter::EnsureSize(Buffer& b, size_t bytes) {
  bytes = std::max(bytes, kAlign);
  if (b.data() != nullptr && b.size() >= bytes) return Status::Ok();
  MORPH_ASSIGN_OR_RETURN(Buffer grown, HostAllocator()(bytes));
  if (b.size() > 0 && b.page_mapped() && grown.page_mapped()) {
    (void)MovePages(b, grown, 0);  // on failure b keeps its pages and is freed below
  }
  std::lock_guard<std::mutex> lock(mu_);  // memory_bytes() reads the size
  b = std::move(grown);
  return Status::Ok();
}

Status BuddySnapshotter::Copy(std::vector<Source>& sources, Slot& slot) {
  SnapshotData& d = slot.data;
  const size_t total = static_cast<size_t>(d.bytes);
  MORPH_RETURN_IF_ERROR(EnsureSize(slot.buffer, total))
      << "snapshot buffer of " << total << " bytes";
  // Only the copy holds the training thread (BeginUpdate waits for it), so it is one pass:
  // whole shards in one memcpy each (glibc streams copies this large past the cache, with
  // non-temporal stores), the checksum later, on this thread, while the exchange runs.
  char* base = static_cast<char*>(slot.buffer.data());
  const size_t nt = d.tensors.size();
  std::vector<size_t> order(sources.size());  // by offset, to zero the alignment padding
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return sources[a].offset < sources[b].offset; });
  size_t at = 0;
  int64_t copied = 0;
  for (size_t i : order) {
    const Source& s = sources[i];
    if (!s.in_place) copied += static_cast<int64_t>(s.view.bytes);
    if (s.offset > at) std::memset(base + at, 0, s.offset - at);  // alignment padding
    for (size_t done = 0; done < s.view.bytes && !s.in_place; done += kCopyChunk) {
      if (round_aborted_.load(std::memory_order_relaxed)) {
        return AbortedError("the local copy was aborted (a failure or a change)");
      }
      const size_t n = std::min(kCopyChunk, s.view.bytes - done);
      MORPH_RETURN_IF_ERROR(CopyOut(base + s.offset + done, s.view, done, n));
      if (options_.after_chunk_copied) options_.after_chunk_copied(d.step);
    }
    at = std::max(at, s.offset + s.view.bytes);
    if (i < nt) {
      d.tensors[i] = ConstBufferView(s.view.bytes ? base + s.offset : nullptr, s.view.bytes,
                                     MemoryKind::kHost);
    } else {
      d.scalars[i - nt] = std::span<const std::byte>(
          reinterpret_cast<const std::byte*>(base + s.offset), s.view.bytes);
    }
  }
  if (total > at) std::memset(base + at, 0, total - at);
  std::lock_guard<std::mutex> lock(mu_);
  copied_bytes_ = copied;
  return Status::Ok();
}

void BuddySnapshotter::Round(int64_t step, int64_t generation, std::vector<Source> sources,
                             size_t ls, std::vector<bool> sent) {
  Slot& local = local_[ls];
  Status copy = Copy(sources, local);
  size_t hs = 0;
  bool aborted = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // An aborted round completes nothing and leaves the held copies alone: a recovery may
    // have read which copies are complete right after Abort, without waiting for this thread
    // (the runtime's EndSnapshots).
    aborted = round_aborted_.load();
    local.complete = copy.ok() && !aborted;
    copied_ = true;
    if (copy.ok() && aborted)
      copy = AbortedError("the local copy was aborted (a failure or a change)");
    copy_status_ = copy.WithContext("snapshot of step " + std::to_string(step));
    if (copy.ok() && !aborted) {
      hs = Newest(held_) == 0 ? 1 : 0;
      held_[hs].complete = false;
    }
    cv_.notify_all();
  }
  Status ex;
  if (!copy.ok()) {
    // The buddy expects this round's messages: fail its side too rather than let it wait.
    if (to_buddy_) to_buddy_->Abort();
    if (from_ward_) from_ward_->Abort();
    ex = copy_status_;
  } else if (to_buddy_) {
    ex = Exchange(step, generation, local, hs, sent);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (ex.ok() && round_aborted_.load())
    ex = AbortedError("snapshot of step " + std::to_string(step) + ": aborted");
  if (ex.ok() && to_buddy_) held_[hs].complete = true;
  exchange_status_ = ex;
  if (!ex.ok()) {
    broken_ = ex;
    MORPH_LOG(INFO, log_) << ex;
  }
  running_ = false;
  cv_.notify_all();
}

Status BuddySnapshotter::WaitCopied(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline.when(), [&] { return copied_; })) {
    return DeadlineExceededError("snapshot: the local copy is still running at its deadline");
  }
  return copy_status_;
}

Status BuddySnapshotter::WaitExchanged(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline.when(), [&] { return !running_; })) {
    return DeadlineExceededError("snapshot: the exchange with the buddy is still running");
  }
  return exchange_status_;
}

int64_t BuddySnapshotter::local_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int i = Newest(local_);
  return i < 0 ? -1 : local_[i].data.step;
}

int64_t BuddySnapshotter::held_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int i = Newest(held_);
  return i < 0 ? -1 : held_[i].data.step;
}

int BuddySnapshotter::held_rank() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int i = Newest(held_);
  return i < 0 ? -1 : held_[i].data.rank;
}

int64_t BuddySnapshotter::held_generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int i = Newest(held_);
  return i < 0 ? -1 : held_[i].data.generation;
}

namespace {
template <typename S>
std::vector<int64_t> CompleteSteps(const std::array<S, 2>& slots, int64_t generation) {
  std::vector<int64_t> out;
  for (const S& s : slots) {
    if (s.complete && s.data.generation == generation) out.push_back(s.data.step);
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}
}  // namespace

std::vector<int64_t> BuddySnapshotter::LocalSteps(int64_t generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  return CompleteSteps(local_, generation);
}

std::vector<int64_t> BuddySnapshotter::HeldSteps(int64_t generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  return CompleteSteps(held_, generation);
}

void BuddySnapshotter::NoteRestored(int64_t step, int64_t generation, std::vector<bool> tensors) {
  restored_ = {.step = step, .generation = generation, .tensors = std::move(tensors)};
}

std::vector<int64_t> BuddySnapshotter::HeldTensors(int64_t generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  bool first = true;
  for (const Slot& s : held_) {
    if (!s.complete || s.data.generation != generation) continue;
    std::vector<int64_t> mine;
    for (size_t i = 0; i < s.data.shards.size(); ++i) {
      if (!s.data.shards[i].empty()) mine.push_back(static_cast<int64_t>(i));
    }
    if (!first) {
      std::vector<int64_t> both;
      std::set_intersection(out.begin(), out.end(), mine.begin(), mine.end(),
                            std::back_inserter(both));
      mine = std::move(both);
    }
    out = std::move(mine);
    first = false;
  }
  return out;
}

const SnapshotData* BuddySnapshotter::Local(int64_t step, int64_t generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Slot& s : local_) {
    if (s.complete && s.data.step == step && (generation < 0 || s.data.generation == generation)) {
      return &s.data;
    }
  }
  return nullptr;
}

const SnapshotData* BuddySnapshotter::Held(int64_t step, int64_t generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Slot& s : held_) {
    if (s.complete && s.data.step == step && (generation < 0 || s.data.generation == generation)) {
      return &s.data;
    }
  }
  return nullptr;
}

int64_t BuddySnapshotter::copied_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return copied_bytes_;
}

int64_t BuddySnapshotter::memory_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const Slot& s : local_) n += static_cast<int64_t>(s.buffer.size());
  for (const Slot& s : held_) n += static_cast<int64_t>(s.buffer.size());
  return n;
}

}  // namespace morph
