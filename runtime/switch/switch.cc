#include "runtime/switch/switch.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <utility>

#include "base/logging.h"
#include "reshard/plan_digest.h"
#include "reshard/strided_copy.h"
#include "runtime/switch/switch_internal.h"
#include "runtime/plan/plan_input.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>

#include "base/cuda_check.h"
#endif

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string DigestParts(const PlanDigest& d) {
  std::string out;
  for (int i = 0; i < PlanDigest::kNumParts; ++i) {
    if (i) out += ", ";
    out += std::string(PlanDigest::PartName(i)) + " " + DigestHex(d.parts[static_cast<size_t>(i)]);
  }
  return out;
}

}  // namespace

Status CopyBytes(BufferView dst, ConstBufferView src) {
  if (src.bytes == 0) return Status::Ok();
  if (dst.kind == MemoryKind::kHost && src.kind == MemoryKind::kHost) {
    std::memcpy(dst.data, src.data, src.bytes);
    return Status::Ok();
  }
#if MORPH_WITH_CUDA
  MORPH_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst.data, src.data, src.bytes, cudaMemcpyDefault))
      << "copying a shard between host and device";
  return Status::Ok();
#else
  return FailedPreconditionError("CUDA memory in a build without CUDA");
#endif
}


std::string NamePeers(const Status& s, const std::vector<WorkerId>& participants) {
  std::string out;
  for (int p : s.failed_peers()) {
    if (!out.empty()) out += ", ";
    out += "participant " + std::to_string(p);
    if (p >= 0 && static_cast<size_t>(p) < participants.size()) {
      out += " (worker " + std::to_string(participants[static_cast<size_t>(p)]) + ")";
    }
  }
  return out;
}

PreparedSwitch::~PreparedSwitch() {
  prealloc_stop_.store(true);
  if (prealloc_thread_.joinable()) prealloc_thread_.join();
}

void PreparedSwitch::Abort() {
  aborted_.store(true);
  if (transport_) transport_->Abort();
  if (change_comm_) change_comm_->Abort();
  std::lock_guard<std::mutex> l(groups_mu_);
  // Past the closing barrier the change is applied: its groups belong to the new generation,
  // which an abort of the old one is not for (its own failures abort them through LiveGroups).
  // (The device transport's communicator may be the groups' world; TakeGroups drops it.)
  if (device_transport_ && !applied_) device_transport_->Abort();
  if (groups_ && !applied_) groups_->AbortAll();
}

void MarkApplied(PreparedSwitch& sw) {
  std::lock_guard<std::mutex> l(sw.groups_mu_);
  sw.applied_ = true;
}

// kFailedPrecondition "plan digest mismatch: ..." unless `change` has the coordinator's digest.
static Status CheckDigest(const ChangePlan& change, uint64_t expected) {
  if (change.digest == expected) return Status::Ok();
  std::string parts =
      change.planner
          ? "computed parts: " +
                DigestParts(WithMessageLayout(change.planner->digest(), change.executor,
                                              static_cast<int>(change.participants.size())))
          : "first generation: manifest, config and ranks";
  return FailedPreconditionError("plan digest mismatch: coordinator " + DigestHex(expected) +
                                 ", computed " + DigestHex(change.digest) + " (" + parts + ")");
}

