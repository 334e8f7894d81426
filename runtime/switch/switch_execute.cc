// ExecuteSwitch's last phases (switch.h "Order and memory bound", "Device memory"): the state
// moved batch by batch, the scalars handed over, the closing barrier. ExecuteSwitch
// (switch.cc) validates the commit and the state before it gets here.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/logging.h"
#include "reshard/buffer.h"
#include "runtime/switch/switch_internal.h"

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

// One batch of tensors on its way through MoveBatch.
struct SwitchExecution::Batch {
  int index = 0;
  std::vector<int32_t> tensors;  // manifest indices, ascending
  std::string where;             // "batch 2 of 5 (tensors 'a', 'b')"
  std::vector<Buffer> fresh;     // per tensor of the batch: its new shard
  std::vector<Buffer> returned;  // a staged old shard back on the device for this batch
  // A tensor whose new shard here is exactly its old one (same frame and range: e.g. a
  // parameter replicated over DP when only dp changes) keeps its buffer: nothing is allocated
  // or copied for it; it still sends from it. Not with host staging or when the old state must
  // stay intact until the barrier.
  std::vector<bool> keep;
  std::vector<bool> moved;  // grown in place: the old shard's pages are in the new one
  bool any_keep = false, any_moved = false;
};

SwitchExecution::SwitchExecution(PreparedSwitch& sw, const CommitMsg& commit, StateStore& state,
                                 Deadline deadline)
    : sw_(sw),
      commit_(commit),
      state_(state),
      deadline_(deadline),
      opt_(sw.options_),
      plan_(sw.plan_),
      nt_(sw.plan_.tensors.size()),
      gen_("switch to generation " + std::to_string(sw.next_.id)),
      stats_(sw.planned_),
      old_view_(nt_),
      old_host_(nt_),
      staged_(nt_),
      new_buffers_(nt_),
      taken_(nt_),
      device_path_(sw.device_transport_ != nullptr),
      // Recycling (switch.h): the old shards released after batch k back batch k+1's new shards.
      recycle_(opt_.preallocate && !opt_.stage_old_in_host && !opt_.keep_old_until_barrier) {}

Status SwitchExecution::Fail(Status s, const std::string& where) const {
  std::string peers = NamePeers(s, sw_.participants_);
  if (!peers.empty()) s = s.WithContext("failed peers: " + peers);
  return s.WithContext(gen_ + ": " + where);
}

StatusOr<SwitchStats> SwitchExecution::Run() {
  ViewOldShards();
  const auto t_transfer = Clock::now();
  MORPH_RETURN_IF_ERROR(StageOldShards());
  for (int k = 0; k < static_cast<int>(sw_.batches_.size()); ++k) {
    MORPH_RETURN_IF_ERROR(MoveBatch(k));
  }
  pool_.Clear();
  adopted_pool_.clear();
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.peak_state_bytes);
  stats_.device.transfer_peak_bytes = std::max(stats_.device.transfer_peak_bytes, tally_.peak);
  stats_.seconds.transfer = Since(t_transfer);

  const auto t_resume = Clock::now();
  if (sw_.aborted_.load()) return Fail(AbortedError("aborted"), "before the scalar broadcast");
  MORPH_RETURN_IF_ERROR(HandOverScalars());
  MORPH_RETURN_IF_ERROR(Close());
  stats_.seconds.resume = Since(t_resume);
  LogStats();
  return stats_;
}

// Old sources: the state's buffers (and what was pre-allocated), counted as held.
void SwitchExecution::ViewOldShards() {
  for (size_t t = 0; t < nt_; ++t) {
    const BufferView v = state_.TensorAt(t).data;
    old_view_[t] = v;
    held_ += static_cast<int64_t>(v.bytes);
  }
  held_ += sw_.prealloc_bytes_;
  stats_.peak_state_bytes = held_;
  // The device path's own count of device bytes (switch.h "Device memory").
  for (size_t t = 0; t < nt_ && device_path_; ++t) {
    if (OnDevice(sw_, t)) tally_.Add(static_cast<int64_t>(old_view_[t].bytes));
  }
  stats_.device.prepare_bytes = tally_.held;
}

