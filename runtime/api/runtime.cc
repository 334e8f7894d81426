#include "runtime/api/runtime.h"

#include <glog/logging.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <thread>

#include "collectives/gloo_communicator.h"
#include "collectives/groups.h"
#include "collectives/tcp_store.h"
#include "runtime/agent/agent.h"
#include "runtime/agent/switch.h"
#include "runtime/api/bootstrap.h"
#include "runtime/api/data_plane.h"
#include "runtime/api/undo.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/protocol/plan_input.h"
#include "runtime/recovery/checkpointer.h"
#include "runtime/recovery/snapshot.h"

namespace morph {
namespace {

using SteadyClock = std::chrono::steady_clock;

double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

// The one runtime of this process that SIGTERM asks to leave.
std::atomic<bool> g_leave_requested{false};

void OnSigterm(int) { Runtime::RequestLeaveFromSignal(); }

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

PrepareMsg AsPrepare(const CommitMsg& c) {
  return PrepareMsg{.next = c.next, .from_generation = c.from_generation, .from = c.from,
                    .change = c.change};
}

}  // namespace

struct StepAccess {
  static void Fill(Step& s, bool done, bool reconfigured, int64_t index, const Generation& g,
                   int rank, int64_t micro_batch, GroupSet* groups, const DatasetCursor* cursor) {
    s.done_ = done;
    s.reconfigured_ = reconfigured;
    s.index_ = index;
    s.generation_ = g.id;
    s.config_ = &g.config;
    s.rank_ = rank;
    s.micro_batch_ = micro_batch;
    s.groups_ = groups;
    s.cursor_ = cursor;
    s.batch_ready_ = false;
  }
};

struct Runtime::Impl {
  Options opts;
  JobManifest manifest;
  State state;
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<Agent> agent;
  std::unique_ptr<TcpStoreClient> store;  // the job's store, generation of the last change
  std::shared_ptr<GlooDevice> device;
  CommunicatorFactory factory;
  bool cuda_state = false;  // some registered tensor lives in CUDA memory (set in Start)
  bool adopted_state = false;  // some tensor's storage is the user's (AdoptTensor; set in Start)
  std::unique_ptr<GroupSet> groups;
  // Guards the `groups` pointer against the control thread's abort (the training thread reads
  // it unlocked: only it replaces it, under this mutex).
  std::mutex groups_mu;
  // When the control thread aborted the collectives for a failure (steady clock, 0: never).
  std::atomic<int64_t> aborted_at_ns{0};
  Generation gen;
  std::optional<DatasetCursor> cursor;
  int64_t next_step = 0;
  bool in_step = false;
  // BeginUpdate was called in the open step: a failure now leaves the state torn.
  bool updating = false;
  // The last step ended in AbortStep: BeginStep must recover before training on. `torn`: the
  // abort came after BeginUpdate (or the step never called it).
  bool aborted = false;
  bool torn = false;
  bool step_called_begin_update = false;
  bool fresh = false;
  bool finished = false;
  bool done_sent = false;
  std::function<void(const Reconfiguration&)> on_reconfigure;
  std::optional<Reconfiguration> last_reconfiguration;
  // A switch inside Start (a joiner's first generation): its first step is reconfigured().
  bool joined_by_change = false;

  // The new generation built beside the running one, between its prepare and its switch step.
  // Shared by the runtime and the thread that builds it: an abandoned one still building when
  // the runtime goes away (its communicators wait on a peer that died, up to the change
  // timeout) is detached and ends on its own, touching nothing of the runtime's.
  struct Prepared {
    int64_t generation = 0;
    std::thread thread;
    std::mutex mu;  // `store` and `result` while the thread runs
    std::unique_ptr<TcpStoreClient> store;
    StatusOr<std::unique_ptr<PreparedSwitch>> result = InternalError("not built yet");
    std::atomic<bool> finished{false};  // the thread is done (JoinStale joins it)
  };
  using PreparedPtr = std::shared_ptr<Prepared>;
  std::mutex prep_mu;
  PreparedPtr prep;                 // the latest prepare
  std::vector<PreparedPtr> stale;   // abandoned ones, joined by the training thread
  // Whether the agent may still be told that a prepare is built (false once the runtime is
  // being destroyed: a detached prepare's thread must not call into it).
  struct ReadyGate {
    std::mutex mu;
    bool open = true;
  };
  std::shared_ptr<ReadyGate> ready_gate = std::make_shared<ReadyGate>();
  std::thread reaper;  // tears down the last change's old communicators
  void JoinReaper() {
    if (reaper.joinable()) reaper.join();
  }