StatusOr<std::unique_ptr<PreparedSwitch>> PrepareSwitch(const JobManifest& manifest, WorkerId me,
                                                        const PrepareMsg& prepare, Store& store,
                                                        const CommunicatorFactory& factory,
                                                        const SwitchOptions& options,
                                                        Deadline deadline) {
  const auto t_plan = Clock::now();
  std::unique_ptr<PreparedSwitch> sw(new PreparedSwitch());
  sw->manifest_ = manifest;
  sw->me_ = me;
  sw->from_ = prepare.from;
  sw->next_ = prepare.next;
  sw->change_ = prepare.change;
  sw->options_ = options;
  const std::string gen = "generation " + std::to_string(prepare.next.id);
  if (prepare.from.id != prepare.from_generation) {
    return InvalidArgumentError(gen + ": prepare starts from generation " +
                                std::to_string(prepare.from_generation) + " but carries " +
                                std::to_string(prepare.from.id));
  }
  MORPH_ASSIGN_OR_RETURN(ChangePlan change,
                         PlanForChange(manifest, prepare.from, prepare.next, prepare.change), gen);
  // A recovery's digest covers its stale participants, known at the commit (ExecuteSwitch).
  if (!prepare.change.recovery) {
    MORPH_RETURN_IF_ERROR(CheckDigest(change, prepare.next.plan_digest));
  }
  MORPH_RETURN_IF_ERROR(CheckDeviceOptions(options, manifest.tensors.size(), gen));
  sw->participants_ = change.participants;
  sw->participant_ = change.IndexOf(me);
  sw->num_participants_ = static_cast<int>(change.participants.size());
  sw->old_rank_ = prepare.from.RankOf(me);
  sw->new_rank_ = prepare.next.RankOf(me);
  sw->executor_ = options.executor;
  sw->executor_.chunk_bytes = change.executor.chunk_bytes;
  sw->executor_.staging_bytes = change.executor.staging_bytes;
  if (sw->participant_ < 0 && sw->new_rank_ < 0) {
    return InvalidArgumentError(gen + ": worker " + std::to_string(me) +
                                " is no participant of the change");
  }

  SwitchStats& planned = sw->planned_;
  if (!prepare.change.recovery) {
    MORPH_RETURN_IF_ERROR(PlanSwitch(*sw, change, options));
  }
  planned.seconds.plan = Since(t_plan);

  const auto t_comm = Clock::now();
  auto cancelled = [&](const char* before) -> Status {
    if (!options.cancel || !options.cancel->cancelled()) return Status::Ok();
    return AbortedError(gen + ": prepare cancelled before " + before);
  };
  MORPH_RETURN_IF_ERROR(cancelled("the change communicator"));
  // Filled in the background (the old generation trains on); ExecuteSwitch waits per shard,
  // ~PreparedSwitch stops and joins it.
  if (options.preallocate && !options.stage_old_in_host && change.planner &&
      !prepare.change.recovery) {
    PlanPreallocation(*sw);
    PreparedSwitch* raw = sw.get();
    raw->prealloc_thread_ =
        std::thread([raw, alloc = options.preallocate] { FillPreallocation(*raw, alloc); });
  }
  if (change.planner) {
    MORPH_ASSIGN_OR_RETURN(
        sw->change_comm_,
        factory(store, "change", sw->participant_, sw->num_participants_, deadline),
        gen << ": change communicator");
    MORPH_ASSIGN_OR_RETURN(
        sw->transport_,
        CommTransport::Create(sw->change_comm_.get(), options.timeout, options.transport, deadline),
        gen << ": change transport");
  }
  sw->store_ = &store;
  sw->factory_ = factory;
  if (options.previous_groups_can_shrink && prepare.change.recovery && sw->old_rank_ >= 0 &&
      sw->new_rank_ >= 0) {
    // Ranks only leave: next's ranks are from's survivors in their order.
    std::vector<WorkerId> kept;
    std::vector<int> leaving;
    for (size_t r = 0; r < prepare.from.ranks.size(); ++r) {
      if (prepare.next.RankOf(prepare.from.ranks[r]) >= 0) {
        kept.push_back(prepare.from.ranks[r]);
      } else {
        leaving.push_back(static_cast<int>(r));
      }
    }
    if (kept == prepare.next.ranks && !leaving.empty()) {
      sw->shrink_groups_ = true;
      sw->leaving_ = std::move(leaving);
    }
  }
  MORPH_RETURN_IF_ERROR(cancelled("the new groups"));
  if (sw->new_rank_ >= 0 && !sw->shrink_groups_) {
    GroupBuilder builder(options.groups_factory ? options.groups_factory : factory);
    MORPH_ASSIGN_OR_RETURN(sw->groups_,
                           builder.Build(store, prepare.next.config, sw->new_rank_,
                                         prepare.next.config.world(), deadline),
                           gen << ": communicators of rank " << sw->new_rank_);
  }
  // After the groups: the union may be the next generation's world (every participant builds
  // the change communicator, then its groups, then the union, in that order).
  if (change.planner && DevicePathOn(options)) {
    MORPH_RETURN_IF_ERROR(cancelled("the union communicator"));
    MORPH_RETURN_IF_ERROR(PrepareDevicePath(*sw, store, deadline));
  }
  planned.seconds.communicators = Since(t_comm);
  return sw;
}

