// The switch's memory work (switch.h "Pre-allocation", "Growing in place"): which new shards
// are pre-allocated and the peak that follows, the background fill, and where an old shard can
// stay in place inside its new one.
#include <unistd.h>

#include <algorithm>
#include <mutex>

#include "base/logging.h"
#include "reshard/strided_copy.h"
#include "runtime/switch/switch_internal.h"

namespace morph {

// Pre-faults a new shard's buffer, except the range [offset, offset + resident) that a grow in
// place fills with the old shard's pages (offset < 0: none).
Status PrefaultFresh(BufferView v, int64_t offset, size_t resident) {
  if (offset < 0 || resident == 0) return PrefaultHost(v);
  char* p = static_cast<char*>(v.data);
  const size_t off = static_cast<size_t>(offset);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t end = std::min(v.bytes, (off + resident) / page * page);  // a partial page: faulted
  MORPH_RETURN_IF_ERROR(PrefaultHost({p, off, v.kind}));
  return PrefaultHost({p + end, v.bytes - end, v.kind});
}

// Byte offset at which tensor `t`'s old shard here lies, contiguous and in order, in its new
// shard's storage, when that offset is page-aligned and the plan keeps the whole old shard
// resident (its local copies cover it): then the old buffer's pages can become that part of the
// new one (MovePages). -1 otherwise.
int64_t GrowOffset(const LocalPlan& p, size_t t) {
  if (!p.old_shards[t] || !p.new_shards[t]) return -1;
  const Shard& o = *p.old_shards[t];
  const Shard& n = *p.new_shards[t];
  if (o.empty() || n.NumElements() <= o.NumElements()) return -1;
  int64_t at = -1;  // elements
  if (o.frame == n.frame) {
    if (n.flat_begin <= o.flat_begin && o.flat_end <= n.flat_end) at = o.flat_begin - n.flat_begin;
  } else if (o.flat_begin == 0 && o.frame.NumElements().ok() &&
             o.flat_end == *o.frame.NumElements() && n.frame.Contains(o.frame)) {
    StatusOr<StridedView> v = ViewOf(n, o.frame);
    if (v.ok()) {
      if (auto off = ContiguousOffset(*v, 0, o.NumElements())) at = *off;
    }
  }
  if (at < 0) return -1;
  int64_t resident = 0;
  for (const PieceMove& m : p.local_copies) {
    if (static_cast<size_t>(m.tensor) == t) resident += m.box.NumElements().value_or(0);
  }
  if (resident != o.NumElements()) return -1;  // padding, or part of it is not kept
  const int64_t bytes = at * DTypeSize(p.tensors[t].dtype);
  return bytes % sysconf(_SC_PAGESIZE) == 0 ? bytes : -1;
}

// held_k maximized over the batches ("Order and memory bound"), with the pre-allocated shards
// (prealloc_) held from the start and not allocated again.
int64_t PredictPeak(const PreparedSwitch& sw, bool keep_old) {
  const LocalPlan& p = sw.plan_;
  int64_t held = sw.planned_.old_bytes + sw.prealloc_bytes_;  // before the batch
  int64_t peak = held;
  for (const auto& batch : sw.batches_) {
    int64_t batch_new = 0, delta = 0;
    for (int32_t i : batch) {
      const size_t t = static_cast<size_t>(i);
      if (sw.kept_[t]) continue;  // neither allocated nor released
      const DType dt = p.tensors[t].dtype;
      const int64_t o = ShardBytes(p.old_shards[t], dt);
      const int64_t n = ShardBytes(p.new_shards[t], dt);
      const bool pre = t < sw.pre_pos_.size() && sw.pre_pos_[t] >= 0;
      if (!pre) batch_new += n;
      delta += (pre ? 0 : n) - (keep_old ? 0 : o);
    }
    peak = std::max(peak, held + batch_new);
    held += delta;
  }
  return peak;
}

// Pre-allocation (switch.h): the prefix of the execution order whose new shards fit
// O + Σ n_t <= max(max(O, N) + E, the peak without). Decided here (PrepareSwitch), filled by
// FillPreallocation on the switch's own thread.
void PlanPreallocation(PreparedSwitch& sw) {
  const LocalPlan& p = sw.plan_;
  const SwitchStats& planned = sw.planned_;
  const int64_t limit =
      std::max(std::max(planned.old_bytes, planned.new_bytes) + planned.largest_batch_bytes,
               sw.predicted_peak_);
  sw.pre_pos_.assign(p.tensors.size(), -1);
  sw.prealloc_.resize(p.tensors.size());
  int64_t total = 0;
  for (const auto& batch : sw.batches_) {
    for (int32_t i : batch) {
      const size_t t = static_cast<size_t>(i);
      if (sw.kept_[t]) continue;
      const int64_t n = ShardBytes(p.new_shards[t], p.tensors[t].dtype);
      if (n == 0) continue;
      if (planned.old_bytes + total + n > limit) goto done;
      sw.pre_pos_[t] = static_cast<int>(sw.prealloc_order_.size());
      sw.prealloc_order_.push_back(i);
      total += n;
    }
  }
done:
  sw.prealloc_bytes_ = total;
  sw.planned_.preallocated_bytes = total;
  sw.planned_.shards_preallocated = static_cast<int>(sw.prealloc_order_.size());
  sw.predicted_peak_ = PredictPeak(sw, sw.options_.keep_old_until_barrier);
}

// Allocates (`alloc`) and pre-faults the planned shards in order, publishing each as it is
// ready; stops early when the switch is destroyed or aborted. A failed allocation leaves that
// shard (and the rest) to ExecuteSwitch, which allocates it and reports the error if it fails
// again. The pre-allocation thread.
void FillPreallocation(PreparedSwitch& sw, const ShardAllocator& alloc) {
  const LocalPlan& p = sw.plan_;
  for (size_t k = 0; k < sw.prealloc_order_.size(); ++k) {
    if (sw.prealloc_stop_.load() || sw.aborted_.load()) break;
    const size_t t = static_cast<size_t>(sw.prealloc_order_[k]);
    const int64_t n = ShardBytes(p.new_shards[t], p.tensors[t].dtype);
    StatusOr<Buffer> b = alloc(t, static_cast<size_t>(n));
    const size_t resident = static_cast<size_t>(ShardBytes(p.old_shards[t], p.tensors[t].dtype));
    Status s = b.ok() ? PrefaultFresh(b->view(), sw.grow_offset_[t], resident) : b.status();
    if (!s.ok()) {
      VLOG(1) << "generation " << sw.next_.id << ": pre-allocating tensor '" << p.tensors[t].name
              << "' failed, left to the switch: " << s;
      break;
    }
    std::lock_guard<std::mutex> l(sw.prealloc_mu_);
    sw.prealloc_[t] = std::move(b).value();
    sw.prealloc_done_ = k + 1;
    sw.prealloc_cv_.notify_all();
  }
  std::lock_guard<std::mutex> l(sw.prealloc_mu_);
  sw.prealloc_done_ = sw.prealloc_order_.size();
  sw.prealloc_cv_.notify_all();
}

void PreparedSwitch::WaitForPreallocation() {
  std::unique_lock<std::mutex> l(prealloc_mu_);
  prealloc_cv_.wait(l, [&] { return prealloc_done_ >= prealloc_order_.size(); });
}

// Tensor t's pre-allocated buffer, once the pre-allocation thread got to it (empty if it
// failed or stopped before it).
Buffer TakePreallocated(PreparedSwitch& sw, size_t t) {
  std::unique_lock<std::mutex> l(sw.prealloc_mu_);
  const size_t pos = static_cast<size_t>(sw.pre_pos_[t]);
  sw.prealloc_cv_.wait(l, [&] { return sw.prealloc_done_ > pos; });
  return std::move(sw.prealloc_[t]);
}

}  // namespace morph
