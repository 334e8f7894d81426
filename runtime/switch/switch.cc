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
      MORPH_ASSIGN_OR_RETURN(
          buffers[t],
          state.AllocateShard(t, bytes, state.AllocationBytes(t, commit.next.config, rank, bytes)),
          gen);
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

// Phase 1: the commit is the change this worker prepared.
Status SwitchExecution::ValidateCommit(const PreparedSwitch& sw, const CommitMsg& commit,
                                       const std::string& gen) {
  MORPH_RETURN_IF_ERROR(CheckCommit(sw, commit));
  ChangeParticipants prepared = sw.change_;
  prepared.stale = commit.change.stale;  // a recovery's commit adds them
  if (!(commit.change == prepared)) {
    return FailedPreconditionError(gen + ": the commit's participants differ from the prepare's");
  }
  return Status::Ok();
}

// Phase 2: the plan of a recovery depends on its commit (the stale participants).
Status SwitchExecution::ReplanRecovery(PreparedSwitch& sw, const CommitMsg& commit,
                                       const std::string& gen) {
  if (!commit.change.recovery || sw.executed_) return Status::Ok();
  const auto t_plan = Clock::now();
  MORPH_ASSIGN_OR_RETURN(ChangePlan change,
                         PlanForChange(sw.manifest_, sw.from_, commit.next, commit.change), gen);
  MORPH_RETURN_IF_ERROR(CheckDigest(change, commit.next.plan_digest)) << gen;
  sw.next_ = commit.next;
  sw.change_ = commit.change;
  MORPH_RETURN_IF_ERROR(PlanSwitch(sw, change, sw.options_));
  sw.planned_.seconds.plan += Since(t_plan);
  return Status::Ok();
}

// Phase 3: the state is what the plan's old shards describe: the job's manifest, laid out for
// the generation the change starts from (a stale participant's is not used: it goes at once).
Status SwitchExecution::CheckStateAgainstPlan(const PreparedSwitch& sw, const CommitMsg& commit,
                                              StateStore& state, const std::string& gen) {
  JobManifest mine = sw.manifest_;
  state.FillManifest(mine);
  const std::string diff = FirstDifference(sw.manifest_, mine);
  if (!diff.empty()) {
    return FailedPreconditionError(gen + ": the state differs from the job's manifest: " + diff);
  }
  if (sw.first_generation()) return Status::Ok();
  const std::vector<WorkerId>& stale = commit.change.stale;
  if (commit.change.recovery && std::find(stale.begin(), stale.end(), sw.me_) != stale.end()) {
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
  return Status::Ok();
}

// The first generation: nothing moves; each rank's shards are allocated where they are.
StatusOr<SwitchStats> SwitchExecution::MaterializeFirst(const PreparedSwitch& sw,
                                                        StateStore& state,
                                                        const std::string& gen) {
  SwitchStats stats = sw.planned_;
  const auto t0 = Clock::now();
  MORPH_RETURN_IF_ERROR(state.Materialize(sw.next_.config, sw.new_rank_)) << gen;
  stats.new_bytes = stats.peak_state_bytes = stats.peak_bytes = state.local_bytes();
  stats.bound_bytes = stats.new_bytes;
  stats.seconds.resume = Since(t0);
  return stats;
}

// The phases, in order: validate the commit; a recovery from a checkpoint or snapshots goes its
// own way; re-plan a recovery; check the state against the plan; move the state in batches,
// hand over the scalars and close (SwitchExecution, switch_execute.cc).
StatusOr<SwitchStats> ExecuteSwitch(PreparedSwitch& sw, const CommitMsg& commit, StateStore& state,
                                    Deadline deadline) {
  const std::string gen = "switch to generation " + std::to_string(sw.next_.id);
  MORPH_RETURN_IF_ERROR(SwitchExecution::ValidateCommit(sw, commit, gen));
  using Source = RecoveryDecision::Source;
  const bool recovery = commit.change.recovery;
  if (recovery && commit.recovery.source == Source::kCheckpoint) {
    if (sw.aborted_.load()) return AbortedError(gen + ": aborted");
    sw.executed_ = true;
    return RestoreFromCheckpoint(sw, commit, state, deadline);
  }
  const bool from_snapshots = recovery && commit.recovery.source == Source::kSnapshot;
  if (!from_snapshots) {
    MORPH_RETURN_IF_ERROR(SwitchExecution::ReplanRecovery(sw, commit, gen));
  }
  if (sw.executed_) return FailedPreconditionError(gen + ": already executed");
  if (sw.aborted_.load()) return AbortedError(gen + ": aborted");
  sw.executed_ = true;
  // What the change transport received by shared memory, by path (one transport per switch).
  auto with_shm = [&sw](StatusOr<SwitchStats> r) -> StatusOr<SwitchStats> {
    if (r.ok() && sw.transport_) {
      const ShmChannel::Stats shm = sw.transport_->shm_stats();
      r->shm_mapped_bytes = static_cast<int64_t>(shm.mapped_bytes);
      r->shm_vm_readv_bytes = static_cast<int64_t>(shm.vm_readv_bytes);
    }
    return r;
  };
  if (from_snapshots) return with_shm(RestoreFromSnapshots(sw, commit, state, deadline));
  state.Seal();
  MORPH_RETURN_IF_ERROR(SwitchExecution::CheckStateAgainstPlan(sw, commit, state, gen));
  if (sw.first_generation()) return SwitchExecution::MaterializeFirst(sw, state, gen);
  return with_shm(SwitchExecution(sw, commit, state, deadline).Run());
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
