#include "reshard/executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>

#include "base/logging.h"
#include "base/params.h"
#include "reshard/coverage.h"
#include "reshard/executor_messages.h"
#include "reshard/plan_handshake.h"
#include "reshard/strided_copy.h"

#if MORPH_WITH_CUDA
#include "base/cuda_check.h"
#include "reshard/cuda_pack.h"
#endif

namespace morph {

StatusOr<ExecutorOptions> ExecutorOptions::FromEnv() {
  ExecutorOptions o;
  MORPH_ASSIGN_OR_RETURN(o.chunk_bytes, params::ReshardChunkBytes());
  MORPH_ASSIGN_OR_RETURN(o.staging_bytes, params::ReshardStagingBytes());
  return o;
}

uint64_t EffectiveChunkBytes(const ExecutorOptions& options, int /*num_participants*/) {
  uint64_t c = std::min<uint64_t>(options.chunk_bytes, options.staging_bytes / 4);
  c = std::max<uint64_t>(c, 4096);
  return c / 64 * 64;
}

uint64_t MessageLayoutDigest(const ExecutorOptions& options, int num_participants) {
  DigestHasher h;
  h.Add(std::string_view("message cuts v2"));  // bump when CutMessages' rule changes
  h.Add(options.chunk_bytes).Add(options.staging_bytes);
  h.Add(EffectiveChunkBytes(options, num_participants));
  return h.value();
}

PlanDigest WithMessageLayout(PlanDigest digest, const ExecutorOptions& options,
                             int num_participants) {
  digest.parts[PlanDigest::kMessageLayout] = MessageLayoutDigest(options, num_participants);
  return digest;
}

int PeersPerGroup(const ExecutorOptions& options, int num_participants) {
  const uint64_t c = EffectiveChunkBytes(options, num_participants);
  const uint64_t fit = std::max<uint64_t>(1, options.staging_bytes / (4 * c));
  return static_cast<int>(std::min<uint64_t>(fit, std::max(1, num_participants - 1)));
}

int MessagesPerGroup(const ExecutorOptions& options, int num_participants) {
  const uint64_t c = EffectiveChunkBytes(options, num_participants);
  const uint64_t p = static_cast<uint64_t>(PeersPerGroup(options, num_participants));
  return static_cast<int>(std::clamp<uint64_t>(options.staging_bytes / (4 * c * p), 1, 1024));
}

std::string ExecutorStats::ToString() const {
  std::ostringstream os;
  os << "sent " << bytes_sent << " B in " << messages_sent << " messages, received "
     << bytes_received << " B in " << messages_received << " messages (" << messages_zero_copy
     << " zero-copy, " << messages_strided << " of them strided), copied " << bytes_copied
     << " B locally, " << rounds << " rounds, staging " << staging_peak_bytes
     << " B; seconds: copy " << copy_seconds << " pack " << pack_seconds << " wait " << wait_seconds
     << " unpack " << unpack_seconds << " total " << total_seconds;
  return os.str();
}

namespace {

using executor_internal::CutMessages;
using executor_internal::Group;
using executor_internal::GroupMessages;
using executor_internal::Message;
using executor_internal::Piece;
using executor_internal::Segment;
using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Copies on the host, or enqueues on a CUDA stream.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual Status Copy(const CopyGeometry& g, void* dst, const void* src, int es, int64_t begin,
                      int64_t end) = 0;
  virtual Status Sync() = 0;
  virtual Allocator StagingAllocator() = 0;
  // Zero-fills the destination side of `g` (padding of a new shard).
  virtual Status Zero(const CopyGeometry& g, void* dst, int es) = 0;
};

// Calls fn(element offset) for the first element of every contiguous run of g's destination.
template <typename Fn>
void ForEachDstRun(const CopyGeometry& g, Fn fn) {
  if (g.num_elements == 0) return;
  int64_t idx[kMaxCopyDims] = {};
  while (true) {
    int64_t off = g.dst_offset;
    for (int d = 0; d < g.outer_rank; ++d) off += idx[d] * g.dst_stride[d];
    fn(off);
    int d = g.outer_rank - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < g.outer_shape[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

class HostEngine final : public CopyEngine {
 public:
  Status Copy(const CopyGeometry& g, void* dst, const void* src, int es, int64_t begin,
              int64_t end) override {
    HostStridedCopy(g, dst, src, es, begin, end);
    return Status();
  }
  Status Sync() override { return Status(); }
  Allocator StagingAllocator() override { return HostAllocator(); }
  Status Zero(const CopyGeometry& g, void* dst, int es) override {
    ForEachDstRun(g, [&](int64_t off) {
      std::memset(static_cast<char*>(dst) + off * es, 0, static_cast<size_t>(g.row * es));
    });
    return Status();
  }
};

#if MORPH_WITH_CUDA
class CudaEngine final : public CopyEngine {
 public:
  ~CudaEngine() override {
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
  }
  Status Init() {
    MORPH_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device_)) << "reshard executor";
    MORPH_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking))
        << "reshard executor";
    return Status();
  }
  Status Copy(const CopyGeometry& g, void* dst, const void* src, int es, int64_t begin,
              int64_t end) override {
    return CudaStridedCopy(g, dst, src, es, begin, end, stream_);
  }
  Status Sync() override {
    MORPH_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_)) << "reshard pack/unpack";
    return Status();
  }
  Allocator StagingAllocator() override { return CudaAllocator(device_); }
  Status Zero(const CopyGeometry& g, void* dst, int es) override {
    Status s;
    ForEachDstRun(g, [&](int64_t off) {
      if (!s.ok()) return;
      const cudaError_t e = cudaMemsetAsync(static_cast<char*>(dst) + off * es, 0,
                                            static_cast<size_t>(g.row * es), stream_);
      if (e != cudaSuccess) {
        s = InternalError(std::string("cudaMemsetAsync of new-shard padding: ") +
                          cudaGetErrorString(e));
      }
    });
    return s;
  }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};