// Old device shards staged to pinned host memory when the device cannot hold the change, or
// copied to the host and released (stage_old_in_host).
Status SwitchExecution::StageOldShards() {
  if (device_path_ && ShouldStageOld(sw_, stats_)) {
    MORPH_ASSIGN_OR_RETURN(stats_.device.staged_bytes,
                           StageOldDeviceShards(sw_, state_, old_view_, staged_, tally_), gen_);
  }
  if (!opt_.stage_old_in_host) return Status::Ok();
  for (size_t t = 0; t < nt_; ++t) {
    if (old_view_[t].bytes == 0 || old_view_[t].kind == MemoryKind::kHost) continue;
    MORPH_ASSIGN_OR_RETURN(old_host_[t], HostAllocator()(old_view_[t].bytes),
                           gen_ << ": host copy of tensor '" << plan_.tensors[t].name << "'");
    MORPH_RETURN_IF_ERROR(CopyBytes(old_host_[t].view(), old_view_[t]))
        << gen_ << ": tensor '" << plan_.tensors[t].name << "'";
    held_ += static_cast<int64_t>(old_view_[t].bytes);
    stats_.peak_state_bytes = std::max(stats_.peak_state_bytes, held_);
    state_.ReleaseShard(t);
    held_ -= static_cast<int64_t>(old_view_[t].bytes);
    old_view_[t] = old_host_[t].view();
  }
  return Status::Ok();
}

SwitchExecution::Batch SwitchExecution::StartBatch(int k) const {
  Batch b;
  b.index = k;
  b.tensors = sw_.batches_[static_cast<size_t>(k)];
  std::sort(b.tensors.begin(), b.tensors.end());
  b.where = "batch " + std::to_string(k + 1) + " of " + std::to_string(sw_.batches_.size()) +
            " (tensors";
  for (size_t j = 0; j < b.tensors.size() && j < 4; ++j) {
    b.where += (j ? ", '" : " '") + plan_.tensors[static_cast<size_t>(b.tensors[j])].name + "'";
  }
  b.where += b.tensors.size() > 4 ? ", ...)" : ")";
  const size_t n = b.tensors.size();
  b.fresh.resize(n);
  b.returned.resize(n);
  b.keep.assign(n, false);
  b.moved.assign(n, false);
  for (size_t j = 0; j < n; ++j) {
    const size_t t = static_cast<size_t>(b.tensors[j]);
    b.keep[j] = sw_.kept_[t] && old_view_[t].bytes > 0 && staged_[t].size() == 0;
    b.any_keep |= b.keep[j];
  }
  return b;
}

Status SwitchExecution::MoveBatch(int k) {
  Batch b = StartBatch(k);
  if (sw_.aborted_.load()) return Fail(AbortedError("aborted"), b.where);
  MORPH_RETURN_IF_ERROR(AllocateNewShards(b));
  pool_.Clear();  // what this batch did not reuse (the bound counts it as released)
  adopted_pool_.clear();
  MORPH_RETURN_IF_ERROR(ReturnStaged(b));
  LocalPlan trimmed;
  const LocalPlan& run = PlanToRun(b, trimmed);
  std::vector<OldShardData> olds;
  std::vector<NewShardData> news;
  for (size_t j = 0; j < b.tensors.size(); ++j) {
    const size_t t = static_cast<size_t>(b.tensors[j]);
    const TensorInfo& info = plan_.tensors[t];
    if (old_view_[t].bytes > 0) olds.push_back({info.name, info.dtype, old_view_[t]});
    if (b.fresh[j].size() > 0) news.push_back({info.name, info.dtype, b.fresh[j].view()});
  }
  stats_.peak_state_bytes = std::max(stats_.peak_state_bytes, held_);
  int64_t device_staging = 0;
  StatusOr<ExecutorStats> r =
      RunBatch(sw_, run, b.tensors, olds, news, stats_, &device_staging, deadline_);
  if (!r.ok()) return Fail(r.status(), b.where);
  stats_.device.transfer_peak_bytes =
      std::max({stats_.device.transfer_peak_bytes, tally_.peak, tally_.held + device_staging});
  stats_.AddExecutor(*r);
  const auto t_release = Clock::now();
  stats_.peak_bytes = std::max(stats_.peak_bytes, held_ + r->staging_peak_bytes);
  MORPH_RETURN_IF_ERROR(ReleaseBatch(b));
  stats_.release_seconds += Since(t_release);
  if (opt_.after_batch) opt_.after_batch(k);
  return Status::Ok();
}

