#include "runtime/recovery/snapshot.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "collectives/gloo_communicator.h"
#include "reshard/crc32c.h"
#include "reshard/layout.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace morph {
namespace {

constexpr uint64_t kMagic = 0x50414e5348504d52ull;  // "RMPHSNAP"
constexpr size_t kAlign = 64;
// Per memcpy (CUDA: per cudaMemcpy); an abort is seen between two (Abort).
constexpr size_t kCopyChunk = size_t{32} << 20;

struct Header {
  uint64_t magic = kMagic;
  int64_t generation = 0;
  int64_t step = 0;
  int32_t rank = 0;
  uint32_t crc = 0;
  uint64_t meta_bytes = 0;
  uint64_t payload_bytes = 0;
  uint64_t chunk_bytes = 0;
  uint64_t reserved = 0;
};
static_assert(sizeof(Header) == 64);

// After the payload: its CRC32C, computed while it moved.
constexpr uint64_t kTrailerMagic = 0x4c52545053504d52ull;  // "RMPSPTRL"
struct Trailer {
  uint64_t magic = kTrailerMagic;
  uint64_t payload_bytes = 0;
  uint32_t crc = 0;
  uint32_t reserved = 0;
};

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::string PairName(int a, int b) {
  return "snapshot/" + std::to_string(std::min(a, b)) + "-" + std::to_string(std::max(a, b));
}

// The description of what goes to the buddy (shards, offsets, scalar sizes, config) as int64
// words; a tensor not sent (`sent[i]` false) is described as an empty shard.
std::vector<int64_t> EncodeMeta(const SnapshotData& d, const void* base,
                                const std::vector<bool>& sent) {
  std::vector<int64_t> m;
  const ParallelConfig& c = d.config;
  m.insert(m.end(), {c.dp, c.tp, c.pp, c.zero_stage, c.micro_batches,
                     static_cast<int64_t>(c.stage_of_layer.size())});
  for (int s : c.stage_of_layer) m.push_back(s);
  m.push_back(static_cast<int64_t>(d.shards.size()));
  for (size_t i = 0; i < d.shards.size(); ++i) {
    if (!sent[i]) {
      m.insert(m.end(), {0, 0, 0, 0, 0});  // rank 0, flat [0, 0), no bytes
      continue;
    }
    const Shard& s = d.shards[i];
    m.push_back(s.frame.rank());
    for (const Interval& iv : s.frame.dims()) m.insert(m.end(), {iv.begin, iv.end});
    m.insert(m.end(), {s.flat_begin, s.flat_end});
    const ConstBufferView& v = d.tensors[i];
    m.push_back(v.bytes == 0 ? 0
                             : static_cast<const char*>(v.data) - static_cast<const char*>(base));
    m.push_back(static_cast<int64_t>(v.bytes));
  }
  m.push_back(static_cast<int64_t>(d.scalars.size()));
  for (const auto& s : d.scalars) {
    m.push_back(
        s.empty() ? 0 : reinterpret_cast<const char*>(s.data()) - static_cast<const char*>(base));
    m.push_back(static_cast<int64_t>(s.size()));
  }
  return m;
}

// The inverse, with views into `base` (payload of `bytes`). kDataLoss when inconsistent.
Status DecodeMeta(const std::vector<int64_t>& m, const char* base, int64_t bytes, SnapshotData& d) {
  size_t i = 0;
  auto next = [&](int64_t& v) {
    if (i >= m.size()) return false;
    v = m[i++];
    return true;
  };
  const auto bad = [](const std::string& what) {
    return DataLossError("snapshot description is inconsistent: " + what);
  };
  auto view_ok = [&](int64_t off, int64_t n) { return off >= 0 && n >= 0 && off + n <= bytes; };
  int64_t dp, tp, pp, zs, mb, nl;
  if (!next(dp) || !next(tp) || !next(pp) || !next(zs) || !next(mb) || !next(nl) || nl < 0) {
    return bad("config");
  }
  d.config = ParallelConfig{
      .dp = static_cast<int>(dp), .tp = static_cast<int>(tp), .pp = static_cast<int>(pp)};
  d.config.zero_stage = static_cast<int>(zs);
  d.config.micro_batches = static_cast<int>(mb);
  for (int64_t k = 0; k < nl; ++k) {
    int64_t s;
    if (!next(s)) return bad("stage_of_layer");
    d.config.stage_of_layer.push_back(static_cast<int>(s));
  }
  int64_t nt;
  if (!next(nt) || nt < 0) return bad("tensor count");
  d.shards.clear();
  d.tensors.clear();
  for (int64_t t = 0; t < nt; ++t) {
    int64_t rank;
    if (!next(rank) || rank < 0 || rank > 16) return bad("tensor " + std::to_string(t));
    std::vector<Interval> dims(static_cast<size_t>(rank));
    for (Interval& iv : dims) {
      if (!next(iv.begin) || !next(iv.end)) return bad("tensor " + std::to_string(t));
    }
    Shard s;
    s.frame = Box(std::move(dims));
    int64_t off, n;
    if (!next(s.flat_begin) || !next(s.flat_end) || !next(off) || !next(n) || !view_ok(off, n)) {
      return bad("tensor " + std::to_string(t));
    }
    d.shards.push_back(std::move(s));
    d.tensors.emplace_back(n == 0 ? nullptr : base + off, static_cast<size_t>(n),
                           MemoryKind::kHost);
  }
  int64_t ns;
  if (!next(ns) || ns < 0) return bad("scalar count");
  d.scalars.clear();
  for (int64_t k = 0; k < ns; ++k) {
    int64_t off, n;
    if (!next(off) || !next(n) || !view_ok(off, n)) return bad("scalar " + std::to_string(k));
    d.scalars.emplace_back(reinterpret_cast<const std::byte*>(base + off), static_cast<size_t>(n));
  }
  if (i != m.size()) return bad("trailing words");
  return Status::Ok();
}

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

Status RestoreFromSnapshot(const SnapshotData& snap, State& state) {
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

Status BuddySnapshotter::MaybeBegin(int64_t step, const State& state) {
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

Status BuddySnapshotter::Exchange(int64_t step, int64_t generation, Slot& local, size_t hs,
                                  const std::vector<bool>& sent) {
  Slot& held = held_[hs];
  const std::string buddy_name =
      "rank " + std::to_string(buddy_) + " (host " + hosts_[static_cast<size_t>(buddy_)] + ")";
  const std::string ward_name =
      "rank " + std::to_string(ward_) + " (host " + hosts_[static_cast<size_t>(ward_)] + ")";
  const std::string what = "snapshot of step " + std::to_string(step);
  const bool same = from_ward_ == nullptr;
  const int buddy_peer = rank_ < buddy_ ? 1 : 0;  // the buddy's rank in the pair communicator
  const int ward_peer = rank_ < ward_ ? 1 : 0;
  Communicator& ward_comm = same ? *to_buddy_ : *from_ward_;
  auto tag = [&](Status s, bool sending) {
    const int peer = sending ? buddy_ : ward_;
    CollectiveFailure f;
    if (const CollectiveFailure* cf = s.collective_failure()) f = *cf;
    f.peers = {peer};
    f.group = PairName(rank_, peer);
    return s
        .WithContext(sending ? what + ": sending to buddy " + buddy_name
                             : what + ": receiving the copy of " + ward_name)
        .WithCollectiveFailure(std::move(f));
  };
  // One started piece of the exchange: messages to the buddy and/or from the ward, as one
  // send/recv group per communicator (every message of a group is posted at once).
  struct Started {
    std::unique_ptr<Work> send, recv;
    uint64_t send_end = 0, recv_end = 0;  // payload bytes sent / received once it is done
    std::vector<uint64_t> chunk_ends;     // for after_chunk_sent
  };
  auto start = [&](std::vector<P2POp> sends, std::vector<P2POp> recvs) -> StatusOr<Started> {
    Started st;
    if (same) {
      sends.insert(sends.end(), recvs.begin(), recvs.end());
      if (sends.empty()) return st;
      StatusOr<std::unique_ptr<Work>> w =
          to_buddy_->Start(CollectiveOp::SendRecv(std::move(sends), options_.timeout));
      if (!w.ok()) return tag(w.status(), true);
      st.send = std::move(w).value();
      return st;
    }
    if (!sends.empty()) {
      StatusOr<std::unique_ptr<Work>> w =
          to_buddy_->Start(CollectiveOp::SendRecv(std::move(sends), options_.timeout));
      if (!w.ok()) return tag(w.status(), true);
      st.send = std::move(w).value();
    }
    if (!recvs.empty()) {
      StatusOr<std::unique_ptr<Work>> w =
          ward_comm.Start(CollectiveOp::SendRecv(std::move(recvs), options_.timeout));
      if (!w.ok()) {
        if (st.send) (void)st.send->Wait(Deadline::After(options_.timeout));
        return tag(w.status(), false);
      }
      st.recv = std::move(w).value();
    }
    return st;
  };
  auto finish = [&](Started& st) -> Status {
    const Status ss = st.send ? st.send->Wait(Deadline::After(options_.timeout)) : Status::Ok();
    const Status rs = st.recv ? st.recv->Wait(Deadline::After(options_.timeout)) : Status::Ok();
    if (same && !ss.ok()) return tag(ss, true);  // one group both ways: the same peer
    if (!rs.ok()) return tag(rs, false);         // the ward's failure first: it is what we lose
    if (!ss.ok()) return tag(ss, true);
    return Status::Ok();
  };
  auto send_op = [&](const void* p, size_t n) {
    return P2POp{P2POp::Kind::kSend, buddy_peer, const_cast<void*>(p), n};
  };
  auto recv_op = [&](void* p, size_t n) { return P2POp{P2POp::Kind::kRecv, ward_peer, p, n}; };
  auto transfer = [&](const void* send, size_t send_n, void* recv, size_t recv_n) -> Status {
    MORPH_ASSIGN_OR_RETURN(Started st, start({send_op(send, send_n)}, {recv_op(recv, recv_n)}));
    return finish(st);
  };

  // What goes out: the copy's suffix from sent_offset (offsets in the description are from
  // there).
  const char* base = static_cast<const char*>(local.buffer.data()) + local.data.sent_offset;
  const std::vector<int64_t> meta = EncodeMeta(local.data, base, sent);
  Header mine;
  mine.generation = generation;
  mine.step = step;
  mine.rank = rank_;
  mine.meta_bytes = meta.size() * sizeof(int64_t);
  mine.payload_bytes = static_cast<uint64_t>(local.data.sent_bytes);
  mine.chunk_bytes = options_.chunk_bytes;
  Header theirs;
  MORPH_RETURN_IF_ERROR(transfer(&mine, sizeof(mine), &theirs, sizeof(theirs)));
  if (theirs.magic != kMagic || theirs.generation != generation || theirs.step != step ||
      theirs.rank != ward_ || theirs.meta_bytes % sizeof(int64_t) != 0 || theirs.chunk_bytes == 0 ||
      theirs.meta_bytes > (uint64_t{64} << 20)) {
    return FailedPreconditionError(
        what + ": " + ward_name + " sent a snapshot of generation " +
        std::to_string(theirs.generation) + " step " + std::to_string(theirs.step) + " rank " +
        std::to_string(theirs.rank) +
        " (every rank must snapshot the same steps of the same generation)");
  }
  std::vector<int64_t> their_meta(theirs.meta_bytes / sizeof(int64_t));
  MORPH_RETURN_IF_ERROR(
      transfer(meta.data(), mine.meta_bytes, their_meta.data(), theirs.meta_bytes));
  MORPH_RETURN_IF_ERROR(EnsureSize(held.buffer, static_cast<size_t>(theirs.payload_bytes)))
      << what << ": buffer for the copy of " << ward_name;
  char* in = static_cast<char*>(held.buffer.data());

  // The payload, pipelined: groups of chunks_per_group chunks, the next group queued on the
  // communicators before this thread waits for the previous one, so the wire never waits for
  // a handshake; while a group moves, this thread checksums what it sends and what arrived.
  // The checksums (CRC32C of the whole payload) follow in a trailer.
  const uint64_t group_chunks = std::max<uint64_t>(1, options_.chunks_per_group);
  uint64_t posted_sent = 0, posted_got = 0, crc_sent = 0;
  uint32_t my_crc = 0, their_crc = 0;
  uint64_t checked_got = 0;
  std::deque<Started> flight;
  Status failed;
  // After an error: stop what is still queued or moving. Not waited for: a Gloo wait the abort
  // does not wake would hold this round (and the recovery that ends it) for the op timeout; the
  // buffers stay allocated, the generation's snapshots are broken, and its communicators are
  // destroyed (their op threads joined) before any later round reuses them.
  auto drain = [&]() {
    to_buddy_->Abort();
    if (from_ward_) from_ward_->Abort();
    flight.clear();
  };
  auto complete_front = [&]() -> Status {
    Started st = std::move(flight.front());
    flight.pop_front();
    MORPH_RETURN_IF_ERROR(finish(st));
    if (st.recv_end > checked_got) {
      their_crc = Crc32cExtend(their_crc, in + checked_got, st.recv_end - checked_got);
      checked_got = st.recv_end;
    }
    if (options_.after_chunk_sent) {
      for (uint64_t e : st.chunk_ends) options_.after_chunk_sent(step, static_cast<int64_t>(e));
    }
    return Status::Ok();
  };
  while (posted_sent < mine.payload_bytes || posted_got < theirs.payload_bytes) {
    std::vector<P2POp> sends, recvs;
    std::vector<uint64_t> chunk_ends;
    for (uint64_t c = 0; c < group_chunks; ++c) {
      const uint64_t sn = std::min<uint64_t>(mine.chunk_bytes, mine.payload_bytes - posted_sent);
      const uint64_t rn = std::min<uint64_t>(theirs.chunk_bytes, theirs.payload_bytes - posted_got);
      if (sn > 0) {
        sends.push_back(send_op(base + posted_sent, static_cast<size_t>(sn)));
        posted_sent += sn;
        chunk_ends.push_back(posted_sent);
      }
      if (rn > 0) {
        recvs.push_back(recv_op(in + posted_got, static_cast<size_t>(rn)));
        posted_got += rn;
      }
    }
    StatusOr<Started> st = start(std::move(sends), std::move(recvs));
    if (!st.ok()) {
      drain();
      return st.status();
    }
    st->send_end = posted_sent;
    st->recv_end = posted_got;
    st->chunk_ends = std::move(chunk_ends);
    flight.push_back(std::move(st).value());
    // While it moves: the checksum of what it sends (the local copy does not change).
    my_crc = Crc32cExtend(my_crc, base + crc_sent, posted_sent - crc_sent);
    crc_sent = posted_sent;
    if (flight.size() > 1) {
      if (Status s = complete_front(); !s.ok()) {
        drain();
        return s;
      }
    }
  }
  while (!flight.empty()) {
    if (Status s = complete_front(); !s.ok()) {
      drain();
      return s;
    }
  }
  Trailer my_trailer{.payload_bytes = mine.payload_bytes, .crc = my_crc};
  Trailer their_trailer;
  MORPH_RETURN_IF_ERROR(
      transfer(&my_trailer, sizeof(my_trailer), &their_trailer, sizeof(their_trailer)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    local.data.crc32c = my_crc;
  }
  if (their_trailer.magic != kTrailerMagic || their_trailer.payload_bytes != theirs.payload_bytes) {
    return DataLossError(what + ": the copy of " + ward_name + " ended with a bad trailer");
  }
  if (their_crc != their_trailer.crc) {
    return DataLossError(what + ": the copy of " + ward_name + " arrived with CRC32C " +
                         std::to_string(their_crc) + ", sent with " +
                         std::to_string(their_trailer.crc));
  }
  SnapshotData d;
  d.generation = generation;
  d.step = step;
  d.rank = ward_;
  d.bytes = static_cast<int64_t>(theirs.payload_bytes);
  d.crc32c = their_crc;
  MORPH_RETURN_IF_ERROR(DecodeMeta(their_meta, in, d.bytes, d))
      << what << ": the copy of " << ward_name;
  std::lock_guard<std::mutex> lock(mu_);
  held.data = std::move(d);
  return Status::Ok();
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
