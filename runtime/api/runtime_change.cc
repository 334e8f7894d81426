#include <glog/logging.h>

#include <algorithm>
#include <filesystem>

#include "runtime/api/data_plane.h"
#include "runtime/api/runtime_impl.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>

#include "collectives/nccl/nccl_communicator.h"
#endif

namespace morph {
namespace {

const char* SourceName(RecoveryDecision::Source s) {
  switch (s) {
    case RecoveryDecision::Source::kReplicas:
      return "replicas";
    case RecoveryDecision::Source::kSnapshot:
      return "snapshots";
    case RecoveryDecision::Source::kCheckpoint:
      return "checkpoint";
  }
  return "?";
}

}  // namespace

// Device memory by phase next to its bound (switch.h "Device memory").
static void LogDevicePath(const LogContext& log, int64_t generation,
                          const SwitchStats::Device& d) {
  MORPH_LOG(INFO, log) << "generation " << generation << ": device state " << d.old_bytes << " -> "
            << d.new_bytes << " B over the union communicator (" << d.union_source << "), sent "
            << d.bytes_sent << " B; device bytes held: " << d.prepare_bytes << " at start, peak "
            << d.transfer_peak_bytes << " (bound " << d.bound_bytes << "), " << d.resume_bytes
            << " at the end" << (d.staged_bytes > 0 ? ", old shards staged to pinned host: " +
                                                          std::to_string(d.staged_bytes) + " B"
                                                    : std::string());
}

// NCCL data plane and morph-owned CUDA state (the registration, so the same on every worker,
// joiners included): device shards move over NCCL between device buffers (switch.h "Device
// path"), old shards staged to pinned host memory only when cudaMemGetInfo says the device cannot
// hold the change (5% of the device kept for NCCL and the kernels).

void Runtime::Impl::SetDevicePath(SwitchOptions& s) const {
#if MORPH_WITH_CUDA
  if (!cuda_state || adopted_state || cuda_device < 0) return;
  const int d = cuda_device;
  s.stage_old_in_host = false;
  s.device.tensors = device_tensors;
  // The union's and the step groups' creations end on an abort (ChangeBuilder::AbortFrom).
  s.device.factory = NcclFactory(d, s.cancel);
  s.groups_factory = RouteStepGroups(NcclFactory(d, s.cancel), GlooFactory(device));
  s.device.new_world_on_device = true;  // the step groups are NCCL (RouteStepGroups)
  s.device.memory = [d] { return CudaDeviceMemory(d); };
  s.device.free_bytes = [d]() -> int64_t {
    size_t free = 0, total = 0;
    if (cudaSetDevice(d) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) return -1;
    return static_cast<int64_t>(free) - static_cast<int64_t>(total / 20);
  };
  s.device.pinned_host = PinnedHostAllocator();
#else
  (void)s;
#endif
}

SwitchOptions Runtime::Impl::SwitchOpts(const Generation* next) const {
  SwitchOptions s;
  s.cancel = std::make_shared<BuildCancel>();  // one per prepare (ChangeBuilder::AbortFrom)
  s.keep_old_until_barrier = opts.keep_old_until_barrier;
  // The change communicator is Gloo (host memory only): CUDA shards go through host copies,
  // unless they take the device path below.
  s.stage_old_in_host = cuda_state;
  SetDevicePath(s);
  // Host shards, morph-owned or from allocators callable from any thread: new ones are
  // allocated and pre-faulted while the old generation trains (switch.h "Pre-allocation").
  // Storage from the host arena is a memfd mapping: its pages are never moved (pages_movable).
  if (adopted_state || host_arena) {
    s.fixed_storage.resize(manifest.tensors.size());
    for (size_t t = 0; t < manifest.tensors.size(); ++t) {
      s.fixed_storage[t] = !state.pages_movable(t);
    }
  }
  if (!cuda_state && (!adopted_state || adopted_any_thread)) {
    const ParallelConfig config = next != nullptr ? next->config : ParallelConfig();
    const int rank = next != nullptr ? next->RankOf(agent->id()) : -1;
    s.preallocate = [this, config, rank](size_t t, size_t bytes) {
      const auto n = static_cast<int64_t>(bytes);
      return state.AllocateShard(t, n, state.AllocationBytes(t, config, rank, n));
    };
  }
  s.restore_checkpoint = [](const std::string& path, StateStore& st) {
    return RestoreFromCheckpoint(path, st);
  };
  // Read at the switch step (training thread), while `gen` is still the generation the
  // change starts from.
  s.snapshot = [this](int64_t step, bool held) -> const SnapshotData* {
    if (!snapshots) return nullptr;
    return held ? snapshots->Held(step, gen.id) : snapshots->Local(step, gen.id);
  };
  // The first snapshot after the rollback then copies only what the change moved.
  s.restored_from_own_snapshot = [this](int64_t step, std::vector<bool> tensors) {
    if (snapshots) snapshots->NoteRestored(step, gen.id, std::move(tensors));
  };
  s.batch_bytes = opts.batch_bytes;
  s.executor.chunk_bytes = manifest.chunk_bytes;
  s.executor.staging_bytes = manifest.staging_bytes;
  s.transport.shared_memory = opts.shared_memory;
  s.transport.arena = host_arena.get();  // outlives every transport (first member of Impl)
  s.timeout = std::chrono::milliseconds(opts.change_timeout_ms);
  s.previous_groups_can_shrink = live.can_shrink();
  return s;
}

void Runtime::Impl::StartPrepare(const PrepareMsg& p, std::function<void()> ready) {
  if (p.change.recovery) {
    AbortCollectives("generation " + std::to_string(p.next.id) + " recovers from a failure");
  }
  builder->Start(p, SwitchOpts(&p.next), std::move(ready));
}

void Runtime::Impl::PutBackUndo() {
  const int64_t v = UndoStep();
  MORPH_LOG(INFO, agent->log()) << "recovery: put back the undo copy of step " << v
            << " (the state was " << (core.torn() || !state.intact() ? "torn" : "whole")
            << " at step "
            << next_step << ")";
  undo.PutBack(state);
  core.UndoPutBack();
  next_step = v;
}

Status Runtime::Impl::Switch(const CommitMsg& c, SteadyClock::time_point entered) {
  const SteadyClock::time_point switch_start = SteadyClock::now();
  Deadline deadline = Deadline::AfterMs(opts.change_timeout_ms);
  Reconfiguration r{.from_generation = gen.id,
                    .generation = c.next.id,
                    .step = c.next.start_step,
                    .old_config = gen.config,
                    .config = c.next.config,
                    .old_rank = gen.RankOf(agent->id()),
                    .rank = c.next.RankOf(agent->id())};
  if (c.change.recovery) {
    r.recovery = true;
    r.source = c.recovery.source;
    r.newest_step = c.recovery.newest_step;
    r.stale = std::find(c.change.stale.begin(), c.change.stale.end(), agent->id()) !=
              c.change.stale.end();
    if (c.recovery.source == RecoveryDecision::Source::kCheckpoint) {
      r.checkpoint = c.recovery.checkpoint;
      r.resumed = c.from.id == 0;  // resume at start (MORPH_RESUME)
    }
    const int64_t at = aborted_at_ns.load();
    if (at != 0) {
      r.abort_seconds =
          static_cast<double>(SteadyClock::now().time_since_epoch() / std::chrono::nanoseconds(1) -
                              at) /
          1e9;
    }
  }
  if (c.change.recovery && !r.stale && c.recovery.source == RecoveryDecision::Source::kReplicas) {
    // The commit resumes at a step this worker holds (ChooseRecovery): its live state if whole
    // there, else its undo copy (the same rule as ChooseRecovery's).
    const int64_t v = c.next.start_step;
    const bool whole = !core.torn() && state.intact();
    if (!(whole && next_step == v) && UndoStep() == v) PutBackUndo();
  }
  Status st = Reshard(c, deadline, r);
  if (!st.ok()) {
    MORPH_LOG(ERROR, agent->log()) << "switch to generation " << c.next.id
               << " failed: " << st;
    Status sent = agent->SwitchDone(false, std::string(st.message()));
    if (!sent.ok()) MORPH_LOG(WARNING, agent->log()) << "applied(failed) not sent: " << sent;
    return st;
  }
  gen = c.next;
  next_step = c.next.start_step;
  restored_step = r.checkpoint.empty() ? -1 : r.step;
  core.Recovered();
  committed_step = -1;
  vote_step = -1;
  aborted_at_ns.store(0);
  StartSnapshots();
  // A worker that held no rank (a joiner, a standby) trained nothing that could stall: its
  // time in BeginStep before the commit is waiting for a rank, so it counts from the switch.
  r.stall_seconds = SecondsSince(r.old_rank < 0 ? switch_start : entered);
  auto us = [](double s) { return static_cast<int64_t>(s * 1e6); };
  MORPH_RETURN_IF_ERROR(
      agent->SwitchDone(true, "",
                        AppliedMsg::Phases{.communicators_us = us(r.communicators_seconds),
                                           .plan_us = us(r.plan_seconds),
                                           .transfer_us = us(r.transfer_seconds),
                                           .resume_us = us(r.resume_seconds),
                                           .stall_us = us(r.stall_seconds)}));
  MORPH_LOG(INFO, agent->log()) << "generation " << c.next.id << " ("
            << c.next.config.ToString() << ") rank " << r.rank << " from step " << r.step
            << "; switch " << r.stall_seconds << " s (communicators " << r.communicators_seconds
            << ", plan " << r.plan_seconds << ", transfer " << r.transfer_seconds << ", resume "
            << r.resume_seconds << ")"
            << (r.resumed ? "; resumed from checkpoint " +
                                std::filesystem::path(r.checkpoint).filename().string() + " (" +
                                r.checkpoint + ")" +
                                (r.lost_steps() > 0
                                     ? ", steps lost " + std::to_string(r.lost_steps()) +
                                           " (a newer checkpoint was damaged)"
                                     : std::string())
                : r.recovery ? "; recovery from " + std::string(SourceName(r.source)) +
                                   (r.stale ? " (stale state)" : "") + ", steps lost " +
                                   std::to_string(r.lost_steps())
                             : std::string());
  last_reconfiguration = r;
  if (on_reconfigure && r.rank >= 0) on_reconfigure(r);
  return Status();
}

void Runtime::Impl::AdoptGroups(ChangeBuilder::BuiltPtr p) {
  std::unique_ptr<GroupSet> next = TakeGroups(**p->result);
  const std::string current = builder->store_address();
  if (p->store && p->store_address != current && !p->store_address.empty()) {
    // Built through a leader that died since: this generation's store is the successor's
    // (buddy snapshots rendezvous there next).
    StatusOr<std::unique_ptr<TcpStoreClient>> moved = TcpStoreClient::Connect(
        current, opts.token, p->generation, Deadline::AfterMs(opts.change_timeout_ms));
    if (moved.ok()) {
      p->store = std::move(*moved);
      p->store_address = current;
    } else {
      MORPH_LOG(WARNING, agent->log()) << "generation " << p->generation
                                       << ": the new coordinator's store at " << current
                                       << " cannot be reached: " << moved.status();
    }
  }
  if (p->store) store = std::move(p->store);
  live.Adopt(std::move(next), std::move(p));
}

bool Runtime::Impl::FollowAppliedChange(const CommitMsg& c) {
  if (!half_applied || !half_applied->result.ok() || half_applied->generation != c.next.id) {
    return false;
  }
  if (!AdoptNewState(**half_applied->result, state).ok()) return false;
  AdoptGroups(std::move(half_applied));
  gen = c.next;
  next_step = c.next.start_step;
  MORPH_LOG(WARNING, agent->log()) << "follows generation " << c.next.id
               << " (its switch failed only at the closing barrier)";
  return true;
}

Status Runtime::Impl::Reshard(const CommitMsg& c, Deadline deadline, Reconfiguration& r) {
  // Take makes the change reachable by an abort until it ran here.
  struct Unreachable {
    ChangeBuilder& b;
    ~Unreachable() { b.Done(); }
  } unreachable{*builder};
  MORPH_ASSIGN_OR_RETURN(ChangeBuilder::BuiltPtr p, builder->Take(c, *store, SwitchOpts(), deadline));
  if (!p->result.ok()) return p->result.status();
  PreparedSwitch& prepared = **p->result;
  if (prepared.shrinks_groups()) {
    // A recovery where ranks only leave, on a backend that shrinks (NCCL): the new groups come
    // from the running ones, which the training thread no longer uses (their collectives were
    // aborted), before the exchange, so that a failure fails the switch.
    const auto t0 = SteadyClock::now();
    MORPH_RETURN_IF_ERROR(ShrinkGroups(prepared, live.Take(), deadline));
    r.communicators_seconds += SecondsSince(t0);
  }
  StatusOr<SwitchStats> executed = ExecuteSwitch(prepared, c, state, deadline);
  if (!executed.ok()) {
    if (prepared.new_state_complete()) half_applied = std::move(p);
    return executed.status();
  }
  SwitchStats stats = *executed;
  builder->Done();  // the old communicators' teardown stays on the reaper thread
  AdoptGroups(std::move(p));
  // Materialized zero-filled: the caller initializes (unless it resumed from a checkpoint).
  if (c.from.id == 0 && !c.change.recovery) fresh = true;
  r.communicators_seconds += stats.seconds.communicators;
  r.plan_seconds = stats.seconds.plan;
  r.transfer_seconds = stats.seconds.transfer;
  r.resume_seconds = stats.seconds.resume;
  r.bytes_sent = stats.bytes_sent;
  r.bytes_received = stats.bytes_received;
  r.bytes_copied = stats.bytes_copied;
  r.shm_mapped_bytes = stats.shm_mapped_bytes;
  r.shm_vm_readv_bytes = stats.shm_vm_readv_bytes;
  r.peak_bytes = stats.peak_bytes;
  r.bound_bytes = stats.bound_bytes;
  r.old_state_bytes = stats.old_bytes;
  r.prepare_bytes = stats.old_bytes + stats.preallocated_bytes;
  r.new_state_bytes = stats.new_bytes;
  if (!stats.device.union_source.empty()) LogDevicePath(agent->log(), c.next.id, stats.device);
  MORPH_VLOG(1, agent->log()) << "generation " << c.next.id << " host memory: "
      << stats.shards_preallocated << " shards pre-allocated (" << stats.preallocated_bytes
      << " B; waited " << stats.prealloc_wait_seconds << " s), " << stats.shards_grown
      << " grown in place, " << stats.shards_kept << " kept, " << stats.recycled_bytes
      << " B recycled; transfer: alloc " << stats.alloc_seconds << " s, copy "
      << stats.copy_seconds << ", pack " << stats.pack_seconds << ", wait " << stats.wait_seconds
      << ", unpack " << stats.unpack_seconds << ", release " << stats.release_seconds;
  return Status();
}

StatusOr<bool> Runtime::Impl::SlowPath(bool& reconfigured) {
  auto entered = SteadyClock::now();
  builder->JoinStale();
  while (true) {
    if (LeaveRequestedBySignal().exchange(false))
      agent->RequestLeave("SIGTERM (preemption notice)");
    // A worker without a rank (a spare, a joiner) waits as long as the job runs, looking at
    // the SIGTERM flag every 100 ms (a preempted spare's leave request goes out at once).
    bool ranked = gen.RankOf(agent->id()) >= 0;
    Deadline d = Deadline::AfterMs(ranked ? opts.change_timeout_ms : 100);
    StatusOr<Agent::Decision> dec = agent->Decide(next_step, d);
    if (!dec.ok()) {
      if (!ranked && dec.status().code() == StatusCode::kDeadlineExceeded) continue;
      if (core.failed()) {
        return dec.status().WithContext("step " + std::to_string(next_step) +
                                        " failed and no recovery followed");
      }
      return dec.status();
    }
    switch (dec->action) {
      case AgentCore::Action::kProceed:
        return false;
      case AgentCore::Action::kFinished:
        core.Finished();
        return true;
      case AgentCore::Action::kReport:
        // A recovery: the step the state holds, and whether it is whole.
        MORPH_RETURN_IF_ERROR(ReportRecoveryState());
        break;
      case AgentCore::Action::kCannotSwitch: {
        // This worker's generation failed before the committed start step: it cannot take
        // part; the change fails everywhere and a recovery follows.
        Status sent = agent->SwitchDone(
            false, "worker " + std::to_string(agent->id()) + ": step " + std::to_string(next_step) +
                       " failed before the switch step " +
                       std::to_string(dec->commit ? dec->commit->next.start_step : -1));
        if (!sent.ok()) return sent;
        StatusOr<bool> applied = agent->AwaitOutcome(Deadline::AfterMs(opts.change_timeout_ms));
        if (!applied.ok()) return applied.status();
        if (*applied) {
          return AbortedError("worker " + std::to_string(agent->id()) +
                              ": the others switched without it");
        }
        break;
      }
      case AgentCore::Action::kSwitch: {
        Status st = Switch(*dec->commit, entered);
        if (!st.ok()) {
          // The change failed here. If nobody passed its closing barrier the old generation
          // stands and a recovery follows (this worker's state as the switch left it);
          // otherwise the others went on without this worker's part: it cannot follow.
          const CommitMsg commit = *dec->commit;
          StatusOr<bool> applied = agent->AwaitOutcome(Deadline::AfterMs(opts.change_timeout_ms));
          if (!applied.ok()) return st;
          if (*applied) {
            if (!FollowAppliedChange(commit)) return st;
            half_applied.reset();
            break;  // in the new generation; its lost member's recovery follows
          }
          half_applied.reset();
          core.SwitchFailed(!state.intact());
          agent->NoteStepFailed();
          AbortCollectives("the switch to generation " + std::to_string(dec->commit->next.id) +
                           " failed: " + std::string(st.message()));
          break;
        }
        reconfigured = true;
        agent->NoteBegin(next_step);
        break;
      }
      case AgentCore::Action::kWait:
        break;
    }
  }
}

WorkerId Runtime::Impl::WorkerOfGroupRank(const std::string& group, int r) const {
  const int me = gen.RankOf(agent->id());
  if (me < 0 || r < 0) return 0;
  std::vector<int> ranks;
  const std::string kind = group.substr(0, group.find('/'));
  if (kind == "world") {
    return r < static_cast<int>(gen.ranks.size()) ? gen.ranks[r] : 0;
  } else if (kind == "dp") {
    ranks = gen.config.DpGroup(me);
  } else if (kind == "tp") {
    ranks = gen.config.TpGroup(me);
  } else if (kind == "pp") {
    ranks = gen.config.PpGroup(me);
  }
  if (r >= static_cast<int>(ranks.size())) return 0;
  return gen.ranks[ranks[r]];
}

}  // namespace morph
