#include "morph/runtime.h"

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

#include "collectives/gloo/gloo_communicator.h"
#include "collectives/groups.h"
#include "collectives/store/tcp_store.h"
#include "runtime/agent/agent.h"
#include "runtime/switch/switch.h"
#include "runtime/api/bootstrap.h"
#include "runtime/api/data_plane.h"
#include "runtime/api/runtime_impl.h"
#include "runtime/state/undo.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/ha/election.h"
#include "runtime/ha/leader_watch.h"
#include "runtime/plan/plan_input.h"
#include "runtime/recovery/checkpointer.h"
#include "runtime/recovery/snapshot.h"

namespace morph {
namespace {

void OnSigterm(int) { Runtime::RequestLeaveFromSignal(); }

}  // namespace

// The one runtime of this process that SIGTERM asks to leave.
std::atomic<bool>& LeaveRequestedBySignal() {
  static std::atomic<bool> requested{false};
  return requested;
}

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
    const bool cuda = impl->state.memory_of(t) == MemoryKind::kCuda;
    impl->device_tensors.push_back(cuda);
    if (cuda) impl->cuda_state = true;
    if (impl->state.adopted(t)) {
      impl->adopted_state = true;
      if (!impl->state.allocator_any_thread(t)) impl->adopted_any_thread = false;
    }
  }
  // Morph-owned host shards from the host arena (Options::host_arena), so that same-host peers
  // read them by memcpy from a mapping during a reshard.
  bool owned_host = false;
  for (size_t t = 0; t < impl->state.tensors().size(); ++t) {
    if (!impl->state.adopted(t) && impl->state.memory_of(t) == MemoryKind::kHost) {
      owned_host = true;
    }
  }
  if (o.host_arena && o.shared_memory && owned_host) {
    // 4 KiB pages: collapsing each new shard into 2 MiB pages (ShmArena::Options::huge_pages)
    // made the switch slower still where shared-memory THP is off (docs/performance.md).
    impl->host_arena = std::make_unique<ShmArena>();
    impl->state.SetHostAllocator(impl->host_arena->allocator());
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
  if (impl->checkpointer && impl->agent) {
    // Retention deletes this job's checkpoints only, never an earlier run's on the same folder.
    impl->checkpointer->set_first_generation(impl->agent->welcome().first_generation);
  }
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
  candidate = boot.leader_from_etcd && coordinator != nullptr;
  opts.token = boot.token;
  GlooOptions gloo;
  if (!boot.data_hostname.empty()) gloo.hostname = boot.data_hostname;
  gloo.iface = opts.data_iface;
  MORPH_ASSIGN_OR_RETURN(device, GlooDevice::Create(gloo));
  // The step groups on the chosen backend (NCCL: this thread's CUDA device set here, before any
  // CUDA shard is allocated); reconfiguration traffic on Gloo (runtime/api/data_plane.h).
  MORPH_ASSIGN_OR_RETURN(DataPlane data_plane, MakeDataPlane(opts, device));
  factory = std::move(data_plane.factory);
  cuda_device = data_plane.cuda_device;
  if (opts.snapshot_every > 0) {
    BuddySnapshotOptions so;
    // Its own device, so its own Gloo event loop: a round's hundreds of MB are read on that
    // thread, which would otherwise delay the step's collectives behind them.
    MORPH_ASSIGN_OR_RETURN(so.device, GlooDevice::Create(gloo));
    so.timeout = std::chrono::milliseconds(opts.change_timeout_ms);
    snapshots = std::make_unique<BuddySnapshotter>(opts.snapshot_every, so);
  }

  AgentOptions ao;
  ao.heartbeat_ms = opts.heartbeat_ms;
  ao.coordinator_timeout_ms = opts.heartbeat_timeout_ms;  // a silent coordinator host is lost
  ao.on_prepare = [this](const PrepareMsg& p, std::function<void()> ready) {
    StartPrepare(p, std::move(ready));
  };
  ao.on_abandon = [this](int64_t g) { builder->Abandon(g); };
  ao.on_abort = [this](const AbortMsg& a) {
    AbortCollectives("coordinator: " + a.reason, a.generation);
    builder->AbortFrom(a.generation);  // a switch from that generation cannot complete either
  };
  ao.leave_requested = [] { return LeaveRequestedBySignal().exchange(false); };
  ao.on_connection_lost = [this](const Status& why) {
    AbortCollectives("the coordinator is gone (" + std::string(why.message()) + ")");
  };
  std::shared_ptr<EtcdClient> etcd;
  if (!opts.etcd.empty()) {
    // Coordinator failover: on a dropped connection, find the leader in etcd and rejoin it.
    MORPH_ASSIGN_OR_RETURN(EtcdOptions eo, EtcdOptions::Parse(opts.etcd, "MORPH_ETCD"));
    etcd = std::make_shared<EtcdClient>(eo);
    this->etcd = etcd;
    ao.reconnect_timeout_ms = opts.etcd_rejoin_ms;
    // Who leads, read on a thread of its own: a frozen leader keeps this worker's connection
    // open, so the worker learns of its successor from etcd, not from its socket.
    auto watch = std::make_shared<LeaderWatch>(
        eo, opts.etcd_prefix, std::chrono::milliseconds(std::max<int64_t>(opts.etcd_ttl_s * 250, 100)));
    leader_watch = watch;
    auto etcd_down = std::make_shared<std::atomic<bool>>(false);
    ao.leader_moved = [watch] { return watch->Moved(); };
    ao.control_plane_down = [etcd_down] { return etcd_down->load(); };
    ao.reconnect = [etcd, watch, etcd_down, prefix = opts.etcd_prefix, token = opts.token,
                    host = opts.host, m = manifest](WorkerId me, const ResumeState& state,
                              Deadline d) -> StatusOr<std::unique_ptr<ControlClient>> {
      StatusOr<std::optional<std::string>> key = LookupLeaderKey(*etcd, prefix);
      etcd_down->store(!key.ok());
      MORPH_RETURN_IF_ERROR(key.status());
      if (!*key) return UnavailableError("no coordinator leads " + prefix + " yet");
      MORPH_ASSIGN_OR_RETURN(std::string control,
                             LeaderControlAddress(LeaderValuePayload(**key)));
      HelloMsg h{.token = token, .host = host, .pid = getpid(), .resume_id = me};
      StatusOr<std::unique_ptr<ControlClient>> c = ControlClient::Connect(
          control, h, RegisterMsg{.manifest = m, .resume = state}, Min(d, Deadline::AfterMs(500)));
      if (c.ok()) watch->Follow(**key);
      return c;
    };
    ao.on_reconnected = [this](const WelcomeMsg& w) {
      if (builder) builder->SetStoreAddress(w.store_address);
    };
  }
  HelloMsg hello{.token = opts.token, .host = opts.host, .pid = getpid(), .capabilities = 0};
  while (true) {
    // Candidates hosted by workers: dial whichever leads now; a leader that died or stepped
    // down before this worker registered (refused, or "does not lead") is looked up again.
    if (boot.leader_from_etcd) {
      MORPH_ASSIGN_OR_RETURN(boot.coordinator_address,
                             FindLeader(*etcd, opts.etcd_prefix, deadline));
    }
    // In slices, so that a leave asked for meanwhile (SIGINT to a Python worker, SIGTERM)
    // ends the wait for a coordinator that is not there yet.
    StatusOr<std::unique_ptr<Agent>> a = Agent::Connect(
        boot.coordinator_address, hello, RegisterMsg{.manifest = manifest}, ao,
        Min(deadline, Deadline::AfterMs(boot.leader_from_etcd ? 5000 : 1000)));
    if (a.ok()) {
      agent = *std::move(a);
      break;
    }
    const StatusCode code = a.status().code();
    if (code == StatusCode::kCancelled) {
      // The job ended before this worker registered (a joiner a grow started just before the
      // end): it is released, as the joiners of a change the end closed are.
      LOG(INFO) << a.status().message();
      core.Finished();
      return Status();
    }
    if (deadline.Expired() ||
        (code != StatusCode::kUnavailable && code != StatusCode::kDeadlineExceeded)) {
      return a.status();
    }
    if (LeaveRequestedBySignal().exchange(false)) {
      LOG(INFO) << "asked to leave before it joined the job: done";
      core.Finished();
      return Status();
    }
    if (!boot.leader_from_etcd) continue;
    LOG(INFO) << "leader " << boot.coordinator_address << " did not register this worker ("
              << a.status() << "); looking it up again";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  builder = std::make_unique<ChangeBuilder>(ChangeBuilder::Inputs{
      .manifest = manifest,
      .me = agent->id(),
      .store_address = agent->welcome().store_address,
      .token = opts.token,
      .timeout_ms = opts.change_timeout_ms,
      .factory = factory});
  agent->StartThread();  // its callbacks use `agent` and `builder`
  const WelcomeMsg& w = agent->welcome();
  MORPH_ASSIGN_OR_RETURN(
      store, TcpStoreClient::Connect(w.store_address, opts.token, w.current.id, deadline));
  MORPH_LOG(INFO, agent->log()) << "registered with " << boot.coordinator_address
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
      core.Finished();
      return Status();  // released before it was ever needed
    }
    if (dec->action == AgentCore::Action::kSwitch) {
      const CommitMsg commit = *dec->commit;
      Status st = Switch(commit, SteadyClock::now());
      if (!st.ok()) {
        // Nothing of this worker's was at stake: unless some participant passed the closing
        // barrier (then it cannot follow), it waits for the next change as before (or for its
        // release, when the job ended meanwhile).
        StatusOr<bool> applied = agent->AwaitOutcome(Min(deadline, Deadline::AfterMs(opts.change_timeout_ms)));
        if (!applied.ok() || *applied) return st;
        // Its own state does not fit here (a tensor too large for this host's memory): a later
        // generation would ask the same of it.
        if (st.code() == StatusCode::kResourceExhausted) return st;
        MORPH_LOG(WARNING, agent->log()) << "generation " << commit.next.id
                     << " did not apply; waiting for the next one: " << st;
        continue;
      }
      joined_by_change = commit.from.id != 0;
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
  if (impl_->builder) impl_->builder->JoinOrDetach(std::chrono::milliseconds(1000));
  impl_->live.Reset();
  if (impl_->coordinator) impl_->coordinator->Stop();
}

State& Runtime::state() { return impl_->state; }
bool Runtime::fresh_start() const { return impl_->fresh; }

void Runtime::OnReconfigure(std::function<void(const Reconfiguration&)> callback) {
  impl_->on_reconfigure = std::move(callback);
}

StatusOr<Step> Runtime::BeginStep() {
  Impl& m = *impl_;
  if (m.done_sent && !m.core.finished()) {
    return FailedPreconditionError("BeginStep after Finish(): this worker's part of the job ended");
  }
  MORPH_RETURN_IF_ERROR(m.core.CheckBegin(m.next_step));
  Step step;
  bool reconfigured = m.joined_by_change;
  m.joined_by_change = false;
  if (!m.core.finished()) {
    m.agent->NoteBegin(m.next_step);
    if (m.agent->pending() || m.core.failed() ||
        LeaveRequestedBySignal().load(std::memory_order_relaxed)) {
      MORPH_ASSIGN_OR_RETURN(bool done, m.SlowPath(reconfigured));
      if (done) m.core.Finished();
    }
  }
  if (m.core.finished()) {
    StepAccess::Fill(step, true, false, m.next_step, m.gen, -1, m.opts.micro_batch, nullptr,
                     &*m.cursor);
    return step;
  }
  const int rank = m.gen.RankOf(m.agent->id());
  if (m.checkpointer && rank >= 0 && m.checkpointer->Due(m.next_step) &&
      m.next_step != m.restored_step) {
    // The state holds this step's values: snapshot it (the write goes on in the background).
    Status c = m.checkpointer->MaybeSave(m.next_step, m.gen.id, m.state, rank, m.gen.config.world(),
                                         m.gen.config);
    if (!c.ok()) MORPH_LOG(WARNING, m.agent->log()) << "checkpoint of step " << m.next_step << " not taken: " << c;
  }
  if (m.snapshots && rank >= 0 && m.snapshots->Due(m.next_step)) {
    // The state holds this step's values: copy it (the copy and the exchange with the buddy go
    // on in the background; BeginUpdate waits for the copy). A program that never called
    // BeginUpdate may change the state anywhere in the step: it waits for the copy here.
    Status c = m.snapshots->MaybeBegin(m.next_step, m.state);
    if (c.ok() && !m.core.declares_update()) {
      c = m.snapshots->WaitCopied(Deadline::AfterMs(m.opts.change_timeout_ms));
    }
    if (!c.ok() && !m.snapshot_warned) {
      m.snapshot_warned = true;
      MORPH_LOG(WARNING, m.agent->log()) << "snapshot of step " << m.next_step
                   << " not taken: " << c;
    }
  }
  if (m.opts.undo_copy && m.core.declares_update()) {
    // The undo copy overlaps forward/backward; BeginUpdate waits for it (undo.h).
    Status u = m.undo.Begin(m.state, m.next_step, m.gen.id);
    if (!u.ok() && !m.undo_warned) {
      MORPH_LOG(WARNING, m.agent->log()) << "no undo copy: " << u;
      m.undo_warned = true;
    }
  }
  StepAccess::Fill(step, false, reconfigured, m.next_step, m.gen, rank, m.opts.micro_batch,
                   m.live.get(), &*m.cursor);
  m.core.Begin(m.next_step);
  return step;
}

void Runtime::BeginUpdate() {
  Impl& m = *impl_;
  if (m.snapshots && !m.core.updating()) {
    // The step's snapshot copy (if one was begun) must be done before the state changes.
    Status c = m.snapshots->WaitCopied(Deadline::AfterMs(m.opts.change_timeout_ms));
    if (!c.ok() && !m.snapshot_warned) {
      m.snapshot_warned = true;
      MORPH_LOG(WARNING, m.agent->log()) << "snapshot of step " << m.next_step
                   << " not copied: " << c;
    }
  }
  if (m.opts.undo_copy && m.core.in_step() && !m.core.updating()) {
    Status s = m.undo.Take(m.state, m.next_step, m.gen.id);
    if (!s.ok() && !m.undo_warned) {
      MORPH_LOG(WARNING, m.agent->log()) << "no undo copy: " << s;
      m.undo_warned = true;
    }
  }
  m.core.BeginUpdate();
}

Status Runtime::EndStep() {
  MORPH_RETURN_IF_ERROR(impl_->core.End());
  impl_->undo.Cancel();  // a step without BeginUpdate: its copy in flight is not the undo copy
  ++impl_->next_step;
  return Status();
}

Status Runtime::AbortStep(const Status& why) {
  Impl& m = *impl_;
  MORPH_ASSIGN_OR_RETURN(bool aborted, m.core.Abort());
  if (!aborted) return Status();  // CommitUpdate failed and ended the step already
  m.undo.Cancel();  // before the recovery touches the state; the last taken copy stays
  if (m.core.torn()) m.state.MarkTorn();
  FailureReportMsg report{.generation = m.gen.id, .step = m.next_step, .error = why.ToString()};
  if (const CollectiveFailure* f = why.collective_failure()) {
    for (int r : f->peers) {
      // The communicator names ranks of its own group (one of this worker's groups).
      WorkerId w = m.WorkerOfGroupRank(f->group, r);
      if (w != 0) report.peers.push_back(w);
    }
  }
  m.agent->NoteStepFailed();
  MORPH_LOG(WARNING, m.agent->log()) << "step " << m.next_step << " aborted ("
               << (m.core.torn() ? "state torn" : "state intact") << "): " << why;
  return m.agent->SendFailure(report);
}

bool Runtime::Finished() const { return impl_->core.finished(); }

void Runtime::Leave(std::string reason) {
  if (impl_->agent) impl_->agent->RequestLeave(reason);
}

void Runtime::RequestLeaveFromSignal() { LeaveRequestedBySignal().store(true); }

Status Runtime::Finish(int64_t timeout_ms) {
  Impl& m = *impl_;
  if (!m.done_sent && m.agent) {
    m.done_sent = true;
    // A worker that left in a change is no member any more; one released because the job is
    // finishing still is, and the job completes once every member said it is done.
    if (!m.core.finished() || m.agent->released()) {
      Status s = m.agent->SendDone();
      const bool failover = !m.opts.etcd.empty();
      if (!s.ok() && !failover) MORPH_LOG(WARNING, m.agent->log()) << "done not sent: " << s;
      // With failover a Done that died with the leader would make a successor count this
      // worker lost: wait until a leader acknowledged it (the agent says it again to a
      // successor it reconnects to), for at most as long as a successor waits for workers.
      if (failover && !m.agent->WaitDoneAck(Deadline::AfterMs(m.opts.etcd_rejoin_ms))) {
        MORPH_LOG(WARNING, m.agent->log())
            << "no coordinator acknowledged this worker's Done within " << m.opts.etcd_rejoin_ms
            << " ms" << (s.ok() ? std::string() : " (" + std::string(s.message()) + ")")
            << ": a successor may count it lost";
      }
    }
  }
  if (m.coordinator && m.candidate) return m.FinishCandidate(timeout_ms);
  if (m.coordinator && m.gen.id == 0 && m.core.finished()) {
    // Asked to leave (or released) before the job it hosts ever started: waiting for that job
    // would wait for workers that may never come. The coordinator ends with its host.
    if (m.agent) m.agent->Close();
    m.coordinator->Stop();
    m.coordinator.reset();
    return Status();
  }
  if (m.coordinator) {
    Status s = m.coordinator->Wait(Deadline::AfterMs(timeout_ms));
    // Every worker, this one included, was asked to leave: its part ended as asked.
    if (s.code() == StatusCode::kCancelled) s = Status::Ok();
    if (m.agent) m.agent->Close();  // before the coordinator closes it
    m.coordinator->Stop();
    m.coordinator.reset();
    return s;
  }
  return Status();
}

namespace {
// The job's end as a hosted coordinator's Wait says it: every worker, this one included, asked
// to leave (kCancelled) is an end as asked.
Status JobEnded(const Status& s) { return s.code() == StatusCode::kCancelled ? Status::Ok() : s; }
}  // namespace

Status Runtime::Impl::FinishCandidate(int64_t timeout_ms) {
  const Deadline deadline = Deadline::AfterMs(timeout_ms);
  Status result;
  if (coordinator->stats().leading) {
    // A member whose training loop ended (not one that left in a change) ends with the job: as
    // the leader it hosts the job to its end, as without failover. A worker that left the job
    // (a shrink, a preemption notice) hands the lead over instead, so that the others train on
    // with another candidate.
    const bool ends_with_job = done_sent && (!core.finished() || (agent && agent->released()));
    if (ends_with_job || !agent) {
      result = JobEnded(coordinator->Wait(deadline));
    } else {
      result = HandOver(deadline);
    }
  }
  if (agent) agent->Close();  // before the coordinator closes it
  coordinator->Stop();  // a follower's lease is revoked: nothing else changes
  coordinator.reset();
  return result;
}

Status Runtime::Impl::HandOver(Deadline deadline) {
  // The change this worker left in is applied at this leader first: a successor that restored
  // it still committed would wait for this worker's Applied and count it lost (a recovery).
  const Deadline applied = Min(deadline, Deadline::AfterMs(opts.change_timeout_ms));
  while (coordinator->stats().leading && coordinator->Snapshot().generation < gen.id &&
         !applied.Expired()) {
    Status s = coordinator->Wait(Deadline::AfterMs(10));
    if (s.code() != StatusCode::kDeadlineExceeded) return JobEnded(s);  // ended meanwhile
  }
  // Out of the job: nothing more to tell a coordinator (its connection must not rejoin one).
  agent->Close();
  MORPH_LOG(INFO, agent->log()) << "this worker leaves the job: its coordinator resigns the lead";
  coordinator->Resign();
  const std::string me = coordinator->control_address();
  const auto gave_up = Deadline::AfterMs(1000);
  while (coordinator->stats().leading && !gave_up.Expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  while (!deadline.Expired()) {
    StatusOr<std::optional<std::string>> v = LookupLeader(*etcd, opts.etcd_prefix);
    if (v.ok() && v->has_value()) {
      StatusOr<std::string> control = LeaderControlAddress(**v);
      if (control.ok() && *control != me) {
        MORPH_LOG(INFO, agent->log()) << "coordinator " << *control << " leads now";
        return Status::Ok();
      }
    }
    // No other candidate is left: this one leads again (a TTL after resigning) and hosts the
    // job to its end.
    if (coordinator->stats().leading) {
      MORPH_LOG(WARNING, agent->log()) << "no other coordinator candidate took the lead: this "
                                          "worker hosts the job's coordinator to its end";
      return JobEnded(coordinator->Wait(deadline));
    }
    Status s = coordinator->Wait(Min(deadline, Deadline::AfterMs(50)));
    if (s.code() != StatusCode::kDeadlineExceeded) return JobEnded(s);
  }
  return DeadlineExceededError("no other coordinator candidate took the lead in time");
}

WorkerId Runtime::worker_id() const { return impl_->agent ? impl_->agent->id() : 0; }
const Generation& Runtime::generation() const { return impl_->gen; }
int Runtime::rank() const { return impl_->gen.RankOf(worker_id()); }
int64_t Runtime::next_step() const { return impl_->next_step; }
const DatasetCursor& Runtime::cursor() const { return *impl_->cursor; }
std::string Runtime::coordinator_address() const {
  return impl_->coordinator ? impl_->coordinator->control_address() : impl_->opts.coordinator;
}
std::string Runtime::api_address() const {
  if (!impl_->coordinator || impl_->coordinator->http_port() == 0) return "";
  return "127.0.0.1:" + std::to_string(impl_->coordinator->http_port());
}
const std::optional<Reconfiguration>& Runtime::last_reconfiguration() const {
  return impl_->last_reconfiguration;
}

}  // namespace morph