namespace {

Status CheckCommit(const PreparedSwitch& sw, const CommitMsg& commit) {
  const Generation& n = sw.next();
  std::string what;
  if (commit.next.id != n.id) {
    what = "generation " + std::to_string(commit.next.id);
  } else if (!(commit.next.config == n.config)) {
    what = "config " + commit.next.config.ToString() + " vs " + n.config.ToString();
  } else if (commit.next.ranks != n.ranks) {
    what = "ranks";
  } else if (commit.next.plan_digest != n.plan_digest && !commit.change.recovery) {
    what = "plan digest " + DigestHex(commit.next.plan_digest) + " vs " + DigestHex(n.plan_digest);
  } else if (!(commit.from == sw.from())) {
    what = "the generation it starts from";
  }
  if (what.empty()) return Status::Ok();
  return FailedPreconditionError("commit of generation " + std::to_string(commit.next.id) +
                                 " differs from the prepared generation " + std::to_string(n.id) +
                                 ": " + what);
}

}  // namespace

// A recovery from a checkpoint: every participant installs its new shards (zero-filled) and
// fills them and the scalars from the checkpoint; then the closing barrier.
StatusOr<SwitchStats> RestoreFromCheckpoint(PreparedSwitch& sw, const CommitMsg& commit,
                                            StateStore& state, Deadline) {
  const std::string gen = "recovery into generation " + std::to_string(commit.next.id) +
                          " from checkpoint " + commit.recovery.checkpoint;
  if (!sw.options_.restore_checkpoint) {
    return FailedPreconditionError(gen + ": this worker cannot restore checkpoints");
  }
  SwitchStats stats = sw.planned_;
  const auto t0 = Clock::now();
  const size_t nt = state.tensors().size();
  for (size_t t = 0; t < nt; ++t) state.ReleaseShard(t);
  const int rank = commit.next.RankOf(sw.me_);
  std::vector<Shard> shards(nt);
  std::vector<Buffer> buffers(nt);
  if (rank >= 0) {
    for (size_t t = 0; t < nt; ++t) {
      const TensorSpec& spec = state.tensors()[t];
      MORPH_ASSIGN_OR_RETURN(shards[t], ShardOf(spec, commit.next.config, rank), gen);
      const int64_t bytes = ShardBytes(shards[t], spec.dtype);
      if (bytes == 0) continue;
      MORPH_ASSIGN_OR_RETURN(buffers[t], state.AllocateShard(t, bytes), gen);
      stats.new_bytes += bytes;
    }
  }
  state.Install(commit.next.config, rank, std::move(shards), std::move(buffers));
  if (rank >= 0) {
    MORPH_RETURN_IF_ERROR(sw.options_.restore_checkpoint(commit.recovery.checkpoint, state))
        << gen;
  }
  stats.seconds.transfer = Since(t0);
  const auto t_resume = Clock::now();
  if (sw.change_comm_) {
    Status barrier = sw.change_comm_->Barrier(sw.options_.timeout);
    if (!barrier.ok()) return barrier.WithContext(gen + ": closing barrier");
  }
  MarkApplied(sw);
  stats.seconds.resume = Since(t_resume);
  stats.peak_bytes = stats.peak_state_bytes = stats.new_bytes;
  return stats;
}

void SwitchStats::AddExecutor(const ExecutorStats& r) {
  bytes_sent += r.bytes_sent;
  bytes_received += r.bytes_received;
  bytes_copied += r.bytes_copied;
  copy_seconds += r.copy_seconds;
  pack_seconds += r.pack_seconds;
  wait_seconds += r.wait_seconds;
  unpack_seconds += r.unpack_seconds;
  executor_seconds += r.total_seconds;
  peak_staging_bytes = std::max(peak_staging_bytes, r.staging_peak_bytes);
}