// Each tensor's new shard: kept, pre-allocated, recycled or allocated; grown in place where
// its old shard's pages can stay.
Status SwitchExecution::AllocateNewShards(Batch& b) {
  for (size_t j = 0; j < b.tensors.size(); ++j) {
    const size_t t = static_cast<size_t>(b.tensors[j]);
    if (b.keep[j]) continue;
    const int64_t bytes = ShardBytes(plan_.new_shards[t], plan_.tensors[t].dtype);
    if (bytes == 0) continue;
    const bool pre = t < sw_.pre_pos_.size() && sw_.pre_pos_[t] >= 0;
    if (pre) {
      const auto t_wait = Clock::now();
      b.fresh[j] = TakePreallocated(sw_, t);  // counted in `held_` from the start
      stats_.prealloc_wait_seconds += Since(t_wait);
    }
    if (b.fresh[j].size() == 0) {
      const auto t_alloc = Clock::now();
      StatusOr<Buffer> fresh = AllocateFresh(t, bytes);
      stats_.alloc_seconds += Since(t_alloc);
      if (!fresh.ok()) return Fail(fresh.status(), b.where);
      b.fresh[j] = std::move(fresh).value();
      if (!pre) held_ += bytes;  // a pre-allocated one that failed is counted already
    }
    if (device_path_ && OnDevice(sw_, t)) tally_.Add(static_cast<int64_t>(b.fresh[j].size()));
    GrowInPlace(b, j);
  }
  return Status::Ok();
}

// A new shard from the page pool (recycled old shards), the host (stage_old_in_host) or the
// tensor's allocator; faulted in at once when pre-allocating (half the cost of faulting by the
// copy or receive: switch.h).
StatusOr<Buffer> SwitchExecution::AllocateFresh(size_t t, int64_t bytes) {
  if (recycle_ && pool_.bytes() > 0 && sw_.grow_offset_[t] < 0 && !state_.adopted(t)) {
    size_t recycled = 0;
    MORPH_ASSIGN_OR_RETURN(Buffer b, pool_.Get(static_cast<size_t>(bytes), &recycled));
    stats_.recycled_bytes += static_cast<int64_t>(recycled);
    if (recycled < b.size()) {
      MORPH_RETURN_IF_ERROR(PrefaultHost(
          {static_cast<char*>(b.data()) + recycled, b.size() - recycled, MemoryKind::kHost}));
    }
    return b;
  }
  MORPH_ASSIGN_OR_RETURN(Buffer b, opt_.stage_old_in_host
                                       ? HostAllocator()(static_cast<size_t>(bytes))
                                       : state_.AllocateShard(t, bytes, NewCapacity(t, bytes)));
  size_t recycled = 0;
  if (recycle_ && !adopted_pool_.empty() && sw_.grow_offset_[t] < 0 && state_.adopted(t)) {
    recycled = FillFromAdoptedPool(b);
    stats_.recycled_bytes += static_cast<int64_t>(recycled);
  }
  if (opt_.preallocate && !opt_.stage_old_in_host && recycled < b.size()) {
    BufferView rest{static_cast<char*>(b.data()) + recycled, b.size() - recycled, b.kind()};
    MORPH_RETURN_IF_ERROR(PrefaultFresh(rest, recycled > 0 ? -1 : sw_.grow_offset_[t],
                                        old_view_[t].bytes));
  }
  return b;
}

