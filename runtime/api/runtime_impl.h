// Private to the runtime (not installed): Runtime::Impl, the state behind morph::Runtime and the
// machinery it runs on, defined across runtime.cc (Start, Bootstrap, the public calls),
// runtime_change.cc (building the next generation beside the running one, and the slow path of
// BeginStep: decisions, the switch, recovery), runtime_recovery.cc (buddy snapshots, aborting
// collectives), commit_vote.cc (CommitUpdate), checkpoint_api.cc and program_store.cc.
// Threads: the training thread owns everything unless a member's comment says otherwise; the
// control (agent) thread calls StartPrepare, AbandonPrepare, AbortCollectives.
#ifndef MORPH_RUNTIME_API_RUNTIME_IMPL_H_
#define MORPH_RUNTIME_API_RUNTIME_IMPL_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/gloo/gloo_communicator.h"
#include "collectives/groups.h"
#include "collectives/store/tcp_store.h"
#include "runtime/agent/agent.h"
#include "morph/dataset_cursor.h"
#include "runtime/switch/change_builder.h"
#include "runtime/switch/live_groups.h"
#include "runtime/switch/switch.h"
#include "morph/runtime.h"
#include "collectives/shm/shm_arena.h"
#include "runtime/state/step_core.h"
#include "runtime/state/undo.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/ha/leader_watch.h"
#include "runtime/recovery/checkpointer.h"
#include "runtime/recovery/snapshot.h"

namespace morph {

using SteadyClock = std::chrono::steady_clock;

inline double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

// Set by SIGTERM's handler (Runtime::RequestLeaveFromSignal), read at step boundaries.
std::atomic<bool>& LeaveRequestedBySignal();

struct Runtime::Impl {
  // Options::host_arena: the storage of morph-owned host shards, and the change transports'
  // arena (CommTransportOptions::arena). First member: it outlives every transport; its buffers
  // keep its bookkeeping alive on their own.
  std::unique_ptr<ShmArena> host_arena;
  Options opts;
  JobManifest manifest;
  StateStore state;
  std::unique_ptr<Coordinator> coordinator;
  // The coordinator is a failover candidate hosted by this worker (Bootstrap::kEtcd): Finish
  // hands its lead over unless the job ends with this worker (FinishCandidate).
  bool candidate = false;
  std::shared_ptr<EtcdClient> etcd;  // with Options::etcd
  std::shared_ptr<LeaderWatch> leader_watch;  // with Options::etcd: who leads now
  std::unique_ptr<Agent> agent;
  std::unique_ptr<TcpStoreClient> store;  // the job's store, generation of the last change
  std::shared_ptr<GlooDevice> device;
  CommunicatorFactory factory;
  bool cuda_state = false;  // some registered tensor lives in CUDA memory (set in Start)
  bool adopted_state = false;  // some tensor's storage is the user's (AdoptTensor; set in Start)
  // Every adopted tensor's allocator may be called from any thread (TensorAllocator::any_thread).
  bool adopted_any_thread = true;
  // Per tensor: registered in CUDA memory (set in Start); the NCCL data plane's device, -1: Gloo.
  std::vector<bool> device_tensors;
  int cuda_device = -1;
  // The running generation's communicators, and the next generation's built beside them.
  LiveGroups live;
  std::unique_ptr<ChangeBuilder> builder;  // from Bootstrap on
  // When the control thread aborted the collectives for a failure (steady clock, 0: never).
  std::atomic<int64_t> aborted_at_ns{0};
  Generation gen;
  std::optional<DatasetCursor> cursor;
  int64_t next_step = 0;
  // The step lifecycle: open, updating, failed (torn or whole), finished (step_core.h).
  StepCore core;
  bool fresh = false;
  bool done_sent = false;
  std::function<void(const Reconfiguration&)> on_reconfigure;
  std::optional<Reconfiguration> last_reconfiguration;
  // A switch inside Start (a joiner's first generation): its first step is reconfigured().
  bool joined_by_change = false;

  // Control thread: a failure (a recovery's prepare, the coordinator gone): every collective
  // of the running generation returns kAborted from now on, so the training thread reaches its
  // step boundary instead of hanging on a dead peer.
  void AbortCollectives(const std::string& why, int64_t generation = -1);