#endif

// Fixed-size staging buffers, reused across rounds.
class StagingPool {
 public:
  StagingPool(Allocator alloc, size_t chunk) : alloc_(std::move(alloc)), chunk_(chunk) {}
  StatusOr<char*> Acquire() {
    if (free_.empty()) {
      MORPH_ASSIGN_OR_RETURN(Buffer b, alloc_(chunk_), "allocating reshard staging");
      free_.push_back(static_cast<char*>(b.data()));
      owned_.push_back(std::move(b));
    }
    char* p = free_.back();
    free_.pop_back();
    in_use_ += chunk_;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void Release(char* p) {
    free_.push_back(p);
    in_use_ -= chunk_;
  }
  size_t in_use() const { return in_use_; }
  size_t peak() const { return peak_; }

 private:
  Allocator alloc_;
  size_t chunk_;
  std::vector<Buffer> owned_;
  std::vector<char*> free_;
  size_t in_use_ = 0;
  size_t peak_ = 0;
};

struct Round {
  int64_t index = 0;
  std::unique_ptr<TransportWork> work;
  std::vector<std::pair<const Message*, char*>> staged_recvs;
  std::vector<char*> staging;
};

std::string PieceName(const LocalPlan& plan, const PieceMove& m, const char* list, size_t i) {
  std::ostringstream os;
  os << list << "[" << i << "] (tensor ";
  if (m.tensor >= 0 && m.tensor < static_cast<int>(plan.tensors.size())) {
    os << "'" << plan.tensors[static_cast<size_t>(m.tensor)].name << "'";
  } else {
    os << "index " << m.tensor;
  }
  os << ", peer " << m.peer << ", box " << m.box << ")";
  return os.str();
}

class Execution {
 public:
  Execution(const LocalPlan& plan, Transport& transport, const ExecutorOptions& options,
            Deadline deadline)
      : plan_(plan), transport_(transport), options_(options), deadline_(deadline) {}