// Recycling for adopted storage: the front of new shard `b` backed by the pages of pooled old
// shards, moved by their allocators (TensorAllocator::move_pages), page by page as PagePool::Get
// does. A pooled shard whose allocator does not move it here (too small to be a mapping of its
// own, say) is passed over, and released with the rest after the batch allocated. Returns the
// bytes backed; the rest of `b` is untouched.
size_t SwitchExecution::FillFromAdoptedPool(Buffer& b) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = (b.size() + page - 1) / page * page;
  size_t done = 0;
  for (size_t i = adopted_pool_.size(); i > 0 && done < len; --i) {
    Pooled& p = adopted_pool_[i - 1];
    const size_t have = (p.buffer.size() + page - 1) / page * page - p.used;
    const size_t k = std::min(have, len - done);
    BufferView from{static_cast<char*>(p.buffer.data()) + p.used, k, MemoryKind::kHost};
    if (!state_.MoveAdoptedPages(p.tensor, from, b.view(), done).ok()) continue;
    p.used += k;
    done += k;
    if (p.used >= p.buffer.size()) {
      adopted_pool_.erase(adopted_pool_.begin() + static_cast<std::ptrdiff_t>(i - 1));
    }
  }
  return std::min(done, b.size());
}

// Growing in place (switch.h "Growing in place"): the old shard's pages become the resident
// part of the new one; it still sends from there.
void SwitchExecution::GrowInPlace(Batch& b, size_t j) {
  const size_t t = static_cast<size_t>(b.tensors[j]);
  if (sw_.grow_offset_[t] < 0 || old_view_[t].bytes == 0) return;
  taken_[t] = state_.TakeShard(t);
  const size_t offset = static_cast<size_t>(sw_.grow_offset_[t]);
  if (!state_.MoveShardPages(t, taken_[t], b.fresh[j], offset).ok()) return;
  old_view_[t] = ConstBufferView(static_cast<char*>(b.fresh[j].data()) + sw_.grow_offset_[t],
                                 old_view_[t].bytes, MemoryKind::kHost);
  b.moved[j] = b.any_moved = true;
  ++stats_.shards_grown;
}

// Staged old shards of this batch back on the device, for its exchange only.
Status SwitchExecution::ReturnStaged(Batch& b) {
  for (size_t j = 0; j < b.tensors.size(); ++j) {
    const size_t t = static_cast<size_t>(b.tensors[j]);
    if (staged_[t].size() == 0) continue;
    Status r = ReturnStagedForBatch(sw_, state_, t, old_view_, b.returned[j], tally_);
    if (!r.ok()) return Fail(r, b.where);
    held_ += static_cast<int64_t>(b.returned[j].size());
  }
  return Status::Ok();
}

// The batch's plan, less what kept and grown tensors need not move (`trimmed` when it differs).
const LocalPlan& SwitchExecution::PlanToRun(const Batch& b, LocalPlan& trimmed) const {
  const LocalPlan& bp = sw_.batch_plans_[static_cast<size_t>(b.index)];
  if (!b.any_keep && !b.any_moved) return bp;
  trimmed = bp;
  // A moved tensor's resident pieces are in place: listed as covered (`lost` is what the
  // executor counts as covered and never writes).
  for (const PieceMove& m : trimmed.local_copies) {
    if (b.moved[static_cast<size_t>(m.tensor)]) trimmed.lost.push_back(m);
  }
  std::erase_if(trimmed.local_copies, [&](const PieceMove& m) {
    return b.keep[static_cast<size_t>(m.tensor)] || b.moved[static_cast<size_t>(m.tensor)];
  });
  for (size_t j = 0; j < b.tensors.size(); ++j) {
    if (b.keep[j]) trimmed.new_shards[j].reset();
  }
  return trimmed;
}