  // Control thread: a failure (a recovery's prepare, the coordinator gone): every collective
  // of the running generation returns kAborted from now on, so the training thread reaches its
  // step boundary instead of hanging on a dead peer.
  void AbortCollectives(const std::string& why, int64_t generation = -1) {
    std::lock_guard<std::mutex> l(groups_mu);
    // An abort of an older generation (this worker already switched on) is not for these.
    if (generation >= 0 && groups && groups->generation() != generation) return;
    int64_t expected = 0;
    aborted_at_ns.compare_exchange_strong(
        expected, SteadyClock::now().time_since_epoch() / std::chrono::nanoseconds(1));
    if (groups) {
      LOG(WARNING) << "worker " << agent->id() << ": aborting generation " << groups->generation()
                   << "'s collectives: " << why;
      groups->AbortAll();
    }
    // A snapshot round waiting on a dead peer would hold the training thread in BeginStep.
    if (snapshots) snapshots->Abort();
  }

  // MORPH_UNDO_COPY: this rank's state as it was at its last BeginUpdate.
  UndoCopy undo;
  bool undo_warned = false;
  int64_t UndoStep() { return opts.undo_copy ? undo.StepFor(state, gen.id) : -1; }
  void PutBackUndo() {
    const int64_t v = UndoStep();
    LOG(INFO) << "worker " << agent->id() << ": recovery: put back the undo copy of step " << v
              << " (the state was " << (torn || !state.intact() ? "torn" : "whole") << " at step "
              << next_step << ")";
    undo.PutBack(state);
    torn = false;
    next_step = v;
  }

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
  void StartSnapshots() {
    const int rank = gen.RankOf(agent->id());
    snapshot_warned = false;
    if (!snapshots || rank < 0 || !store) return;
    // Bounded more tightly than a change: it runs in the switch's stall, and a peer that died
    // right after the switch would hold the training thread here (the abort cannot reach it).
    Deadline d = Deadline::AfterMs(std::min<int64_t>(opts.change_timeout_ms, 30000));
    Status st = [&]() -> Status {
      char name[256] = {};
      std::string host = opts.host;
      if (host.empty() && gethostname(name, sizeof(name) - 1) == 0) host = name;
      if (host.empty()) host = "localhost";
      MORPH_RETURN_IF_ERROR(store->Set("snapshot/host/" + std::to_string(rank), host, d));
      SnapshotGeneration g{.generation = gen.id, .rank = rank};
      for (int r = 0; r < gen.config.world(); ++r) {
        MORPH_ASSIGN_OR_RETURN(std::string h, store->Get("snapshot/host/" + std::to_string(r), d));
        g.hosts.push_back(std::move(h));
      }
      return snapshots->StartGeneration(*store, g, d);
    }();
    if (!st.ok()) {
      snapshot_warned = true;
      LOG(WARNING) << "worker " << agent->id() << ": generation " << gen.id
                   << ": buddy snapshots off for this generation: " << st;
    }
  }

  // What this worker can serve from its snapshots of the current generation (a recovery report);
  // ends the snapshots' generation first (a round in flight is cut off, its copies not used).
  SnapshotHoldings EndSnapshots() {
    SnapshotHoldings h;
    if (!snapshots) return h;
    snapshots->EndGeneration();
    const std::vector<int64_t> local = snapshots->LocalSteps(gen.id);
    const std::vector<int64_t> held = snapshots->HeldSteps(gen.id);
    if (!local.empty()) h.local_step = local[0];
    if (local.size() > 1) h.local_prev_step = local[1];
    if (!held.empty() && snapshots->held_generation() == gen.id) {
      h.held_step = held[0];
      if (held.size() > 1) h.held_prev_step = held[1];
      h.held_rank = snapshots->held_rank();
    }
    return h;
  }

  SwitchOptions SwitchOpts() const {
    SwitchOptions s;
    s.keep_old_until_barrier = opts.keep_old_until_barrier;
    // The change communicator is Gloo (host memory only): CUDA shards go through host copies.
    s.stage_old_in_host = cuda_state;
    // Morph-owned host shards: new ones are allocated and pre-faulted while the old generation
    // trains (switch.h "Pre-allocation").
    if (!cuda_state && !adopted_state) s.preallocate = HostAllocator();
    s.restore_checkpoint = [](const std::string& path, State& st) {
      return RestoreFromCheckpoint(path, st);
    };
    // Read at the switch step (training thread), while `gen` is still the generation the
    // change starts from.
    s.snapshot = [this](int64_t step, bool held) -> const SnapshotData* {
      if (!snapshots) return nullptr;
      return held ? snapshots->Held(step, gen.id) : snapshots->Local(step, gen.id);
    };
    s.batch_bytes = opts.batch_bytes;
    s.executor.chunk_bytes = manifest.chunk_bytes;
    s.executor.staging_bytes = manifest.staging_bytes;
    s.transport.shared_memory = opts.shared_memory;
    s.timeout = std::chrono::milliseconds(opts.change_timeout_ms);
    return s;
  }