  StatusOr<ExecutorStats> Run(std::span<const OldShardData> olds,
                              std::span<const NewShardData> news) {
    const auto t0 = Clock::now();
    Status s = Validate(olds, news);
    if (!s.ok()) {
      // Tell the peers why, if they are waiting, before the abort below makes them fail.
      if (transport_.rank() == plan_.participant && transport_.size() == plan_.num_participants) {
        PlanHandshake::NotifyFailure(plan_, transport_, s,
                                     Min(deadline_, Deadline::AfterMs(kNoticeMs)));
      }
    } else {
      const std::vector<uint8_t> in_place = CutAll();
      auto hs = PlanHandshake::Run(
          plan_, WithMessageLayout(plan_.digest, options_, plan_.num_participants), transport_,
          deadline_, in_place);
      if (hs.ok()) {
        handshake_ = std::move(hs).value();
        s = ZeroPadding();
        if (s.ok()) s = Exchange();
      } else {
        s = hs.status();
      }
    }
    if (!s.ok()) {
      // Peers must not wait for us until their deadline: abort the transport, so that every
      // peer still exchanging with us fails now (and aborts in turn). And the transport must
      // release our buffers before we free them: Wait returns only once it no longer touches
      // them (transport.h), so every group we started is waited for before we return.
      transport_.Abort();
      for (Round& r : in_flight_) (void)r.work->Wait(Deadline::AfterMs(5000));
      in_flight_.clear();
      return s.WithContext("reshard participant " + std::to_string(plan_.participant) + " of " +
                           std::to_string(plan_.num_participants));
    }
    stats_.total_seconds = Since(t0);
    stats_.staging_peak_bytes = static_cast<int64_t>(pool_ ? pool_->peak() : 0);
    return stats_;
  }

