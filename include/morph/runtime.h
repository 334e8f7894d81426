// Runtime: what a training binary links to become elastic (docs/design.md §3). It joins the job
// (options.h: bootstrap), registers the job's state, and at each step boundary applies a
// committed change of the allocation in place: new communicators, the state resharded between
// the survivors and joiners, the dataset cursor and scalar state moved, OnReconfigure called.
//
//   MORPH_ASSIGN_OR_RETURN(morph::Options opts, morph::Options::FromEnv());
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<morph::Runtime> rt,
//       morph::Runtime::Start(opts, [](morph::State& s) -> morph::Status {
//         MORPH_RETURN_IF_ERROR(s.AddTensor("w", {4096, 4096}, morph::DType::kF32,
//                                           morph::Layout::Layer(0).SplitTP(1)));
//         return s.AddScalar("rng", 16);
//       }));
//   if (rt->fresh_start()) InitWeights(rt->state());    // else the state came from peers
//   rt->OnReconfigure([&](const morph::Reconfiguration& r) { RebuildViews(rt->state()); });
//   while (true) {
//     MORPH_ASSIGN_OR_RETURN(morph::Step step, rt->BeginStep());
//     if (step.done()) break;                           // left the job, or the job ended
//     if (step.index() >= total_steps) break;           // (a recovery may resume at the end)
//     morph::Status st = ForwardBackward(step);         // step.dp(), step.samples(), ...
//     if (st.ok()) st = rt->CommitUpdate();             // the step's commit vote
//     if (!st.ok()) {                                   // a peer failed: BeginStep recovers
//       MORPH_RETURN_IF_ERROR(rt->AbortStep(st));
//       continue;
//     }
//     ApplyUpdate(rt->state());                         // local writes only
//     MORPH_RETURN_IF_ERROR(rt->EndStep());
//   }
//   return rt->Finish();                                // tells the coordinator; waits if hosting
//
// Threads: Start, BeginStep, CommitUpdate, EndStep, AbortStep, Finish and the callbacks belong
// to the training thread (the one that called Start); state() is the training thread's. The
// runtime runs one control thread of its own (the connection to the coordinator, heartbeats)
// and, between a change's prepare and its switch step, one thread building the new
// communicators.
// RequestLeave is async-signal-safe (the SIGTERM handler calls it).
#ifndef MORPH_RUNTIME_H_
#define MORPH_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "morph/api.h"
#include "morph/dataset_cursor.h"
#include "morph/generation.h"
#include "morph/key_value_store.h"
#include "morph/options.h"
#include "morph/state.h"
#include "morph/status.h"
#include "morph/step.h"

namespace morph {

// What a change did, handed to OnReconfigure after the state was moved.
struct MORPH_API Reconfiguration {
  int64_t from_generation = 0;
  int64_t generation = 0;
  int64_t step = 0;  // the first step of the new generation
  ParallelConfig old_config;
  ParallelConfig config;
  int old_rank = -1;  // -1: joined in this change
  int rank = -1;
  // Seconds of each phase on this worker (the switch step's stall is transfer + resume).
  double communicators_seconds = 0;
  double plan_seconds = 0;
  double transfer_seconds = 0;
  double resume_seconds = 0;
  // BeginStep(S) entry to return; for a worker that held no old rank (a joiner, a standby
  // given a rank) from the start of the switch, as its wait before that was for a rank.
  double stall_seconds = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  // Bytes the reshard copied locally (pieces of this worker's old shards into its new ones).
  int64_t bytes_copied = 0;
  // Of bytes_received, what came from same-host peers by shared memory: mapped from the
  // sender's host arena (Options::host_arena; one memcpy), or by process_vm_readv.
  int64_t shm_mapped_bytes = 0;
  int64_t shm_vm_readv_bytes = 0;
  // Most tensor-state + staging bytes held at once during the switch, and the bound
  // max(old, new) + largest batch + staging (runtime/switch/switch.h says when it holds).
  int64_t peak_bytes = 0;
  int64_t bound_bytes = 0;
  // This worker's tensor-state bytes by phase: before the change (old shards), between the
  // prepare and the switch step (old shards + new shards pre-allocated beside them), and after
  // it (new shards). With peak_bytes (the switch) each phase stays within bound_bytes.
  int64_t old_state_bytes = 0;
  int64_t prepare_bytes = 0;
  int64_t new_state_bytes = 0;
  // A recovery (a failure, docs/design.md §4): where the state came from, and the steps lost.
  // Training resumes at `step`; steps [step, newest_step) had been trained by some worker and
  // are trained again (none when the survivors' newest state was whole).
  bool recovery = false;
  RecoverySource source = RecoverySource::kReplicas;
  int64_t newest_step = 0;
  int64_t lost_steps() const { return recovery ? newest_step - step : 0; }
  // This worker's old state was not used (torn, or at another step): it received all of it.
  bool stale = false;
  // Failure detected (the abort reached this worker) -> the recovery's commit arrived.
  double abort_seconds = 0;
  // The job's first generation resumed from a checkpoint of an earlier run (resume at start:
  // recovery is true, source kCheckpoint; steps lost only when a newer checkpoint was damaged
  // and passed over, newest_step being its step).
  bool resumed = false;
  // A recovery or resume from a checkpoint: its folder (<dir>/step-<step>-g<generation>).
  std::string checkpoint;
};

class MORPH_API Runtime {
 public:
  using Declare = std::function<Status(State&)>;