  // Control thread: a prepare for a generation this worker takes part in.
  void StartPrepare(const PrepareMsg& p, std::function<void()> ready) {
    if (p.change.recovery) {
      AbortCollectives("generation " + std::to_string(p.next.id) + " recovers from a failure");
    }
    std::lock_guard<std::mutex> l(prep_mu);
    if (prep && prep->generation >= p.next.id) return;  // a duplicate: the first one reports
    if (prep) stale.push_back(std::move(prep));
    auto job = std::make_shared<Prepared>();
    job->generation = p.next.id;
    // The thread gets copies of what it reads (see Prepared).
    struct Inputs {
      JobManifest manifest;
      WorkerId me;
      std::string store_address;
      std::string token;
      int64_t timeout_ms;
      CommunicatorFactory factory;
      SwitchOptions options;
    };
    Inputs in{manifest,   agent->id(), agent->welcome().store_address, opts.token,
              opts.change_timeout_ms, factory, SwitchOpts()};
    job->thread = std::thread([job_ref = job, p, in = std::move(in), gate = ready_gate,
                               ready = std::move(ready)] {
      Prepared* raw = job_ref.get();
      // Answer the prepare however this ends (a failure shows at the switch step).
      struct Ready {
        const std::function<void()>& f;
        ReadyGate& gate;
        std::atomic<bool>& finished;
        ~Ready() {
          {
            std::lock_guard<std::mutex> l(gate.mu);
            if (gate.open) f();
          }
          finished.store(true);
        }
      } answer{ready, *gate, raw->finished};
      const auto began = SteadyClock::now();
      Deadline deadline = Deadline::AfterMs(in.timeout_ms);
      // A fresh client (the training thread's `store` may not exist yet: a prepare can arrive
      // while Start is still connecting).
      StatusOr<std::unique_ptr<TcpStoreClient>> s =
          TcpStoreClient::Connect(in.store_address, in.token, p.next.id, deadline);
      if (!s.ok()) {
        std::lock_guard<std::mutex> l(raw->mu);
        raw->result = s.status();
        return;
      }
      TcpStoreClient* client = s->get();
      {
        std::lock_guard<std::mutex> l(raw->mu);
        raw->store = std::move(*s);
      }
      StatusOr<std::unique_ptr<PreparedSwitch>> built =
          PrepareSwitch(in.manifest, in.me, p, *client, in.factory, in.options, deadline);
      LOG(INFO) << "worker " << in.me << ": generation " << p.next.id << " prepared in "
                << std::chrono::duration<double>(SteadyClock::now() - began).count() << " s"
                << (built.ok() ? std::string() : ": " + built.status().ToString());
      std::lock_guard<std::mutex> l(raw->mu);  // on_abort reads it
      raw->result = std::move(built);
    });
    prep = std::move(job);
  }

  void AbandonPrepare(int64_t generation) {
    std::lock_guard<std::mutex> l(prep_mu);
    if (prep && prep->generation == generation) stale.push_back(std::move(prep));
  }

  // Joins the abandoned prepares whose thread is done (at a step boundary: one still
  // connecting to a peer that died ends at its deadline, and the training thread must not wait
  // for it).
  void JoinStale() {
    std::vector<PreparedPtr> done;
    {
      std::lock_guard<std::mutex> l(prep_mu);
      for (auto& p : stale) {
        if (p->finished.load()) done.push_back(std::move(p));
      }
      std::erase(stale, nullptr);
    }
    for (auto& p : done) {
      if (p->thread.joinable()) p->thread.join();
    }
  }