 private:
  Status Validate(std::span<const OldShardData> olds, std::span<const NewShardData> news) {
    const int n = plan_.num_participants;
    if (transport_.rank() != plan_.participant || transport_.size() != n) {
      return InvalidArgumentError("transport is rank " + std::to_string(transport_.rank()) +
                                  " of " + std::to_string(transport_.size()) +
                                  ", plan is for participant " + std::to_string(plan_.participant) +
                                  " of " + std::to_string(n));
    }
    const size_t nt = plan_.tensors.size();
    if (plan_.old_shards.size() != nt || plan_.new_shards.size() != nt) {
      return InvalidArgumentError("plan has " + std::to_string(nt) + " tensors but " +
                                  std::to_string(plan_.old_shards.size()) + " old and " +
                                  std::to_string(plan_.new_shards.size()) + " new shard entries");
    }
    std::unordered_map<std::string, size_t> index;
    for (size_t i = 0; i < nt; ++i) {
      if (!index.emplace(plan_.tensors[i].name, i).second) {
        return InvalidArgumentError("plan lists tensor '" + plan_.tensors[i].name + "' twice");
      }
    }
    old_base_.assign(nt, nullptr);
    new_base_.assign(nt, nullptr);
    std::vector<bool> seen_old(nt, false), seen_new(nt, false);
    bool any_cuda = false, any_host = false;
    auto check = [&](const std::string& name, DType dtype, size_t bytes, MemoryKind kind,
                     bool is_old, std::vector<bool>& seen) -> StatusOr<size_t> {
      const char* which = is_old ? "old" : "new";
      auto it = index.find(name);
      if (it == index.end()) {
        return InvalidArgumentError(std::string(which) + " buffer for unknown tensor '" + name +
                                    "' (not in the plan)");
      }
      const size_t i = it->second;
      if (seen[i]) {
        return InvalidArgumentError(std::string("two ") + which + " buffers for tensor '" + name +
                                    "'");
      }
      seen[i] = true;
      const TensorInfo& t = plan_.tensors[i];
      if (dtype != t.dtype) {
        return InvalidArgumentError(std::string(which) + " buffer of tensor '" + name + "' is " +
                                    std::string(DTypeName(dtype)) + ", the plan says " +
                                    std::string(DTypeName(t.dtype)));
      }
      const auto& shard = is_old ? plan_.old_shards[i] : plan_.new_shards[i];
      const int64_t elems = shard ? shard->NumElements() : 0;
      const size_t want = static_cast<size_t>(elems) * static_cast<size_t>(DTypeSize(t.dtype));
      if (bytes != want) {
        return InvalidArgumentError(std::string(which) + " buffer of tensor '" + name + "' has " +
                                    std::to_string(bytes) + " bytes, its " + which + " shard " +
                                    (shard ? shard->ToString() : "(none)") + " needs " +
                                    std::to_string(want));
      }
      if (bytes > 0) (kind == MemoryKind::kCuda ? any_cuda : any_host) = true;
      return i;
    };
    for (const OldShardData& o : olds) {
      MORPH_ASSIGN_OR_RETURN(size_t i,
                             check(o.name, o.dtype, o.data.bytes, o.data.kind, true, seen_old));
      old_base_[i] = static_cast<char*>(const_cast<void*>(o.data.data));
    }
    for (const NewShardData& o : news) {
      MORPH_ASSIGN_OR_RETURN(size_t i,
                             check(o.name, o.dtype, o.data.bytes, o.data.kind, false, seen_new));
      new_base_[i] = static_cast<char*>(o.data.data);
    }
    for (size_t i = 0; i < nt; ++i) {
      const TensorInfo& t = plan_.tensors[i];
      for (int side = 0; side < 2; ++side) {
        const auto& shard = side == 0 ? plan_.old_shards[i] : plan_.new_shards[i];
        const bool seen = side == 0 ? seen_old[i] : seen_new[i];
        if (shard && !shard->empty() && !seen) {
          return InvalidArgumentError(std::string("no ") + (side == 0 ? "old" : "new") +
                                      " buffer for tensor '" + t.name + "', which has " +
                                      (side == 0 ? "old" : "new") + " shard " + shard->ToString());
        }
        if (shard && shard->frame.rank() != static_cast<int>(t.shape.size())) {
          return InvalidArgumentError(
              "tensor '" + t.name + "' has rank " + std::to_string(t.shape.size()) + " but its " +
              (side == 0 ? "old" : "new") + " shard " + shard->ToString() + " does not");
        }
        if (!t.padded_shape.empty() && t.padded_shape.size() != t.shape.size()) {
          return InvalidArgumentError("tensor '" + t.name + "' has padded_shape of rank " +
                                      std::to_string(t.padded_shape.size()) + ", shape of rank " +
                                      std::to_string(t.shape.size()));
        }
        if (shard && !Box::FromShape(t.frame_shape()).Contains(shard->frame)) {
          return InvalidArgumentError("shard " + shard->ToString() + " of tensor '" + t.name +
                                      "' lies outside its " +
                                      (t.padded_shape.empty() ? "shape " : "padded shape ") +
                                      Box::FromShape(t.frame_shape()).ToString());
        }
      }
    }
    if (any_cuda && any_host) {
      return InvalidArgumentError("buffers mix host and CUDA memory; use one kind per reshard");
    }
    if (any_cuda) {
#if MORPH_WITH_CUDA
      auto engine = std::make_unique<CudaEngine>();
      MORPH_RETURN_IF_ERROR(engine->Init());
      engine_ = std::move(engine);
      if (!transport_.SupportsDeviceMemory() && (!plan_.sends.empty() || !plan_.recvs.empty())) {
        return FailedPreconditionError(
            "shards are in CUDA memory but the transport only moves host memory");
      }
#else
      return FailedPreconditionError("shards are in CUDA memory but morph was built without CUDA");
#endif
    } else {
      engine_ = std::make_unique<HostEngine>();
      host_memory_ = true;
    }

    // Resolve pieces: each inside its shard, with a valid peer.
    auto resolve = [&](const PieceMove& m, const char* list, size_t k, bool from_old,
                       bool to_new) -> StatusOr<Piece> {
      if (m.tensor < 0 || m.tensor >= static_cast<int>(nt)) {
        return InvalidArgumentError(PieceName(plan_, m, list, k) + ": no such tensor index");
      }
      const bool local = from_old && to_new;
      if (local ? m.peer != plan_.participant
                : (m.peer < 0 || m.peer >= n || m.peer == plan_.participant)) {
        return InvalidArgumentError(PieceName(plan_, m, list, k) + ": bad peer for " +
                                    std::to_string(n) + " participants");
      }
      const size_t t = static_cast<size_t>(m.tensor);
      const TensorInfo& info = plan_.tensors[t];
      Piece p;
      p.tensor = m.tensor;
      p.peer = m.peer;
      p.elem_size = DTypeSize(info.dtype);
      MORPH_ASSIGN_OR_RETURN(p.elements, m.box.NumElements(), PieceName(plan_, m, list, k));
      StridedView old_view, new_view;
      if (from_old) {
        if (!plan_.old_shards[t]) {
          return InvalidArgumentError(PieceName(plan_, m, list, k) + ": no old shard here");
        }
        MORPH_ASSIGN_OR_RETURN(old_view, ViewOf(*plan_.old_shards[t], m.box),
                               PieceName(plan_, m, list, k));
      }
      if (to_new) {
        if (!plan_.new_shards[t]) {
          return InvalidArgumentError(PieceName(plan_, m, list, k) + ": no new shard here");
        }
        MORPH_ASSIGN_OR_RETURN(new_view, ViewOf(*plan_.new_shards[t], m.box),
                               PieceName(plan_, m, list, k));
      }
      const StridedView dense = ContiguousView(m.box.shape());
      if (local) {
        p.view = new_view;
        MORPH_ASSIGN_OR_RETURN(p.geom, MakeCopyGeometry(new_view, old_view),
                               PieceName(plan_, m, list, k));
        p.base = new_base_[t];
      } else if (from_old) {
        p.view = old_view;
        MORPH_ASSIGN_OR_RETURN(p.geom, MakeCopyGeometry(dense, old_view),
                               PieceName(plan_, m, list, k));
        p.base = old_base_[t];
      } else {
        p.view = new_view;
        MORPH_ASSIGN_OR_RETURN(p.geom, MakeCopyGeometry(new_view, dense),
                               PieceName(plan_, m, list, k));
        p.base = new_base_[t];
      }
      return p;
    };
    for (size_t k = 0; k < plan_.sends.size(); ++k) {
      MORPH_ASSIGN_OR_RETURN(Piece p, resolve(plan_.sends[k], "sends", k, true, false));
      stats_.bytes_sent += p.elements * p.elem_size;
      sends_.push_back(std::move(p));
    }
    for (size_t k = 0; k < plan_.recvs.size(); ++k) {
      MORPH_ASSIGN_OR_RETURN(Piece p, resolve(plan_.recvs[k], "recvs", k, false, true));
      stats_.bytes_received += p.elements * p.elem_size;
      recvs_.push_back(std::move(p));
    }
    for (size_t k = 0; k < plan_.local_copies.size(); ++k) {
      MORPH_ASSIGN_OR_RETURN(Piece p,
                             resolve(plan_.local_copies[k], "local_copies", k, true, true));
      p.base = old_base_[static_cast<size_t>(p.tensor)];  // source; destination from new_base_
      stats_.bytes_copied += p.elements * p.elem_size;
      locals_.push_back(std::move(p));
    }
    // Every new shard must be covered exactly once by recvs + local_copies + lost: disjoint
    // pieces inside the shard whose total is the shard's (coverage.h; cost in the pieces).
    for (size_t k = 0; k < plan_.lost.size(); ++k) {
      const PieceMove& m = plan_.lost[k];
      if (m.tensor < 0 || m.tensor >= static_cast<int>(nt)) {
        return InvalidArgumentError(PieceName(plan_, m, "lost", k) + ": no such tensor index");
      }
      if (!plan_.new_shards[static_cast<size_t>(m.tensor)]) {
        return InvalidArgumentError(PieceName(plan_, m, "lost", k) + ": no new shard here");
      }
    }
    std::vector<std::vector<CoveragePiece>> cover(nt);
    auto add = [&](const std::vector<PieceMove>& list, const char* name) {
      for (size_t k = 0; k < list.size(); ++k) {
        const PieceMove& m = list[k];
        cover[static_cast<size_t>(m.tensor)].push_back({m.box, std::string(name) + "[" +
                                                                   std::to_string(k) + "] (peer " +
                                                                   std::to_string(m.peer) + ")"});
      }
    };
    add(plan_.recvs, "recvs");
    add(plan_.local_copies, "local_copies");
    add(plan_.lost, "lost");
    for (size_t t = 0; t < nt; ++t) {
      if (!plan_.new_shards[t]) continue;  // pieces into a missing shard were rejected above
      const TensorInfo& info = plan_.tensors[t];
      // Padded tensors: pieces cover the state; the rest of the shard is zero-filled below.
      const Box state = Box::FromShape(info.shape);
      const bool padded = !info.padded_shape.empty() && !state.Contains(plan_.new_shards[t]->frame);
      MORPH_RETURN_IF_ERROR(
          ValidateCoverage(info.name, *plan_.new_shards[t], cover[t], padded ? &state : nullptr));
      if (padded && plan_.new_shards[t]->NumElements() > 0) {
        for (const Box& sb : ShardBoxes(*plan_.new_shards[t])) {
          for (const Box& pad : Subtract(sb, state)) {
            MORPH_ASSIGN_OR_RETURN(StridedView v, ViewOf(*plan_.new_shards[t], pad));
            MORPH_ASSIGN_OR_RETURN(CopyGeometry g, MakeCopyGeometry(v, v),
                                   "padding of tensor '" << info.name << "'");
            padding_.push_back({t, g});
          }
        }
      }
    }
    return Status();
  }