  // Joins the job, registers the state `declare` adds, and returns once this worker holds a
  // rank in a committed generation with its state in place: freshly allocated (zero-filled) in
  // the job's first generation (fresh_start()), or received from peers when joining a running
  // job, or — a job restarted with resume at start (Options::resume, MORPH_RESUME) on a folder
  // holding a complete checkpoint — read from the newest one: then fresh_start() is false,
  // next_step() is the checkpoint's step and last_reconfiguration()->resumed is true. A worker
  // that the job does not need yet (a standby spare) waits here until a change gives it a rank,
  // or until Start's timeout.
  // Errors: Options::Validate's and `declare`'s; kFailedPrecondition "registration differs from
  // the job's: <the first difference>" when this worker registered other tensors, shapes, dtypes
  // or layouts than the job; kFailedPrecondition "...checkpoint P does not match the registered
  // state: tensor 'T' ..." when the checkpoint to resume from holds other tensors, shapes,
  // dtypes or scalars (the job does not start); kUnauthenticated for a wrong token; kUnavailable /
  // kDeadlineExceeded when the coordinator cannot be reached or the job did not start in time.
  static StatusOr<std::unique_ptr<Runtime>> Start(Options options, const Declare& declare);

  // Without Finish(): the connection closes and the job treats this worker as lost (a hosting
  // process still runs Finish, so that the others keep their coordinator to the end).
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  State& state();
  bool fresh_start() const;  // the state was allocated here, not received: initialize it

  // Called on the training thread at the switch step, after the state moved and before
  // BeginStep returns. A joiner's own arrival happens inside Start, before it can register a
  // callback: it sees last_reconfiguration() and step.reconfigured() on its first step.
  void OnReconfigure(std::function<void(const Reconfiguration&)> callback);
  // The last change this worker took part in (its arrival, for a joiner), if any.
  const std::optional<Reconfiguration>& last_reconfiguration() const;