  // MORPH_UNDO_COPY: this rank's state as it was at its last BeginUpdate.
  UndoCopy undo;
  bool undo_warned = false;
  int64_t UndoStep() { return opts.undo_copy ? undo.StepFor(state, gen.id) : -1; }
  void PutBackUndo();

  // Periodic checkpoints (MORPH_CHECKPOINT_DIR / _EVERY): the last resort of a recovery.
  std::unique_ptr<PeriodicCheckpointer> checkpointer;
  // The step the last switch restored from a checkpoint (resume at start, a checkpoint
  // recovery), -1 otherwise: that step is on storage already and is not saved again.
  int64_t restored_step = -1;
  // In-memory buddy snapshots (MORPH_SNAPSHOT_EVERY): a recovery's source when a piece has no
  // live copy left (runtime/recovery/snapshot.h). Training thread only.
  std::unique_ptr<BuddySnapshotter> snapshots;
  bool snapshot_warned = false;  // one warning per generation for a snapshot not taken

  // The snapshots' generation: collectively over `gen`'s world, through its store (this
  // worker's host under "snapshot/host/<rank>", then everyone's). A failure only turns the
  // snapshots off for this generation (the recovery then has the other sources).
  void StartSnapshots();

  // What this worker can serve from its snapshots of the current generation (a recovery report);
  // a round in flight is cut off first (Abort, not waited for; its copies are not used).
  SnapshotHoldings EndSnapshots();

  // `next`: the generation a prepare builds (what its new shards are pre-allocated with:
  // StateStore::AllocationBytes).
  SwitchOptions SwitchOpts(const Generation* next = nullptr) const;
  void SetDevicePath(SwitchOptions& s) const;  // the NCCL data plane's device path

  // Control thread: a prepare for a generation this worker takes part in (ChangeBuilder::Start;
  // a recovery's aborts the running generation's collectives first).
  void StartPrepare(const PrepareMsg& p, std::function<void()> ready);

  // The training thread applies `c` (its switch step, or a joiner's first generation).
  Status Switch(const CommitMsg& c, SteadyClock::time_point entered);

  // Installs what `p`'s switch built (its groups, its store) as the running generation. The
  // old generation's communicators and the change communicator are done with (the closing
  // barrier passed); LiveGroups tears them down beside the next steps.
  void AdoptGroups(ChangeBuilder::BuiltPtr p);

  // A switch that failed only at its closing barrier while the change applied elsewhere: this
  // worker's new state is whole; it follows into the new generation.
  bool FollowAppliedChange(const CommitMsg& c);
  ChangeBuilder::BuiltPtr half_applied;

  Status Reshard(const CommitMsg& c, Deadline deadline, Reconfiguration& r);

  // Waits for and applies decisions until step `next_step` may begin (or this worker is done).
  StatusOr<bool> SlowPath(bool& reconfigured);

  // A recovery's step report (the agent said kReport): the state's step, whether it is whole,
  // the snapshots, the undo copy and the commit vote.
  Status ReportRecoveryState();

  // The commit vote (Runtime::CommitUpdate): the step whose vote completed last on this worker
  // in the current generation, and the step whose vote it cast without learning the outcome
  // (-1: none). Both reset at every switch (a rollback re-reaches older steps).
  int64_t committed_step = -1;
  int64_t vote_step = -1;
  // One element allreduced over `groups->world()` (a device buffer when the world is NCCL).
  Status Vote(int64_t step);
  // CommitUpdate after a vote that did not complete here: reports, waits for the recovery's
  // commit, and says whether this step's update is to be applied (its vote passed elsewhere).
  StatusOr<bool> AwaitVoteOutcome(int64_t step);

  Status Bootstrap();
  // Runtime::Finish of a worker that hosts a failover candidate: a follower stops; a leader
  // hosts the job to its end when the job ends with this worker, else hands the lead over.
  Status FinishCandidate(int64_t timeout_ms);
  // Resigns the lead and waits for another candidate to take it; when none does, leads again
  // and hosts the job to its end.
  Status HandOver(Deadline deadline);

  // The worker holding rank `r` of this worker's group `group` (a GroupBuilder name: "world",
  // "dp/...", "tp/...", "pp/..."), or 0 when that cannot be told.
  WorkerId WorkerOfGroupRank(const std::string& group, int r) const;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_API_RUNTIME_IMPL_H_