  // Padding elements are not state: zero them in the new shards (no piece writes them).
  Status ZeroPadding() {
    for (const auto& [t, g] : padding_) {
      MORPH_RETURN_IF_ERROR(engine_->Zero(g, new_base_[t], DTypeSize(plan_.tensors[t].dtype)));
    }
    return Status();
  }

  // Local copies are cut into chunk-sized slices that run while rounds are in flight, so that
  // this participant keeps posting rounds (and peers keep progressing) between them.
  void SliceLocalCopies() {
    for (int i = 0; i < static_cast<int>(locals_.size()); ++i) {
      const Piece& p = locals_[static_cast<size_t>(i)];
      const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(chunk_) / p.elem_size);
      for (int64_t e = 0; e < p.elements; e += per) {
        local_slices_.push_back({i, e, std::min(p.elements, e + per), 0});
      }
    }
  }

  // Local slices to do per round so that they end with the last of `rounds_left` rounds.
  int64_t SliceShare(int64_t rounds_left) const {
    const int64_t left = static_cast<int64_t>(local_slices_.size() - next_local_);
    return rounds_left <= 0 ? left : (left + rounds_left - 1) / rounds_left;
  }

  Status LocalCopySlice() {
    const auto t = Clock::now();
    const Segment& s = local_slices_[next_local_++];
    const Piece& p = locals_[static_cast<size_t>(s.piece)];
    MORPH_RETURN_IF_ERROR(engine_->Copy(p.geom, new_base_[static_cast<size_t>(p.tensor)], p.base,
                                        p.elem_size, s.begin, s.end))
        << "local copy of tensor '" << plan_.tensors[static_cast<size_t>(p.tensor)].name << "'";
    MORPH_RETURN_IF_ERROR(engine_->Sync());
    stats_.copy_seconds += Since(t);
    return Status();
  }