  // At the end: every prepare still held. Those done within `grace` are joined; the others
  // (waiting on a dead peer up to the change timeout) are detached after the agent is shut
  // off from them, so that a worker leaves at once when its job is over.
  void JoinOrDetachPrepares(std::chrono::milliseconds grace) {
    std::vector<PreparedPtr> all;
    {
      std::lock_guard<std::mutex> l(prep_mu);
      all.swap(stale);
      if (prep) all.push_back(std::move(prep));
    }
    const auto until = SteadyClock::now() + grace;
    for (auto& p : all) {
      while (!p->finished.load() && SteadyClock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    {
      std::lock_guard<std::mutex> l(ready_gate->mu);
      ready_gate->open = false;
    }
    for (auto& p : all) {
      if (!p->thread.joinable()) continue;
      if (p->finished.load()) {
        p->thread.join();
      } else {
        LOG(WARNING) << "worker " << (agent ? agent->id() : 0) << ": generation " << p->generation
                     << "'s abandoned build is still waiting on its peers; left to end at its "
                        "deadline";
        p->thread.detach();
      }
    }
  }

  // The prepared switch for `generation`, built now if the prepare never came (the first
  // change of a joiner that registered after the prepare, or a commit without a prepare).
  StatusOr<PreparedPtr> TakePrepared(const CommitMsg& c, Deadline deadline) {
    PreparedPtr mine;
    {
      std::lock_guard<std::mutex> l(prep_mu);
      if (prep && prep->generation == c.next.id) mine = std::move(prep);
    }
    if (mine) {
      if (mine->thread.joinable()) mine->thread.join();
      return mine;
    }
    mine = std::make_shared<Prepared>();
    mine->generation = c.next.id;
    MORPH_ASSIGN_OR_RETURN(mine->store, store->ForGeneration(c.next.id, deadline));
    mine->result =
        PrepareSwitch(manifest, agent->id(), AsPrepare(c), *mine->store, factory, SwitchOpts(),
                      deadline);
    return mine;
  }

  // The training thread applies `c` (its switch step, or a joiner's first generation).
  Status Switch(const CommitMsg& c, SteadyClock::time_point entered) {
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
    if (c.change.recovery && !r.stale &&
        c.recovery.source == RecoveryDecision::Source::kReplicas) {
      // The commit resumes at a step this worker holds (ChooseRecovery): its live state if whole
      // there, else its undo copy (the same rule as ChooseRecovery's).
      const int64_t v = c.next.start_step;
      const bool whole = !torn && state.intact();
      if (!(whole && next_step == v) && UndoStep() == v) PutBackUndo();
    }
    Status st = Reshard(c, deadline, r);
    if (!st.ok()) {
      LOG(ERROR) << "worker " << agent->id() << ": switch to generation " << c.next.id
                 << " failed: " << st;
      Status sent = agent->SwitchDone(false, std::string(st.message()));
      if (!sent.ok()) LOG(WARNING) << "applied(failed) not sent: " << sent;
      return st;
    }
    gen = c.next;
    next_step = c.next.start_step;
    restored_step = r.checkpoint.empty() ? -1 : r.step;
    aborted = false;
    torn = false;
    aborted_at_ns.store(0);
    StartSnapshots();
    r.stall_seconds = SecondsSince(entered);
    auto us = [](double s) { return static_cast<int64_t>(s * 1e6); };
    MORPH_RETURN_IF_ERROR(agent->SwitchDone(
        true, "",
        AppliedMsg::Phases{.communicators_us = us(r.communicators_seconds),
                           .plan_us = us(r.plan_seconds),
                           .transfer_us = us(r.transfer_seconds),
                           .resume_us = us(r.resume_seconds),
                           .stall_us = us(r.stall_seconds)}));
    LOG(INFO) << "worker " << agent->id() << ": generation " << c.next.id << " ("
              << c.next.config.ToString() << ") rank " << r.rank << " from step " << r.step
              << "; switch " << r.stall_seconds << " s (communicators "
              << r.communicators_seconds << ", plan " << r.plan_seconds << ", transfer "
              << r.transfer_seconds << ", resume " << r.resume_seconds << ")"
              << (r.resumed ? "; resumed from checkpoint " +
                                  std::filesystem::path(r.checkpoint).filename().string() + " (" +
                                  r.checkpoint + ")"
                  : r.recovery ? "; recovery from " + std::string(SourceName(r.source)) +
                                     (r.stale ? " (stale state)" : "") + ", steps lost " +
                                     std::to_string(r.lost_steps())
                               : std::string());
    last_reconfiguration = r;
    if (on_reconfigure && r.rank >= 0) on_reconfigure(r);
    return Status();
  }

  // Installs what `p`'s switch built (its groups, its store) as the running generation. The
  // old generation's communicators and the change communicator are done with (the closing
  // barrier passed); tearing Gloo contexts down takes tens of milliseconds, so it happens on
  // the reaper thread beside the next steps instead of in the stall.
  void AdoptGroups(PreparedPtr p) {
    std::unique_ptr<GroupSet> next = TakeGroups(**p->result);
    if (p->store) store = std::move(p->store);
    JoinReaper();
    std::unique_ptr<GroupSet> old;
    {
      std::lock_guard<std::mutex> l(groups_mu);
      old = std::move(groups);
      groups = std::move(next);
    }
    reaper = std::thread([old = std::move(old), done = std::move(p)]() mutable {
      old.reset();
      done.reset();
    });
  }

  // A switch that failed only at its closing barrier while the change applied elsewhere: this
  // worker's new state is whole; it follows into the new generation.
  bool FollowAppliedChange(const CommitMsg& c) {
    if (!half_applied || !half_applied->result.ok() || half_applied->generation != c.next.id) {
      return false;
    }
    if (!AdoptNewState(**half_applied->result, state).ok()) return false;
    AdoptGroups(std::move(half_applied));
    gen = c.next;
    next_step = c.next.start_step;
    LOG(WARNING) << "worker " << agent->id() << ": follows generation " << c.next.id
                 << " (its switch failed only at the closing barrier)";
    return true;
  }
  PreparedPtr half_applied;

  Status Reshard(const CommitMsg& c, Deadline deadline, Reconfiguration& r) {
    MORPH_ASSIGN_OR_RETURN(PreparedPtr p, TakePrepared(c, deadline));
    if (!p->result.ok()) return p->result.status();
    PreparedSwitch& prepared = **p->result;
    StatusOr<SwitchStats> executed = ExecuteSwitch(prepared, c, state, deadline);
    if (!executed.ok()) {
      if (prepared.new_state_complete()) half_applied = std::move(p);
      return executed.status();
    }
    SwitchStats stats = *executed;
    AdoptGroups(std::move(p));
    // Materialized zero-filled: the caller initializes (unless it resumed from a checkpoint).
    if (c.from.id == 0 && !c.change.recovery) fresh = true;
    r.communicators_seconds = stats.seconds.communicators;
    r.plan_seconds = stats.seconds.plan;
    r.transfer_seconds = stats.seconds.transfer;
    r.resume_seconds = stats.seconds.resume;
    r.bytes_sent = stats.bytes_sent;
    r.bytes_received = stats.bytes_received;
    r.peak_bytes = stats.peak_bytes;
    r.bound_bytes = stats.bound_bytes;
    return Status();
  }

  // Waits for and applies decisions until step `next_step` may begin (or this worker is done).
  StatusOr<bool> SlowPath(bool& reconfigured) {
    auto entered = SteadyClock::now();
    JoinStale();
    while (true) {
      if (g_leave_requested.exchange(false)) agent->RequestLeave("SIGTERM (preemption notice)");
      // A worker without a rank (a spare, a joiner) waits as long as the job runs, looking at
      // the SIGTERM flag every 100 ms (a preempted spare's leave request goes out at once).
      bool ranked = gen.RankOf(agent->id()) >= 0;
      Deadline d = Deadline::AfterMs(ranked ? opts.change_timeout_ms : 100);
      StatusOr<Agent::Decision> dec = agent->Decide(next_step, d);
      if (!dec.ok()) {
        if (!ranked && dec.status().code() == StatusCode::kDeadlineExceeded) continue;
        if (aborted) {
          return dec.status().WithContext("step " + std::to_string(next_step) +
                                          " failed and no recovery followed");
        }
        return dec.status();
      }
      switch (dec->action) {
        case AgentCore::Action::kProceed:
          return false;
        case AgentCore::Action::kFinished:
          finished = true;
          return true;
        case AgentCore::Action::kReport: {
          // A recovery: the step the state holds, and whether it is whole.
          const bool whole = !torn && state.intact();
          const SnapshotHoldings snaps = EndSnapshots();
          const int64_t undo_step = UndoStep();
          LOG(INFO) << "worker " << agent->id() << ": recovery: state at step " << next_step
                    << (whole ? " (whole)" : " (torn)")
                    << (undo_step >= 0 ? ", undo copy of step " + std::to_string(undo_step)
                                       : std::string())
                    << (snapshots ? "; snapshots: own " + std::to_string(snaps.local_step) + "/" +
                                        std::to_string(snaps.local_prev_step) + ", held " +
                                        std::to_string(snaps.held_step) + "/" +
                                        std::to_string(snaps.held_prev_step) + " of rank " +
                                        std::to_string(snaps.held_rank)
                                  : std::string());
          MORPH_RETURN_IF_ERROR(agent->ReportState(next_step, whole, snaps, undo_step));
          break;
        }
        case AgentCore::Action::kCannotSwitch: {
          // This worker's generation failed before the committed start step: it cannot take
          // part; the change fails everywhere and a recovery follows.
          Status sent = agent->SwitchDone(
              false, "worker " + std::to_string(agent->id()) + ": step " +
                         std::to_string(next_step) + " failed before the switch step " +
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
            StatusOr<bool> applied =
                agent->AwaitOutcome(Deadline::AfterMs(opts.change_timeout_ms));
            if (!applied.ok()) return st;
            if (*applied) {
              if (!FollowAppliedChange(commit)) return st;
              half_applied.reset();
              break;  // in the new generation; its lost member's recovery follows
            }
            half_applied.reset();
            aborted = true;
            torn = torn || !state.intact();
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

  Status Bootstrap();

  // The worker holding rank `r` of this worker's group `group` (a GroupBuilder name: "world",
  // "dp/...", "tp/...", "pp/..."), or 0 when that cannot be told.
  WorkerId WorkerOfGroupRank(const std::string& group, int r) const {
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
};

StatusOr<std::unique_ptr<Runtime>> Runtime::Start(Options options, const Declare& declare) {
  MORPH_RETURN_IF_ERROR(options.Validate());
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(options);
  const Options& o = impl->opts;
  if (declare) {
    MORPH_RETURN_IF_ERROR(declare(impl->state));
  }
  impl->state.Seal();
  for (size_t t = 0; t < impl->state.tensors().size(); ++t) {
    if (impl->state.memory_of(t) == MemoryKind::kCuda) impl->cuda_state = true;
    if (impl->state.adopted(t)) impl->adopted_state = true;
  }
  JobManifest& m = impl->manifest;
  m.model = o.model;
  impl->state.FillManifest(m);
  m.dataset_samples = o.dataset_samples;
  m.dataset_seed = o.dataset_seed;
  m.dataset_shuffle = o.dataset_shuffle;
  m.chunk_bytes = o.chunk_bytes;
  m.staging_bytes = o.staging_bytes;
  m.backend = BackendName(o.backend);
  MORPH_RETURN_IF_ERROR(ValidateManifest(m));
  MORPH_ASSIGN_OR_RETURN(DatasetCursor cursor,
                         DatasetCursor::Create({.num_samples = o.dataset_samples,
                                                .global_batch = o.model.global_batch,
                                                .seed = o.dataset_seed,
                                                .shuffle = o.dataset_shuffle}));
  impl->cursor.emplace(std::move(cursor));
  if (!impl->opts.checkpoint_dir.empty() && impl->opts.checkpoint_every > 0) {
    impl->checkpointer = std::make_unique<PeriodicCheckpointer>(
        impl->opts.checkpoint_dir, impl->opts.checkpoint_every, impl->opts.checkpoint_keep,
        /*wait_ms=*/600000, impl->opts.checkpoint_max_bytes_per_second);
  }
  MORPH_RETURN_IF_ERROR(impl->Bootstrap());
  std::unique_ptr<Runtime> rt(new Runtime(std::move(impl)));
  if (rt->impl_->opts.handle_sigterm) {
    struct sigaction sa = {};
    sa.sa_handler = OnSigterm;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
  }
  return rt;
}

Status Runtime::Impl::Bootstrap() {
  Deadline deadline = Deadline::AfterMs(opts.start_timeout_ms);
  MORPH_ASSIGN_OR_RETURN(BootstrapResult boot, ResolveBootstrap(opts, deadline));
  coordinator = std::move(boot.coordinator);
  opts.token = boot.token;
  GlooOptions gloo;
  if (!boot.data_hostname.empty()) gloo.hostname = boot.data_hostname;
  gloo.iface = opts.data_iface;
  MORPH_ASSIGN_OR_RETURN(device, GlooDevice::Create(gloo));
  // The step groups on the chosen backend (NCCL: this thread's CUDA device set here, before any
  // CUDA shard is allocated); reconfiguration traffic on Gloo (runtime/api/data_plane.h).
  MORPH_ASSIGN_OR_RETURN(DataPlane data_plane, MakeDataPlane(opts, device));
  factory = std::move(data_plane.factory);
  if (opts.snapshot_every > 0) {
    BuddySnapshotOptions so;
    so.device = device;
    so.timeout = std::chrono::milliseconds(opts.change_timeout_ms);
    snapshots = std::make_unique<BuddySnapshotter>(opts.snapshot_every, so);
  }

  AgentOptions ao;
  ao.heartbeat_ms = opts.heartbeat_ms;
  ao.coordinator_timeout_ms = opts.heartbeat_timeout_ms;  // a silent coordinator host is lost
  ao.on_prepare = [this](const PrepareMsg& p, std::function<void()> ready) {
    StartPrepare(p, std::move(ready));
  };
  ao.on_abandon = [this](int64_t g) { AbandonPrepare(g); };
  ao.on_abort = [this](const AbortMsg& a) {
    AbortCollectives("coordinator: " + a.reason, a.generation);
    // A switch being built from that generation cannot complete either.
    std::lock_guard<std::mutex> l(prep_mu);
    if (!prep) return;
    std::lock_guard<std::mutex> r(prep->mu);
    if (prep->result.ok() && *prep->result && (*prep->result)->from().id == a.generation) {
      (*prep->result)->Abort();
    }
  };
  ao.on_connection_lost = [this](const Status& why) {
    AbortCollectives("the coordinator is gone (" + std::string(why.message()) + ")");
  };
  HelloMsg hello{.token = opts.token, .host = opts.host, .pid = getpid(), .capabilities = 0};
  MORPH_ASSIGN_OR_RETURN(agent, Agent::Connect(boot.coordinator_address, hello,
                                               RegisterMsg{.manifest = manifest}, ao, deadline));
  agent->StartThread();  // its callbacks use `agent`
  const WelcomeMsg& w = agent->welcome();
  MORPH_ASSIGN_OR_RETURN(store, TcpStoreClient::Connect(w.store_address, opts.token,
                                                        w.current.id, deadline));
  LOG(INFO) << "worker " << w.worker << " registered with " << boot.coordinator_address
            << " (job generation " << w.current.id << ")";
  // Until this worker holds a rank: the first generation, or a change that takes it in.
  while (gen.RankOf(agent->id()) < 0) {
    agent->NoteBegin(next_step);
    Deadline d = Min(deadline, Deadline::AfterMs(opts.heartbeat_ms * 10));
    StatusOr<Agent::Decision> dec = agent->Decide(next_step, d);
    if (!dec.ok()) {
      if (dec.status().code() == StatusCode::kDeadlineExceeded && !deadline.Expired()) continue;
      return dec.status();
    }
    if (dec->action == AgentCore::Action::kFinished) {
      finished = true;
      return Status();  // released before it was ever needed
    }
    if (dec->action == AgentCore::Action::kSwitch) {
      MORPH_RETURN_IF_ERROR(Switch(*dec->commit, SteadyClock::now()));
      joined_by_change = dec->commit->from.id != 0;
    }
  }
  return Status();
}

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Runtime::~Runtime() {
  // Without Finish() (an error path) the worker does not claim to be done: its connection
  // closes and the job treats it as lost. A hosted coordinator still waits for the others.
  if (impl_->coordinator) {
    Status s = Finish();
    if (!s.ok()) LOG(WARNING) << "Runtime: " << s;
  }
  if (impl_->agent) impl_->agent->Close();
  impl_->JoinOrDetachPrepares(std::chrono::milliseconds(1000));
  impl_->JoinReaper();
  impl_->groups.reset();
  if (impl_->coordinator) impl_->coordinator->Stop();
}

State& Runtime::state() { return impl_->state; }
bool Runtime::fresh_start() const { return impl_->fresh; }

void Runtime::OnReconfigure(std::function<void(const Reconfiguration&)> callback) {
  impl_->on_reconfigure = std::move(callback);
}

StatusOr<Step> Runtime::BeginStep() {
  Impl& m = *impl_;
  if (m.in_step) {
    return FailedPreconditionError("BeginStep: step " + std::to_string(m.next_step) +
                                   " is still open (call EndStep first)");
  }
  Step step;
  bool reconfigured = m.joined_by_change;
  m.joined_by_change = false;
  if (!m.finished) {
    m.agent->NoteBegin(m.next_step);
    if (m.agent->pending() || m.aborted || g_leave_requested.load(std::memory_order_relaxed)) {
      MORPH_ASSIGN_OR_RETURN(bool done, m.SlowPath(reconfigured));
      if (done) m.finished = true;
    }
  }
  if (m.finished) {
    StepAccess::Fill(step, true, false, m.next_step, m.gen, -1, m.opts.micro_batch, nullptr,
                     &*m.cursor);
    return step;
  }
  const int rank = m.gen.RankOf(m.agent->id());
  if (m.checkpointer && rank >= 0 && m.checkpointer->Due(m.next_step) &&
      m.next_step != m.restored_step) {
    // The state holds this step's values: snapshot it (the write goes on in the background).
    Status c = m.checkpointer->MaybeSave(m.next_step, m.gen.id, m.state, rank,
                                         m.gen.config.world(), m.gen.config);
    if (!c.ok()) LOG(WARNING) << "checkpoint of step " << m.next_step << " not taken: " << c;
  }
  if (m.snapshots && rank >= 0 && m.snapshots->Due(m.next_step)) {
    // The state holds this step's values: copy it (the copy and the exchange with the buddy go
    // on in the background; BeginUpdate waits for the copy). A program that never called
    // BeginUpdate may change the state anywhere in the step: it waits for the copy here.
    Status c = m.snapshots->MaybeBegin(m.next_step, m.state);
    if (c.ok() && !m.step_called_begin_update) {
      c = m.snapshots->WaitCopied(Deadline::AfterMs(m.opts.change_timeout_ms));
    }
    if (!c.ok() && !m.snapshot_warned) {
      m.snapshot_warned = true;
      LOG(WARNING) << "worker " << m.agent->id() << ": snapshot of step " << m.next_step
                   << " not taken: " << c;
    }
  }
  StepAccess::Fill(step, false, reconfigured, m.next_step, m.gen, rank, m.opts.micro_batch,
                   m.groups.get(), &*m.cursor);
  m.in_step = true;
  return step;
}

void Runtime::BeginUpdate() {
  Impl& m = *impl_;
  if (m.snapshots && !m.updating) {
    // The step's snapshot copy (if one was begun) must be done before the state changes.
    Status c = m.snapshots->WaitCopied(Deadline::AfterMs(m.opts.change_timeout_ms));
    if (!c.ok() && !m.snapshot_warned) {
      m.snapshot_warned = true;
      LOG(WARNING) << "worker " << m.agent->id() << ": snapshot of step " << m.next_step
                   << " not copied: " << c;
    }
  }
  if (m.opts.undo_copy && m.in_step && !m.updating) {
    Status s = m.undo.Take(m.state, m.next_step, m.gen.id);
    if (!s.ok() && !m.undo_warned) {
      LOG(WARNING) << "worker " << m.agent->id() << ": no undo copy: " << s;
      m.undo_warned = true;
    }
  }
  m.updating = true;
  m.step_called_begin_update = true;
}

Status Runtime::EndStep() {
  if (!impl_->in_step) return FailedPreconditionError("EndStep: no step is open");
  impl_->in_step = false;
  impl_->updating = false;
  ++impl_->next_step;
  return Status();
}

Status Runtime::AbortStep(const Status& why) {
  Impl& m = *impl_;
  if (!m.in_step) return FailedPreconditionError("AbortStep: no step is open");
  m.in_step = false;
  m.aborted = true;
  // A step that never said where its updates begin may have changed the state anywhere.
  m.torn = m.torn || m.updating || !m.step_called_begin_update;
  m.updating = false;
  if (m.torn) m.state.MarkTorn();
  FailureReportMsg report{.generation = m.gen.id, .step = m.next_step, .error = why.ToString()};
  if (const CollectiveFailure* f = why.collective_failure()) {
    for (int r : f->peers) {
      // The communicator names ranks of its own group (one of this worker's groups).
      WorkerId w = m.WorkerOfGroupRank(f->group, r);
      if (w != 0) report.peers.push_back(w);
    }
  }
  m.agent->NoteStepFailed();
  LOG(WARNING) << "worker " << m.agent->id() << ": step " << m.next_step << " aborted ("
               << (m.torn ? "state torn" : "state intact") << "): " << why;
  return m.agent->SendFailure(report);
}

bool Runtime::Finished() const { return impl_->finished; }

void Runtime::Leave(std::string reason) {
  if (impl_->agent) impl_->agent->RequestLeave(reason);
}

void Runtime::RequestLeaveFromSignal() { g_leave_requested.store(true); }

Status Runtime::Finish(int64_t timeout_ms) {
  Impl& m = *impl_;
  if (!m.done_sent && m.agent) {
    m.done_sent = true;
    if (!m.finished) {
      Status s = m.agent->SendDone();
      if (!s.ok()) LOG(WARNING) << "done not sent: " << s;
    }
  }
  if (m.coordinator) {
    Status s = m.coordinator->Wait(Deadline::AfterMs(timeout_ms));
    if (m.agent) m.agent->Close();  // before the coordinator closes it
    m.coordinator->Stop();
    m.coordinator.reset();
    return s;
  }
  return Status();
}

WorkerId Runtime::worker_id() const { return impl_->agent ? impl_->agent->id() : 0; }
const Generation& Runtime::generation() const { return impl_->gen; }
int Runtime::rank() const { return impl_->gen.RankOf(worker_id()); }
int64_t Runtime::next_step() const { return impl_->next_step; }
std::string Runtime::coordinator_address() const {
  return impl_->coordinator ? impl_->coordinator->control_address() : impl_->opts.coordinator;
}
std::string Runtime::api_address() const {
  if (!impl_->coordinator || impl_->coordinator->http_port() == 0) return "";
  return "127.0.0.1:" + std::to_string(impl_->coordinator->http_port());
}
Coordinator* Runtime::hosted_coordinator() { return impl_->coordinator.get(); }
const std::optional<Reconfiguration>& Runtime::last_reconfiguration() const {
  return impl_->last_reconfiguration;
}

}  // namespace morph