StatusOr<SwitchStats> ExecuteSwitch(PreparedSwitch& sw, const CommitMsg& commit, StateStore& state,
                                    Deadline deadline) {
  const std::string gen = "switch to generation " + std::to_string(sw.next_.id);
  MORPH_RETURN_IF_ERROR(CheckCommit(sw, commit));
  {
    ChangeParticipants prepared = sw.change_;
    prepared.stale = commit.change.stale;  // a recovery's commit adds them
    if (!(commit.change == prepared)) {
      return FailedPreconditionError(gen + ": the commit's participants differ from the prepare's");
    }
  }
  const bool recovery = commit.change.recovery;
  const bool stale = recovery && std::find(commit.change.stale.begin(), commit.change.stale.end(),
                                           sw.me_) != commit.change.stale.end();
  if (recovery && commit.recovery.source == RecoveryDecision::Source::kCheckpoint) {
    if (sw.aborted_.load()) return AbortedError(gen + ": aborted");
    sw.executed_ = true;
    return RestoreFromCheckpoint(sw, commit, state, deadline);
  }
  if (recovery && commit.recovery.source == RecoveryDecision::Source::kSnapshot) {
    if (sw.executed_) return FailedPreconditionError(gen + ": already executed");
    if (sw.aborted_.load()) return AbortedError(gen + ": aborted");
    sw.executed_ = true;
    return RestoreFromSnapshots(sw, commit, state, deadline);
  }
  if (recovery && !sw.executed_) {
    // The plan of a recovery depends on its commit (the stale participants).
    const auto t_plan = Clock::now();
    MORPH_ASSIGN_OR_RETURN(ChangePlan change,
                           PlanForChange(sw.manifest_, sw.from_, commit.next, commit.change), gen);
    MORPH_RETURN_IF_ERROR(CheckDigest(change, commit.next.plan_digest)) << gen;
    sw.next_ = commit.next;
    sw.change_ = commit.change;
    MORPH_RETURN_IF_ERROR(PlanSwitch(sw, change, sw.options_));
    sw.planned_.seconds.plan += Since(t_plan);
  }
  if (sw.executed_) return FailedPreconditionError(gen + ": already executed");
  if (sw.aborted_.load()) return AbortedError(gen + ": aborted");
  sw.executed_ = true;
  state.Seal();
  {
    JobManifest mine = sw.manifest_;
    state.FillManifest(mine);
    const std::string diff = FirstDifference(sw.manifest_, mine);
    if (!diff.empty()) {
      return FailedPreconditionError(gen + ": the state differs from the job's manifest: " + diff);
    }
  }
  SwitchStats stats = sw.planned_;
  if (sw.first_generation()) {
    const auto t0 = Clock::now();
    MORPH_RETURN_IF_ERROR(state.Materialize(sw.next_.config, sw.new_rank_)) << gen;
    stats.new_bytes = stats.peak_state_bytes = stats.peak_bytes = state.local_bytes();
    stats.bound_bytes = stats.new_bytes;
    stats.seconds.resume = Since(t0);
    return stats;
  }
  // The state must be what the plan's old shards describe (a stale participant's is not used:
  // it goes at once).
  if (stale) {
    for (size_t t = 0; t < state.tensors().size(); ++t) state.ReleaseShard(t);
  } else if (sw.old_rank_ >= 0) {
    const ParallelConfig* c = state.config();
    if (c == nullptr || !(*c == sw.from_.config) || state.rank() != sw.old_rank_ ||
        !state.intact()) {
      return FailedPreconditionError(
          gen + ": the state is laid out for " + (c ? c->ToString() : "nothing") + " rank " +
          std::to_string(state.rank()) + (state.intact() ? "" : " (not intact)") +
          ", the change starts from " + sw.from_.config.ToString() + " rank " +
          std::to_string(sw.old_rank_));
    }
  } else if (state.local_bytes() != 0) {
    return FailedPreconditionError(gen + ": worker " + std::to_string(sw.me_) +
                                   " holds no rank in generation " + std::to_string(sw.from_.id) +
                                   " but its state holds " + std::to_string(state.local_bytes()) +
                                   " bytes");
  }

  const SwitchOptions& opt = sw.options_;
  const LocalPlan& plan = sw.plan_;
  const size_t nt = plan.tensors.size();
  auto fail = [&](Status s, const std::string& where) {
    std::string peers = NamePeers(s, sw.participants_);
    if (!peers.empty()) s = s.WithContext("failed peers: " + peers);
    return s.WithContext(gen + ": " + where);
  };

  // Old sources: the state's buffers, or host copies of device shards (stage_old_in_host).
  std::vector<ConstBufferView> old_view(nt);
  std::vector<Buffer> old_host(nt);
  int64_t held = 0;
  for (size_t t = 0; t < nt; ++t) {
    const BufferView v = state.TensorAt(t).data;
    old_view[t] = v;
    held += static_cast<int64_t>(v.bytes);
  }
  held += sw.prealloc_bytes_;
  stats.peak_state_bytes = held;
  // The device path's own count of device bytes (switch.h "Device memory").
  const bool device_path = sw.device_transport_ != nullptr;
  DeviceTally tally;
  for (size_t t = 0; t < nt && device_path; ++t) {
    if (OnDevice(sw, t)) tally.Add(static_cast<int64_t>(old_view[t].bytes));
  }
  stats.device.prepare_bytes = tally.held;
  const auto t_transfer = Clock::now();
  // Old device shards staged to pinned host memory when the device cannot hold the change.
  std::vector<Buffer> staged(nt);
  if (device_path && ShouldStageOld(sw, stats)) {
    MORPH_ASSIGN_OR_RETURN(stats.device.staged_bytes,
                           StageOldDeviceShards(sw, state, old_view, staged, tally), gen);
  }
  if (opt.stage_old_in_host) {
    for (size_t t = 0; t < nt; ++t) {
      if (old_view[t].bytes == 0 || old_view[t].kind == MemoryKind::kHost) continue;
      MORPH_ASSIGN_OR_RETURN(old_host[t], HostAllocator()(old_view[t].bytes),
                             gen << ": host copy of tensor '" << plan.tensors[t].name << "'");
      MORPH_RETURN_IF_ERROR(CopyBytes(old_host[t].view(), old_view[t]))
          << gen << ": tensor '" << plan.tensors[t].name << "'";
      held += static_cast<int64_t>(old_view[t].bytes);
      stats.peak_state_bytes = std::max(stats.peak_state_bytes, held);
      state.ReleaseShard(t);
      held -= static_cast<int64_t>(old_view[t].bytes);
      old_view[t] = old_host[t].view();
    }
  }

  std::vector<Buffer> new_buffers(nt);
  std::vector<Buffer> taken(nt);  // old shards taken out of the State to be grown in place
  // Recycling (switch.h): the old shards released after batch k back batch k+1's new shards.
  const bool recycle = opt.preallocate && !opt.stage_old_in_host && !opt.keep_old_until_barrier;
  PagePool pool;
  const int num_batches = static_cast<int>(sw.batches_.size());
  for (int k = 0; k < num_batches; ++k) {
    const LocalPlan& bp = sw.batch_plans_[static_cast<size_t>(k)];
    std::vector<int32_t> sorted = sw.batches_[static_cast<size_t>(k)];
    std::sort(sorted.begin(), sorted.end());
    std::string where =
        "batch " + std::to_string(k + 1) + " of " + std::to_string(num_batches) + " (tensors";
    for (size_t j = 0; j < sorted.size() && j < 4; ++j) {
      where += (j ? ", '" : " '") + plan.tensors[static_cast<size_t>(sorted[j])].name + "'";
    }
    where += sorted.size() > 4 ? ", ...)" : ")";
    if (sw.aborted_.load()) return fail(AbortedError("aborted"), where);

    std::vector<OldShardData> olds;
    std::vector<NewShardData> news;
    std::vector<Buffer> fresh(sorted.size());
    // A tensor whose new shard here is exactly its old one (same frame and range: e.g. a
    // parameter replicated over DP when only dp changes) keeps its buffer: nothing is
    // allocated or copied for it; it still sends from it. Not with host staging or when the
    // old state must stay intact until the barrier.
    std::vector<bool> keep(sorted.size(), false), moved(sorted.size(), false);
    bool any_keep = false, any_moved = false;
    for (size_t j = 0; j < sorted.size(); ++j) {
      const size_t t = static_cast<size_t>(sorted[j]);
      keep[j] = sw.kept_[t] && old_view[t].bytes > 0 && staged[t].size() == 0;
      any_keep |= keep[j];
    }
    for (size_t j = 0; j < sorted.size(); ++j) {
      const size_t t = static_cast<size_t>(sorted[j]);
      const TensorInfo& info = plan.tensors[t];
      if (keep[j]) continue;
      const int64_t bytes = ShardBytes(plan.new_shards[t], info.dtype);
      if (bytes == 0) continue;
      const bool pre = t < sw.pre_pos_.size() && sw.pre_pos_[t] >= 0;
      if (pre) {
        const auto t_wait = Clock::now();
        fresh[j] = TakePreallocated(sw, t);  // counted in `held` from the start
        stats.prealloc_wait_seconds += Since(t_wait);
      }
      if (fresh[j].size() == 0) {
        const auto t_alloc = Clock::now();
        StatusOr<Buffer> b = Buffer();
        if (recycle && pool.bytes() > 0 && sw.grow_offset_[t] < 0) {
          size_t recycled = 0;
          b = pool.Get(static_cast<size_t>(bytes), &recycled);
          if (b.ok() && recycled < b->size()) {
            Status f = PrefaultHost({static_cast<char*>(b->data()) + recycled, b->size() - recycled,
                                     MemoryKind::kHost});
            if (!f.ok()) b = f;
          }
          stats.recycled_bytes += static_cast<int64_t>(recycled);
        } else {
          b = opt.stage_old_in_host ? HostAllocator()(static_cast<size_t>(bytes))
                                    : state.AllocateShard(t, bytes);
          // Faulted in at once: half the cost of faulting by the copy or receive (switch.h).
          if (b.ok() && opt.preallocate && !opt.stage_old_in_host) {
            Status f = PrefaultFresh(b->view(), sw.grow_offset_[t], old_view[t].bytes);
            if (!f.ok()) b = f;
          }
        }
        stats.alloc_seconds += Since(t_alloc);
        if (!b.ok()) return fail(b.status(), where);
        fresh[j] = std::move(b).value();
        if (!pre) held += bytes;  // a pre-allocated one that failed is counted already
      }
      if (device_path && OnDevice(sw, t)) tally.Add(static_cast<int64_t>(fresh[j].size()));
      // Growing in place (switch.h "Growing in place"): the old shard's pages become the
      // resident part of the new one; it still sends from there.
      if (sw.grow_offset_[t] >= 0 && old_view[t].bytes > 0) {
        taken[t] = state.TakeShard(t);
        if (MovePages(taken[t], fresh[j], static_cast<size_t>(sw.grow_offset_[t])).ok()) {
          old_view[t] = ConstBufferView(static_cast<char*>(fresh[j].data()) + sw.grow_offset_[t],
                                        old_view[t].bytes, MemoryKind::kHost);
          moved[j] = any_moved = true;
          ++stats.shards_grown;
        }
      }
    }
    pool.Clear();  // what this batch did not reuse (the bound counts it as released)
    // Staged old shards of this batch back on the device, for its exchange only.
    std::vector<Buffer> returned(sorted.size());
    for (size_t j = 0; j < sorted.size(); ++j) {
      const size_t t = static_cast<size_t>(sorted[j]);
      if (staged[t].size() == 0) continue;
      Status r = ReturnStagedForBatch(sw, state, t, old_view, returned[j], tally);
      if (!r.ok()) return fail(r, where);
      held += static_cast<int64_t>(returned[j].size());
    }
    const LocalPlan* run = &bp;
    LocalPlan trimmed;
    if (any_keep || any_moved) {
      trimmed = bp;
      // A moved tensor's resident pieces are in place: listed as covered (`lost` is what the
      // executor counts as covered and never writes).
      for (const PieceMove& m : trimmed.local_copies) {
        if (moved[static_cast<size_t>(m.tensor)]) trimmed.lost.push_back(m);
      }
      std::erase_if(trimmed.local_copies, [&](const PieceMove& m) {
        return keep[static_cast<size_t>(m.tensor)] || moved[static_cast<size_t>(m.tensor)];
      });
      for (size_t j = 0; j < sorted.size(); ++j) {
        if (keep[j]) trimmed.new_shards[j].reset();
      }
      run = &trimmed;
    }
    for (size_t j = 0; j < sorted.size(); ++j) {
      const size_t t = static_cast<size_t>(sorted[j]);
      const TensorInfo& info = plan.tensors[t];
      if (old_view[t].bytes > 0) olds.push_back({info.name, info.dtype, old_view[t]});
      if (fresh[j].size() > 0) news.push_back({info.name, info.dtype, fresh[j].view()});
    }
    stats.peak_state_bytes = std::max(stats.peak_state_bytes, held);
    int64_t device_staging = 0;
    StatusOr<ExecutorStats> r =
        RunBatch(sw, *run, sorted, olds, news, stats, &device_staging, deadline);
    if (!r.ok()) return fail(r.status(), where);
    stats.device.transfer_peak_bytes =
        std::max({stats.device.transfer_peak_bytes, tally.peak, tally.held + device_staging});
    stats.AddExecutor(*r);
    const auto t_release = Clock::now();
    stats.peak_bytes = std::max(stats.peak_bytes, held + r->staging_peak_bytes);
    for (size_t j = 0; j < sorted.size(); ++j) {
      const size_t t = static_cast<size_t>(sorted[j]);
      if (keep[j]) {
        new_buffers[t] = state.TakeShard(t);  // stays where it is
        old_view[t] = ConstBufferView();
        ++stats.shards_kept;
        continue;
      }
      // Freed early to bound the peak when new shards follow; a worker left without a rank
      // (a standby, a leaver) allocates none, so its old shards go after the closing barrier
      // (Install): freeing 0.5 GB takes 0.15-0.2 s here, which the others would wait for.
      if (!opt.keep_old_until_barrier && sw.new_rank_ >= 0 && old_view[t].bytes > 0) {
        held -= static_cast<int64_t>(old_view[t].bytes);
        if (device_path && OnDevice(sw, t)) tally.Sub(static_cast<int64_t>(old_view[t].bytes));
        if (staged[t].size() > 0) {  // the host copy went with old_view above; this is the device's
          held -= static_cast<int64_t>(returned[j].size());
          staged[t] = Buffer();
          returned[j] = Buffer();
        }
        old_host[t] = Buffer();
        if (recycle) {
          Buffer b = state.TakeShard(t);
          if (!pool.Put(b)) b = Buffer();
          if (!pool.Put(taken[t])) taken[t] = Buffer();
        }
        taken[t] = Buffer();  // a grow in place that could not move it
        state.ReleaseShard(t);
        old_view[t] = ConstBufferView();
      }
      if (fresh[j].size() == 0) continue;
      if (opt.stage_old_in_host) {
        // Into the tensor's own storage (device memory for a CUDA tensor), one at a time.
        StatusOr<Buffer> b = state.AllocateShard(t, static_cast<int64_t>(fresh[j].size()));
        if (!b.ok()) return fail(b.status(), where);
        held += static_cast<int64_t>(b->size());
        stats.peak_state_bytes = std::max(stats.peak_state_bytes, held);
        Status c = CopyBytes(b->view(), fresh[j].view());
        if (!c.ok()) return fail(c, where);
        held -= static_cast<int64_t>(fresh[j].size());
        fresh[j] = std::move(b).value();
      }
      new_buffers[t] = std::move(fresh[j]);
    }
    for (size_t j = 0; j < sorted.size(); ++j) {  // not released above: the host copy stays
      if (returned[j].size() == 0) continue;
      const size_t t = static_cast<size_t>(sorted[j]);
      old_view[t] = staged[t].view();
      tally.Sub(static_cast<int64_t>(returned[j].size()));
      held -= static_cast<int64_t>(returned[j].size());
      returned[j] = Buffer();
    }
    stats.release_seconds += Since(t_release);
    if (opt.after_batch) opt.after_batch(k);
  }
  pool.Clear();
  stats.peak_bytes = std::max(stats.peak_bytes, stats.peak_state_bytes);
  stats.device.transfer_peak_bytes = std::max(stats.device.transfer_peak_bytes, tally.peak);
  stats.seconds.transfer = Since(t_transfer);

  const auto t_resume = Clock::now();
  if (sw.aborted_.load()) return fail(AbortedError("aborted"), "before the scalar broadcast");
  int64_t scalar_bytes = 0;
  for (const ScalarSpec& s : state.scalars()) scalar_bytes += s.bytes;
  if (scalar_bytes > 0) {
    std::vector<std::byte> blob(static_cast<size_t>(scalar_bytes));
    size_t at = 0;
    for (const ScalarSpec& s : state.scalars()) {
      std::span<std::byte> v = *state.scalar(s.name);
      std::memcpy(blob.data() + at, v.data(), v.size());
      at += v.size();
    }
    // From the first participant whose state is used (participant 0 outside a recovery).
    int root = 0;
    while (root < sw.num_participants_ &&
           std::find(commit.change.stale.begin(), commit.change.stale.end(),
                     sw.participants_[static_cast<size_t>(root)]) != commit.change.stale.end()) {
      ++root;
    }
    Status b =
        sw.change_comm_->Broadcast(blob.data(), blob.size(), DType::kU8, root, opt.timeout);
    if (!b.ok()) return fail(b, "scalar broadcast from participant " + std::to_string(root));
    at = 0;
    for (const ScalarSpec& s : state.scalars()) {
      std::span<std::byte> v = *state.scalar(s.name);
      std::memcpy(v.data(), blob.data() + at, v.size());
      at += v.size();
    }
  }
  // Every participant's exchange completed (executor.h "Completion"): only now may old state go
  // and a leaver exit.
  Status barrier = sw.change_comm_->Barrier(opt.timeout);
  std::vector<Shard> shards(nt);
  for (size_t t = 0; t < nt; ++t) {
    if (plan.new_shards[t]) shards[t] = *plan.new_shards[t];
  }
  if (!barrier.ok()) {
    // This participant's exchange completed (a peer failed at the barrier): its new state is
    // whole. It is installed, so that if someone passed the barrier (the change applied) this
    // worker follows; if nobody did, the old state was kept intact only with
    // keep_old_until_barrier, and is lost otherwise (State::intact() says which).
    sw.new_complete_ = true;
    if (opt.keep_old_until_barrier) {
      sw.pending_shards_ = std::move(shards);
      sw.pending_buffers_ = std::move(new_buffers);
      sw.pending_install_ = true;
    } else {
      state.Install(sw.next_.config, sw.new_rank_, std::move(shards), std::move(new_buffers));
    }
    return fail(barrier, "closing barrier");
  }
  MarkApplied(sw);
  state.Install(sw.next_.config, sw.new_rank_, std::move(shards), std::move(new_buffers));
  stats.device.resume_bytes = device_path ? stats.device.new_bytes : 0;
  stats.seconds.resume = Since(t_resume);
  VLOG(1) << gen << ": participant " << sw.participant_ << " of " << sw.num_participants_
          << ", rank " << sw.old_rank_ << " -> " << sw.new_rank_ << ", " << stats.batches
          << " batches, sent " << stats.bytes_sent << " B, received " << stats.bytes_received
          << " B, copied " << stats.bytes_copied << " B, pre-allocated " << stats.preallocated_bytes
          << " B (waited " << stats.prealloc_wait_seconds << " s), recycled "
          << stats.recycled_bytes << " B, peak " << stats.peak_bytes << " B (bound "
          << stats.bound_bytes << " B); transfer " << stats.seconds.transfer << " s: alloc "
          << stats.alloc_seconds << " copy " << stats.copy_seconds << " pack " << stats.pack_seconds
          << " wait " << stats.wait_seconds << " unpack " << stats.unpack_seconds << " (executor "
          << stats.executor_seconds << ") release " << stats.release_seconds;
  return stats;
}