// After the batch's exchange: old shards released (or kept), new ones handed to new_buffers_,
// staged copies returned to the host.
Status SwitchExecution::ReleaseBatch(Batch& b) {
  for (size_t j = 0; j < b.tensors.size(); ++j) {
    const size_t t = static_cast<size_t>(b.tensors[j]);
    if (b.keep[j]) {
      new_buffers_[t] = state_.TakeShard(t);  // stays where it is
      old_view_[t] = ConstBufferView();
      ++stats_.shards_kept;
      continue;
    }
    ReleaseOld(b, j);
    if (b.fresh[j].size() == 0) continue;
    if (opt_.stage_old_in_host) {
      Status s = IntoTensorStorage(t, b.fresh[j]);
      if (!s.ok()) return Fail(s, b.where);
    }
    new_buffers_[t] = std::move(b.fresh[j]);
  }
  for (size_t j = 0; j < b.tensors.size(); ++j) {  // not released above: the host copy stays
    if (b.returned[j].size() == 0) continue;
    const size_t t = static_cast<size_t>(b.tensors[j]);
    old_view_[t] = staged_[t].view();
    tally_.Sub(static_cast<int64_t>(b.returned[j].size()));
    held_ -= static_cast<int64_t>(b.returned[j].size());
    b.returned[j] = Buffer();
  }
  return Status::Ok();
}

// Freed early to bound the peak when new shards follow; a worker left without a rank (a
// standby, a leaver) allocates none, so its old shards go after the closing barrier (Install):
// freeing 0.5 GB takes 0.15-0.2 s here, which the others would wait for.
void SwitchExecution::ReleaseOld(Batch& b, size_t j) {
  const size_t t = static_cast<size_t>(b.tensors[j]);
  if (opt_.keep_old_until_barrier || sw_.new_rank_ < 0 || old_view_[t].bytes == 0) return;
  held_ -= static_cast<int64_t>(old_view_[t].bytes);
  if (device_path_ && OnDevice(sw_, t)) tally_.Sub(static_cast<int64_t>(old_view_[t].bytes));
  if (staged_[t].size() > 0) {  // the host copy went with old_view_ above; this is the device's
    held_ -= static_cast<int64_t>(b.returned[j].size());
    staged_[t] = Buffer();
    b.returned[j] = Buffer();
  }
  old_host_[t] = Buffer();
  if (recycle_ && state_.adopted(t) && state_.pages_movable(t) && taken_[t].size() == 0) {
    Buffer taken = state_.TakeShard(t);  // released once the next batch allocated its shards
    if (taken.size() > 0) adopted_pool_.push_back({t, std::move(taken)});
  } else if (recycle_) {
    Buffer taken = state_.TakeShard(t);
    if (!pool_.Put(taken)) taken = Buffer();
    if (!pool_.Put(taken_[t])) taken_[t] = Buffer();
  }
  taken_[t] = Buffer();  // a grow in place that could not move it
  state_.ReleaseShard(t);
  old_view_[t] = ConstBufferView();
}

// With stage_old_in_host: the new shard, received in host memory, copied into the tensor's own
// storage (device memory for a CUDA tensor), one at a time.
Status SwitchExecution::IntoTensorStorage(size_t t, Buffer& fresh) {
  const auto bytes = static_cast<int64_t>(fresh.size());
  MORPH_ASSIGN_OR_RETURN(Buffer b, state_.AllocateShard(t, bytes, NewCapacity(t, bytes)));
  held_ += static_cast<int64_t>(b.size());
  stats_.peak_state_bytes = std::max(stats_.peak_state_bytes, held_);
  MORPH_RETURN_IF_ERROR(CopyBytes(b.view(), fresh.view()));
  held_ -= static_cast<int64_t>(fresh.size());
  fresh = std::move(b);
  return Status::Ok();
}