  Status Post(int64_t r) {
    Round round;
    round.index = r;
    std::vector<SendOp> sops;
    std::vector<RecvOp> rops;
    // Layouts of strided ops: Start copies them, they only need to outlive the call. Reserved
    // so that the pointers handed out stay valid.
    std::vector<StridedLayout> layouts;
    layouts.reserve(groups_[static_cast<size_t>(r)].sends.size() +
                    groups_[static_cast<size_t>(r)].recvs.size());
    auto layout_of = [&](const Message& m, const std::vector<Piece>& pieces) {
      const Segment& s = m.segments[0];
      const Piece& p = pieces[static_cast<size_t>(s.piece)];
      layouts.push_back({&p.geom, p.elem_size, s.begin, s.end});
      ++stats_.messages_strided;
      ++stats_.messages_zero_copy;
      return &layouts.back();
    };
    const auto t = Clock::now();
    for (const Message* mp : groups_[static_cast<size_t>(r)].sends) {
      const Message& m = *mp;
      if (m.strided) {
        ++stats_.messages_sent;
        sops.push_back({m.peer, sends_[static_cast<size_t>(m.segments[0].piece)].base, m.bytes,
                        layout_of(m, sends_), handshake_.SendTag(m.peer, m.index)});
        continue;
      }
      char* data = m.direct;
      if (data == nullptr) {
        MORPH_ASSIGN_OR_RETURN(data, pool_->Acquire());
        round.staging.push_back(data);
        for (const Segment& s : m.segments) {
          const Piece& p = sends_[static_cast<size_t>(s.piece)];
          CopyGeometry g = p.geom;
          g.dst_offset -= s.begin;  // the segment starts at data + s.offset
          MORPH_RETURN_IF_ERROR(
              engine_->Copy(g, data + s.offset, p.base, p.elem_size, s.begin, s.end));
        }
      } else {
        ++stats_.messages_zero_copy;
      }
      ++stats_.messages_sent;
      sops.push_back({m.peer, data, m.bytes, nullptr, handshake_.SendTag(m.peer, m.index)});
    }
    MORPH_RETURN_IF_ERROR(engine_->Sync());
    stats_.pack_seconds += Since(t);
    for (const Message* mp : groups_[static_cast<size_t>(r)].recvs) {
      const Message& m = *mp;
      if (m.strided) {
        ++stats_.messages_received;
        rops.push_back({m.peer, recvs_[static_cast<size_t>(m.segments[0].piece)].base, m.bytes,
                        layout_of(m, recvs_), handshake_.RecvTag(m.peer, m.index)});
        continue;
      }
      char* data = m.direct;
      if (data == nullptr) {
        MORPH_ASSIGN_OR_RETURN(data, pool_->Acquire());
        round.staging.push_back(data);
        round.staged_recvs.emplace_back(&m, data);
      } else {
        ++stats_.messages_zero_copy;
      }
      ++stats_.messages_received;
      rops.push_back({m.peer, data, m.bytes, nullptr, handshake_.RecvTag(m.peer, m.index)});
    }
    auto work = transport_.Start(sops, rops);
    if (!work.ok()) {
      for (char* p : round.staging) pool_->Release(p);
      return work.status().WithContext("starting round " + std::to_string(r));
    }
    round.work = std::move(work).value();
    in_flight_.push_back(std::move(round));
    return Status();
  }

