// A recovery from buddy snapshots (switch.h "Recovery", runtime/plan/snapshot_plan.h).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "base/logging.h"
#include "reshard/plan_digest.h"
#include "runtime/switch/switch_internal.h"
#include "runtime/plan/snapshot_plan.h"

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool HasOldShards(const LocalPlan& p) {
  for (const auto& s : p.old_shards) {
    if (s && !s->empty()) return true;
  }
  return false;
}

}  // namespace

StatusOr<SwitchStats> RestoreFromSnapshots(PreparedSwitch& sw, const CommitMsg& commit,
                                           StateStore& state, Deadline deadline) {
  const int64_t step = commit.next.start_step;
  const std::string gen = "recovery into generation " + std::to_string(commit.next.id) +
                          " from the snapshots of step " + std::to_string(step);
  const SwitchOptions& opt = sw.options_;
  if (!opt.snapshot) return FailedPreconditionError(gen + ": this worker keeps no snapshots");
  if (!sw.transport_ || !sw.change_comm_) {
    return FailedPreconditionError(gen + ": no change communicator");
  }
  SwitchStats stats = sw.planned_;
  const auto t_plan = Clock::now();
  const std::vector<WorkerId>& holders = commit.recovery.snapshot_holders;
  MORPH_ASSIGN_OR_RETURN(
      SnapshotChangePlan plan,
      PlanForSnapshot(sw.manifest_, sw.from_, commit.next, commit.change, holders), gen);
  if (plan.digest != commit.next.plan_digest) {
    return FailedPreconditionError(gen + ": plan digest mismatch: coordinator " +
                                   DigestHex(commit.next.plan_digest) + ", computed " +
                                   DigestHex(plan.digest));
  }
  MORPH_ASSIGN_OR_RETURN(SnapshotRounds rounds, PlanSnapshotRounds(plan, sw.participant_), gen);
  sw.next_ = commit.next;
  sw.change_ = commit.change;
  sw.new_rank_ = commit.next.RankOf(sw.me_);
  stats.seconds.plan += Since(t_plan);

  // Each round's old shards come from one snapshot copy: round A's from this worker's own (of
  // its old rank), round B's from the one it holds for its ward (the old rank it serves).
  int ward = -1;
  for (size_t r = 0; r < holders.size(); ++r) {
    if (holders[r] == sw.me_ && sw.from_.ranks[r] != sw.me_) ward = static_cast<int>(r);
  }
  auto sources = [&](const LocalPlan& p, bool held, std::vector<OldShardData>& olds) -> Status {
    if (!HasOldShards(p)) return Status::Ok();
    const int rank = held ? ward : sw.old_rank_;
    const std::string what = (held ? "the copy it holds of old rank " : "its own copy (old rank ") +
                             std::to_string(rank) + (held ? "" : ")");
    const SnapshotData* d = opt.snapshot(step, held);
    if (d == nullptr) return DataLossError(gen + ": this worker lost " + what);
    if (d->generation != sw.from_.id || d->rank != rank || !(d->config == sw.from_.config) ||
        d->shards.size() != p.tensors.size() || d->tensors.size() != p.tensors.size()) {
      return FailedPreconditionError(
          gen + ": " + what + " is a snapshot of generation " + std::to_string(d->generation) +
          " rank " + std::to_string(d->rank) + " (" + d->config.ToString() + ", " +
          std::to_string(d->shards.size()) + " tensors), the change starts from generation " +
          std::to_string(sw.from_.id) + " (" + sw.from_.config.ToString() + ")");
    }
    for (size_t t = 0; t < p.tensors.size(); ++t) {
      const auto& s = p.old_shards[t];
      if (!s || s->empty()) continue;
      if (held && d->shards[t].empty()) {  // its ward did not send it (BuddyCopiedTensors)
        return DataLossError(gen + ": " + what + " holds no piece of tensor '" + p.tensors[t].name +
                             "'");
      }
      if (!(d->shards[t] == *s)) {
        return FailedPreconditionError(gen + ": " + what + " holds another shard of tensor '" +
                                       p.tensors[t].name + "' than the plan's");
      }
      olds.push_back({p.tensors[t].name, p.tensors[t].dtype, d->tensors[t]});
    }
    return Status::Ok();
  };
  std::vector<OldShardData> own_olds, held_olds;
  MORPH_RETURN_IF_ERROR(sources(rounds.own, false, own_olds));
  MORPH_RETURN_IF_ERROR(sources(rounds.held, true, held_olds));

  auto fail = [&](Status s, const std::string& where) {
    std::string peers = NamePeers(s, sw.participants_);
    if (!peers.empty()) s = s.WithContext("failed peers: " + peers);
    return s.WithContext(gen + ": " + where);
  };
  const auto t_transfer = Clock::now();
  // The live state is not read, but its memory is used: a tensor whose new shard here is its
  // live one (a parameter replicated over DP when only dp changes) is restored in place, into
  // pages already faulted in; the others' pages back the new shards (PagePool; morph-owned
  // host storage only, as in a switch's recycling). On this VM a fresh page costs about as
  // much as copying it, and the exchange writes every byte of every new shard.
  const size_t nt = rounds.own.tensors.size();
  const bool recycle = static_cast<bool>(opt.preallocate);
  std::vector<Shard> shards(nt);
  std::vector<Buffer> buffers(nt);
  std::vector<NewShardData> news;
  std::vector<int64_t> new_bytes(nt, 0);
  PagePool pool;
  state.MarkTorn();
  if (state.tensors().size() != nt) {
    return FailedPreconditionError(gen + ": the state has " +
                                   std::to_string(state.tensors().size()) + " tensors, the plan " +
                                   std::to_string(nt));
  }
  for (size_t t = 0; t < nt; ++t) {
    const auto& s = rounds.own.new_shards[t];
    if (s) new_bytes[t] = s->NumElements() * DTypeSize(rounds.own.tensors[t].dtype);
    const State::TensorRef live = state.TensorAt(t);
    if (s && new_bytes[t] > 0 && live.shard == *s && live.data.kind == MemoryKind::kHost &&
        static_cast<int64_t>(live.data.bytes) == new_bytes[t]) {
      buffers[t] = state.TakeShard(t);
      ++stats.shards_kept;
      continue;
    }
    if (recycle && live.data.bytes > 0) {
      Buffer b = state.TakeShard(t);
      if (pool.Put(b)) continue;
    }
    state.ReleaseShard(t);
  }
  for (size_t t = 0; t < nt; ++t) {
    const auto& s = rounds.own.new_shards[t];
    if (!s) continue;
    shards[t] = *s;
    const int64_t bytes = new_bytes[t];
    if (bytes == 0) continue;
    stats.new_bytes += bytes;
    if (buffers[t].size() == 0) {
      const auto t_alloc = Clock::now();
      StatusOr<Buffer> b = Buffer();
      size_t recycled = 0;
      if (recycle && pool.bytes() > 0) {
        b = pool.Get(static_cast<size_t>(bytes), &recycled);
        stats.recycled_bytes += static_cast<int64_t>(recycled);
      } else {
        b = state.AllocateShard(t, bytes,
                                state.AllocationBytes(t, sw.next_.config, sw.new_rank_, bytes));
      }
      // Faulted in at once: half the cost of faulting by the copy or receive (switch.h).
      if (b.ok() && recycle && recycled < b->size()) {
        Status f = PrefaultHost(
            {static_cast<char*>(b->data()) + recycled, b->size() - recycled, MemoryKind::kHost});
        if (!f.ok()) b = f;
      }
      stats.alloc_seconds += Since(t_alloc);
      if (!b.ok()) {
        return fail(b.status(), "new shard of tensor '" + rounds.own.tensors[t].name + "'");
      }
      buffers[t] = std::move(b).value();
    }
    news.push_back({rounds.own.tensors[t].name, rounds.own.tensors[t].dtype, buffers[t].view()});
  }
  pool.Clear();
  stats.peak_state_bytes = stats.new_bytes;
  auto run = [&](const LocalPlan& p, const std::vector<OldShardData>& olds,
                 const std::string& where) -> Status {
    if (sw.aborted_.load()) return fail(AbortedError("aborted"), where);
    StatusOr<ExecutorStats> r = ExecutePlan(p, olds, news, *sw.transport_, sw.executor_, deadline);
    if (!r.ok()) return fail(r.status(), where);
    stats.AddExecutor(*r);
    return Status::Ok();
  };
  MORPH_RETURN_IF_ERROR(run(rounds.own, own_olds, "round A (own copies)"));
  if (plan.held) {
    MORPH_RETURN_IF_ERROR(run(rounds.held, held_olds, "round B (held copies)"));
  }
  stats.peak_bytes = stats.peak_state_bytes + stats.peak_staging_bytes;
  stats.batches = plan.held ? 2 : 1;
  stats.seconds.transfer = Since(t_transfer);

  // Scalars: from the first participant serving its own copy (old ranks come first, in order).
  const auto t_resume = Clock::now();
  int root = -1;
  for (size_t r = 0; r < holders.size() && root < 0; ++r) {
    if (holders[r] == sw.from_.ranks[r]) root = plan.own.IndexOf(holders[r]);
  }
  if (root < 0) return FailedPreconditionError(gen + ": no participant serves its own copy");
  int64_t scalar_bytes = 0;
  for (const ScalarSpec& s : state.scalars()) scalar_bytes += s.bytes;
  if (scalar_bytes > 0) {
    std::vector<std::byte> blob(static_cast<size_t>(scalar_bytes));
    if (sw.participant_ == root) {
      const SnapshotData* d = opt.snapshot(step, false);
      if (d == nullptr || d->scalars.size() != state.scalars().size()) {
        return DataLossError(gen + ": the scalar root lost its own copy's scalars");
      }
      size_t at = 0;
      for (size_t i = 0; i < d->scalars.size(); ++i) {
        if (static_cast<int64_t>(d->scalars[i].size()) != state.scalars()[i].bytes) {
          return FailedPreconditionError(gen + ": scalar '" + state.scalars()[i].name +
                                         "' has another size in the snapshot");
        }
        std::memcpy(blob.data() + at, d->scalars[i].data(), d->scalars[i].size());
        at += d->scalars[i].size();
      }
    }
    Status b = sw.change_comm_->Broadcast(blob.data(), blob.size(), DType::kU8, root, opt.timeout);
    if (!b.ok()) return fail(b, "scalar broadcast from participant " + std::to_string(root));
    size_t at = 0;
    for (const ScalarSpec& s : state.scalars()) {
      std::span<std::byte> v = *state.scalar(s.name);
      std::memcpy(v.data(), blob.data() + at, v.size());
      at += v.size();
    }
  }
  Status barrier = sw.change_comm_->Barrier(opt.timeout);
  // The exchange completed here: the new state is whole (installed either way, so that this
  // worker can follow if the change applied elsewhere; its live state is gone already).
  state.Install(sw.next_.config, sw.new_rank_, std::move(shards), std::move(buffers));
  if (!barrier.ok()) {
    sw.new_complete_ = true;
    return fail(barrier, "closing barrier");
  }
  MarkApplied(sw);
  stats.seconds.resume = Since(t_resume);
  if (opt.restored_from_own_snapshot && !own_olds.empty()) {
    // The tensors round A wrote whole from this worker's own copy, into the same shard.
    const SnapshotData* own = opt.snapshot(step, false);
    std::vector<int64_t> local(nt, 0);
    std::vector<bool> other(nt, false);
    for (const PieceMove& m : rounds.own.local_copies) {
      local[static_cast<size_t>(m.tensor)] += m.box.NumElements().value_or(0);
    }
    for (const auto* list : {&rounds.own.recvs, &rounds.held.recvs, &rounds.held.local_copies}) {
      for (const PieceMove& m : *list) other[static_cast<size_t>(m.tensor)] = true;
    }
    std::vector<bool> whole(nt, false);
    for (size_t t = 0; t < nt && own != nullptr && own->shards.size() == nt; ++t) {
      const auto& ns = rounds.own.new_shards[t];
      whole[t] =
          ns && !ns->empty() && !other[t] && own->shards[t] == *ns && local[t] == ns->NumElements();
    }
    opt.restored_from_own_snapshot(step, std::move(whole));
  }
  VLOG(1) << gen << ": participant " << sw.participant_ << ", rank " << sw.old_rank_ << " -> "
          << sw.new_rank_ << ", sent " << stats.bytes_sent << " B, received "
          << stats.bytes_received << " B, copied " << stats.bytes_copied << " B; transfer "
          << stats.seconds.transfer << " s: alloc " << stats.alloc_seconds << " (recycled "
          << stats.recycled_bytes << " B, kept " << stats.shards_kept << "), executor "
          << stats.executor_seconds << " (copy " << stats.copy_seconds << ", pack "
          << stats.pack_seconds << ", wait " << stats.wait_seconds << ", unpack "
          << stats.unpack_seconds << "); resume " << stats.seconds.resume << " s";
  return stats;
}

}  // namespace morph