// The scalars (step counters, RNG state) broadcast from the first participant whose state is
// used (participant 0 outside a recovery).
Status SwitchExecution::HandOverScalars() {
  int64_t scalar_bytes = 0;
  for (const ScalarSpec& s : state_.scalars()) scalar_bytes += s.bytes;
  if (scalar_bytes == 0) return Status::Ok();
  std::vector<std::byte> blob(static_cast<size_t>(scalar_bytes));
  size_t at = 0;
  for (const ScalarSpec& s : state_.scalars()) {
    std::span<std::byte> v = *state_.scalar(s.name);
    std::memcpy(blob.data() + at, v.data(), v.size());
    at += v.size();
  }
  const std::vector<WorkerId>& stale = commit_.change.stale;
  int root = 0;
  while (root < sw_.num_participants_ &&
         std::find(stale.begin(), stale.end(), sw_.participants_[static_cast<size_t>(root)]) !=
             stale.end()) {
    ++root;
  }
  Status b = sw_.change_comm_->Broadcast(blob.data(), blob.size(), DType::kU8, root, opt_.timeout);
  if (!b.ok()) return Fail(b, "scalar broadcast from participant " + std::to_string(root));
  at = 0;
  for (const ScalarSpec& s : state_.scalars()) {
    std::span<std::byte> v = *state_.scalar(s.name);
    std::memcpy(v.data(), blob.data() + at, v.size());
    at += v.size();
  }
  return Status::Ok();
}

// Every participant's exchange completed (executor.h "Completion"): only now may old state go
// and a leaver exit.
Status SwitchExecution::Close() {
  Status barrier = sw_.change_comm_->Barrier(opt_.timeout);
  std::vector<Shard> shards(nt_);
  for (size_t t = 0; t < nt_; ++t) {
    if (plan_.new_shards[t]) shards[t] = *plan_.new_shards[t];
  }
  if (!barrier.ok()) {
    // This participant's exchange completed (a peer failed at the barrier): its new state is
    // whole. It is installed, so that if someone passed the barrier (the change applied) this
    // worker follows; if nobody did, the old state was kept intact only with
    // keep_old_until_barrier, and is lost otherwise (State::intact() says which).
    sw_.new_complete_ = true;
    if (opt_.keep_old_until_barrier) {
      sw_.pending_shards_ = std::move(shards);
      sw_.pending_buffers_ = std::move(new_buffers_);
      sw_.pending_install_ = true;
    } else {
      state_.Install(sw_.next_.config, sw_.new_rank_, std::move(shards), std::move(new_buffers_));
    }
    return Fail(barrier, "closing barrier");
  }
  MarkApplied(sw_);
  state_.Install(sw_.next_.config, sw_.new_rank_, std::move(shards), std::move(new_buffers_));
  stats_.device.resume_bytes = device_path_ ? stats_.device.new_bytes : 0;
  return Status::Ok();
}

void SwitchExecution::LogStats() const {
  const SwitchStats& s = stats_;
  VLOG(1) << gen_ << ": participant " << sw_.participant_ << " of " << sw_.num_participants_
          << ", rank " << sw_.old_rank_ << " -> " << sw_.new_rank_ << ", " << s.batches
          << " batches, sent " << s.bytes_sent << " B, received " << s.bytes_received
          << " B, copied " << s.bytes_copied << " B, pre-allocated " << s.preallocated_bytes
          << " B (waited " << s.prealloc_wait_seconds << " s), recycled " << s.recycled_bytes
          << " B, peak " << s.peak_bytes << " B (bound " << s.bound_bytes << " B); transfer "
          << s.seconds.transfer << " s: alloc " << s.alloc_seconds << " copy " << s.copy_seconds
          << " pack " << s.pack_seconds << " wait " << s.wait_seconds << " unpack "
          << s.unpack_seconds << " (executor " << s.executor_seconds << ") release "
          << s.release_seconds;
}

}  // namespace morph