  Status Complete() {
    Round& round = in_flight_.front();
    auto t = Clock::now();
    Status s = round.work->Wait(deadline_);
    stats_.wait_seconds += Since(t);
    if (!s.ok()) {
      // This group is finished (failed): never Wait on it again. Its staging stays allocated
      // until the execution ends, after the transport was aborted.
      const int64_t index = round.index;
      in_flight_.pop_front();
      return s.WithContext("round " + std::to_string(index) + " of " + std::to_string(num_rounds_));
    }
    t = Clock::now();
    for (auto& [m, data] : round.staged_recvs) {
      for (const Segment& seg : m->segments) {
        const Piece& p = recvs_[static_cast<size_t>(seg.piece)];
        CopyGeometry g = p.geom;
        g.src_offset -= seg.begin;
        MORPH_RETURN_IF_ERROR(
            engine_->Copy(g, p.base, data + seg.offset, p.elem_size, seg.begin, seg.end));
      }
    }
    MORPH_RETURN_IF_ERROR(engine_->Sync());
    stats_.unpack_seconds += Since(t);
    for (char* p : round.staging) pool_->Release(p);
    in_flight_.pop_front();
    return Status();
  }

  size_t RoundNeed(int64_t r) const { return groups_[static_cast<size_t>(r)].staged; }

  // Cuts the messages (before the handshake, which carries which directions are in place).
  std::vector<uint8_t> CutAll() {
    const int n = plan_.num_participants;
    chunk_ = EffectiveChunkBytes(options_, n);
    send_msgs_ = CutMessages(sends_, n, chunk_);
    recv_msgs_ = CutMessages(recvs_, n, chunk_);
    // After cutting, so that the cuts never depend on it: the two sides decide alone.
    if (options_.strided_messages && host_memory_ && transport_.SupportsStridedOps()) {
      for (auto* list : {&send_msgs_, &recv_msgs_}) {
        for (auto& msgs : *list) {
          for (Message& m : msgs) m.strided = m.direct == nullptr && m.segments.size() == 1;
        }
      }
    }
    // A direction is in place on this side when every message of it is sent from (received
    // into) the shard buffer as it is: no staging here, nor a transport's bounce buffer.
    std::vector<uint8_t> in_place(static_cast<size_t>(n), 0);
    for (int dir = 0; dir < 2; ++dir) {
      const auto& lists = dir == 0 ? send_msgs_ : recv_msgs_;
      for (size_t peer = 0; peer < lists.size(); ++peer) {
        const bool all = std::all_of(lists[peer].begin(), lists[peer].end(),
                                     [](const Message& m) { return m.direct != nullptr; });
        if (all && !lists[peer].empty()) {
          in_place[peer] |= dir == 0 ? PlanHandshake::kSendsInPlace : PlanHandshake::kRecvsInPlace;
        }
      }
    }
    return in_place;
  }