Status AdoptNewState(PreparedSwitch& sw, StateStore& state) {
  if (!sw.new_complete_) {
    return FailedPreconditionError("generation " + std::to_string(sw.next_.id) +
                                   ": this participant's exchange did not complete");
  }
  if (sw.pending_install_) {
    state.Install(sw.next_.config, sw.new_rank_, std::move(sw.pending_shards_),
                  std::move(sw.pending_buffers_));
    sw.pending_install_ = false;
  }
  return Status::Ok();
}

std::unique_ptr<GroupSet> TakeGroups(PreparedSwitch& prepared) {
  std::lock_guard<std::mutex> l(prepared.groups_mu_);
  prepared.device_transport_.reset();  // its communicator may be the world handed out
  prepared.union_ = UnionComm();
  return std::move(prepared.groups_);
}

Status ShrinkGroups(PreparedSwitch& prepared, std::unique_ptr<GroupSet> previous,
                    Deadline deadline) {
  const std::string gen = "generation " + std::to_string(prepared.next_.id);
  if (!prepared.shrink_groups_) {
    return FailedPreconditionError(gen + ": the prepared switch builds its own groups");
  }
  if (!previous || previous->generation() != prepared.from_.id) {
    return FailedPreconditionError(
        gen + ": shrinking needs generation " + std::to_string(prepared.from_.id) +
        "'s groups, got " +
        (previous ? "generation " + std::to_string(previous->generation()) : "none"));
  }
  if (prepared.aborted_.load()) return AbortedError(gen + ": switch aborted");
  GroupBuilder builder(prepared.factory_);
  MORPH_ASSIGN_OR_RETURN(
      std::unique_ptr<GroupSet> shrunk,
      builder.Rebuild(std::move(previous), prepared.leaving_, ShrinkMode::kFailure,
                      *prepared.store_, prepared.next_.config, deadline),
      gen << ": communicators of rank " << prepared.new_rank_ << " shrunk from generation "
          << prepared.from_.id);
  std::lock_guard<std::mutex> l(prepared.groups_mu_);
  prepared.groups_ = std::move(shrunk);
  if (prepared.aborted_.load()) {  // Abort() came while it shrank
    prepared.groups_->AbortAll();
    return AbortedError(gen + ": switch aborted");
  }
  return Status::Ok();
}

}  // namespace morph