  // The step boundary. Steady state: one atomic load. When a change is committed for this step,
  // applies it first (the stall). When a change is being prepared and this worker promised not
  // to go further, waits for the decision. Returns the step to train; step.done() when this
  // worker left the job in the change, or was released because the job ended (another member
  // finished training while this one waited for a recovery): then Finished() is true.
  // Errors: kAborted / kUnavailable / kDeadlineExceeded naming the peer or phase when a change
  // failed on this worker (its state is then as switch.h describes) or the coordinator is gone.
  //
  // After a failure (another worker died, a collective failed here: AbortStep) it waits for the
  // recovery, applies it, and returns the step training resumes from: the same index again,
  // the next one, or an earlier one after a rollback to a snapshot or checkpoint
  // (last_reconfiguration() says which and how many steps were lost). kDataLoss naming the
  // tensor and the box when a piece has no copy left anywhere.
  StatusOr<Step> BeginStep();
  // The step's updates of the registered state begin now (the optimizer step, the ZeRO
  // allgather of updated parameters). Before this call a failed step leaves the state at the
  // step's values, so this worker's state stays usable for the recovery; from it to EndStep a
  // failure leaves it torn (it then receives its state from replicas). Until a program first
  // calls it, every step counts as updating from its start (a failure leaves the state torn);
  // once it did, every step is taken to call it before its first update. One store, no
  // communication; with Options::undo_copy (MORPH_UNDO_COPY) also a copy of this rank's
  // shards and scalars, which a recovery may put back (a worker whose update went through
  // while a peer's did not goes back a step). That copy is read on a background thread from
  // BeginStep on, so with undo_copy nothing may write the registered state between BeginStep
  // and BeginUpdate (the contract above, which the copy relies on).
  void BeginUpdate();
  // The step's commit vote, then BeginUpdate: every rank of the generation votes (one element
  // allreduced over step.world()) that it holds everything its update needs, so call it after
  // the step's last collective and apply the update with local writes only. A vote does not
  // complete everywhere or nowhere (a rank that dies while it is relayed leaves some ranks
  // with the result and others without); a worker whose vote did not complete waits here for
  // the recovery, which learns from every survivor whether the vote completed anywhere.
  //   OK: apply this step's update now, then EndStep. Every rank voted; when the vote failed
  //       here and passed elsewhere, the recovery resumes at the next step (nothing lost).
  //   kAborted "step S was not committed: ...": do not apply it. The step is over (as after
  //       AbortStep); the next BeginStep applies the recovery, from step S.
  //   kUnavailable: the coordinator is gone (as AbortStep); kFailedPrecondition if no step is
  //       open or its update already began.
  // After an error the step is over: AbortStep(error) then returns OK and does nothing, so a
  // program may end every failed step with AbortStep.
  // With it, a failure never needs the undo copy to keep every survivor at one step, at the
  // cost of one small allreduce per step (docs/design.md "Consistency").
  Status CommitUpdate();
  // The end of the step begun last. kFailedPrecondition if no step is open.
  Status EndStep();
  // Ends the open step as failed: a collective returned an error (kAborted after the runtime
  // aborted it because a peer failed, kUnavailable / kDeadlineExceeded with the failed peers).
  // Tells the coordinator which peers `why` names (its CollectiveFailure), so that it starts a
  // recovery; the next BeginStep applies it. kFailedPrecondition if no step is open;
  // kUnavailable ("connection to the coordinator lost: ...") when the coordinator is gone (its
  // death aborted the step): the job cannot go on, end the program. OK and nothing else after a
  // CommitUpdate that failed (it ended the step).
  Status AbortStep(const Status& why);

  // True once this worker left the job (its state moved away) or was released.
  bool Finished() const;

  // A client of the job's store for the current generation, its keys under "<prefix>/" in a
  // namespace apart from the runtime's (key_value_store.h): for the rendezvous of a library
  // run over this generation's members. Its own connection, checked with the job token; its
  // calls fail with kAborted once the job moved to a later generation. kFailedPrecondition
  // when this worker holds no rank or left the job, kInvalidArgument for an empty prefix; the
  // store's errors when it cannot be reached. Training thread.
  StatusOr<std::unique_ptr<KeyValueStore>> ConnectStore(std::string_view prefix);

  // Asks to leave gracefully (preemption): the coordinator plans a change without this worker,
  // its unique state moves to the others, then BeginStep returns done(). Any thread.
  void Leave(std::string reason = "Leave()");
  // Async-signal-safe form of Leave (what the SIGTERM handler calls).
  static void RequestLeaveFromSignal();

  // Ends this worker's part of the job normally: tells the coordinator, and when this process
  // hosts the coordinator, waits (up to `timeout_ms`) until every worker finished, so that the
  // others keep their coordinator to the end (OK also when the job stopped because every
  // worker asked to leave). With coordinator failover (MORPH_ETCD) it first waits until a
  // leader acknowledged the Done — a Done lost with a dying leader is said again to its
  // successor — for at most MORPH_ETCD_REJOIN_MS (then a WARNING; still OK). Idempotent.
  Status Finish(int64_t timeout_ms = 60000);

  // This worker's identity and the current generation.
  WorkerId worker_id() const;
  const Generation& generation() const;
  int rank() const;  // -1 when it holds none
  // The step BeginStep will begin next.
  int64_t next_step() const;
  // The job's dataset cursor (Options' dataset_samples, dataset_seed, dataset_shuffle and
  // model.global_batch): what Step::samples() reads, for a data loader that looks ahead
  // (morph.data). Constant for the runtime's life; any thread.
  const DatasetCursor& cursor() const;
  // "host:port" of the coordinator (for others to join: MORPH_COORDINATOR), and of its
  // scheduler API when this process hosts it ("" otherwise). With failover candidates hosted
  // by the workers (MORPH_ETCD without MORPH_COORDINATOR) those of this process's candidate,
  // which may not lead (etcd's <prefix>/leader names the leader); "" where it hosts none.
  std::string coordinator_address() const;
  std::string api_address() const;
 private:
  struct Impl;  // runtime/api/runtime_impl.h
  explicit Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_H_