  Status Exchange() {
    const int n = plan_.num_participants;
    groups_ = GroupMessages(send_msgs_, recv_msgs_, plan_.participant, n,
                            PeersPerGroup(options_, n), MessagesPerGroup(options_, n), chunk_,
                            handshake_);
    num_rounds_ = static_cast<int64_t>(groups_.size());
    stats_.rounds = num_rounds_;
    Allocator staging = transport_.StagingAllocator();
    pool_ = std::make_unique<StagingPool>(staging ? std::move(staging) : engine_->StagingAllocator(),
                                          chunk_);
    SliceLocalCopies();
    int64_t next = 0, completed = 0;
    int64_t local_credit = SliceShare(num_rounds_);
    while (next < num_rounds_ || !in_flight_.empty() || next_local_ < local_slices_.size()) {
      if (deadline_.Expired()) {
        return DeadlineExceededError("deadline passed with " + std::to_string(num_rounds_ - next) +
                                     " of " + std::to_string(num_rounds_) + " rounds not started");
      }
      if (next < num_rounds_ &&
          (in_flight_.empty() ||
           (static_cast<int>(in_flight_.size()) < options_.max_rounds_in_flight &&
            pool_->in_use() + RoundNeed(next) <= options_.staging_bytes))) {
        MORPH_RETURN_IF_ERROR(Post(next++));
        continue;
      }
      // Local copy slices are spread evenly over the rounds: doing them all first would leave
      // peers waiting for this participant's rounds (it completes none while copying).
      if (next_local_ < local_slices_.size() && (local_credit > 0 || in_flight_.empty())) {
        MORPH_RETURN_IF_ERROR(LocalCopySlice());
        --local_credit;
        continue;
      }
      MORPH_RETURN_IF_ERROR(Complete());
      ++completed;
      local_credit += SliceShare(num_rounds_ - completed);
    }
    return Status();
  }

  // How long a participant that failed validation waits for its peers to take its notice.
  static constexpr int64_t kNoticeMs = 250;

  const LocalPlan& plan_;
  Transport& transport_;
  PlanHandshake handshake_;  // agreement with the peers; the message tags
  const ExecutorOptions options_;
  const Deadline deadline_;
  std::unique_ptr<CopyEngine> engine_;
  bool host_memory_ = false;
  std::vector<char*> old_base_, new_base_;
  std::vector<Piece> sends_, recvs_, locals_;
  std::vector<std::pair<size_t, CopyGeometry>> padding_;  // new-shard padding to zero-fill
  std::vector<Segment> local_slices_;
  size_t next_local_ = 0;
  std::vector<std::vector<Message>> send_msgs_, recv_msgs_;
  std::vector<Group> groups_;  // a "round" below is one of these
  size_t chunk_ = 0;
  int64_t num_rounds_ = 0;
  std::unique_ptr<StagingPool> pool_;
  std::deque<Round> in_flight_;
  ExecutorStats stats_;
};

}  // namespace

StatusOr<ExecutorStats> ExecutePlan(const LocalPlan& plan, std::span<const OldShardData> old_shards,
                                    std::span<const NewShardData> new_shards, Transport& transport,
                                    const ExecutorOptions& options, Deadline deadline) {
  Execution e(plan, transport, options, deadline);
  return e.Run(old_shards, new_shards);
}

StatusOr<ReshardResult> Reshard(const LocalPlan& plan, std::span<const OldShardData> old_shards,
                                Transport& transport, const Allocator& allocator,
                                const ExecutorOptions& options, Deadline deadline) {
  ReshardResult result;
  std::vector<NewShardData> news;
  result.new_buffers.resize(plan.tensors.size());
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (i >= plan.new_shards.size() || !plan.new_shards[i]) continue;
    const TensorInfo& t = plan.tensors[i];
    const size_t bytes = static_cast<size_t>(plan.new_shards[i]->NumElements()) *
                         static_cast<size_t>(DTypeSize(t.dtype));
    MORPH_ASSIGN_OR_RETURN(result.new_buffers[i], allocator(bytes),
                           "allocating the new shard of tensor '" << t.name << "'");
    news.push_back({t.name, t.dtype, result.new_buffers[i].view()});
  }
  MORPH_ASSIGN_OR_RETURN(result.stats,
                         ExecutePlan(plan, old_shards, news, transport, options, deadline));
  return result;
}

}  // namespace morph
