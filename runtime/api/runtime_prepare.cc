#include <glog/logging.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "runtime/api/runtime_impl.h"
#include "runtime/protocol/wire.h"

namespace morph {
namespace {

PrepareMsg AsPrepare(const CommitMsg& c) {
  return PrepareMsg{
      .next = c.next, .from_generation = c.from_generation, .from = c.from, .change = c.change};
}

}  // namespace

void Runtime::Impl::AbortCollectives(const std::string& why, int64_t generation) {
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

void Runtime::Impl::StartSnapshots() {
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

SnapshotHoldings Runtime::Impl::EndSnapshots() {
  SnapshotHoldings h;
  if (!snapshots) return h;
  // A round in flight is cut off but not waited for (its thread is joined by the next
  // StartGeneration): it writes only into copies that are incomplete, which are not reported,
  // and an exchange with a dead peer took up to 0.1 s more to unwind on a loaded host, which
  // the whole recovery waited for.
  snapshots->Abort();
  const std::vector<int64_t> local = snapshots->LocalSteps(gen.id);
  const std::vector<int64_t> held = snapshots->HeldSteps(gen.id);
  if (!local.empty()) h.local_step = local[0];
  if (local.size() > 1) h.local_prev_step = local[1];
  if (!held.empty() && snapshots->held_generation() == gen.id) {
    h.held_step = held[0];
    if (held.size() > 1) h.held_prev_step = held[1];
    h.held_rank = snapshots->held_rank();
    h.held_tensors = snapshots->HeldTensors(gen.id);
    // A list the report cannot carry (more tensors than a wire id list holds): the held copies
    // are not offered; the recovery then has the other sources.
    if (h.held_tensors.size() > kMaxIdList) {
      LOG(WARNING) << "worker " << agent->id() << ": the held snapshot copies hold "
                   << h.held_tensors.size() << " tensors, more than a report carries ("
                   << kMaxIdList << "); not offered to the recovery";
      h.held_step = h.held_prev_step = h.held_rank = -1;
      h.held_tensors.clear();
    }
  }
  return h;
}

SwitchOptions Runtime::Impl::SwitchOpts() const {
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
  // The first snapshot after the rollback then copies only what the change moved.
  s.restored_from_own_snapshot = [this](int64_t step, std::vector<bool> tensors) {
    if (snapshots) snapshots->NoteRestored(step, gen.id, std::move(tensors));
  };
  s.batch_bytes = opts.batch_bytes;
  s.executor.chunk_bytes = manifest.chunk_bytes;
  s.executor.staging_bytes = manifest.staging_bytes;
  s.transport.shared_memory = opts.shared_memory;
  s.timeout = std::chrono::milliseconds(opts.change_timeout_ms);
  s.previous_groups_can_shrink = groups_can_shrink.load();
  return s;
}

void Runtime::Impl::StartPrepare(const PrepareMsg& p, std::function<void()> ready) {
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
  Inputs in{
      manifest, agent->id(), agent->welcome().store_address, opts.token, opts.change_timeout_ms,
      factory,  SwitchOpts()};
  job->thread = std::thread(
      [job_ref = job, p, in = std::move(in), gate = ready_gate, ready = std::move(ready)] {
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
        raw->SetResult(std::move(built));  // on_abort reads it
      });
  prep = std::move(job);
}

void Runtime::Impl::Prepared::SetResult(StatusOr<std::unique_ptr<PreparedSwitch>> built) {
  std::lock_guard<std::mutex> l(mu);
  result = std::move(built);
  if (aborted_from >= 0 && result.ok() && *result && (*result)->from().id == aborted_from) {
    (*result)->Abort();
  }
}

void Runtime::Impl::AbortSwitchFrom(int64_t generation) {
  std::lock_guard<std::mutex> l(prep_mu);
  for (Prepared* p : {prep.get(), switching.get()}) {
    if (!p) continue;
    std::lock_guard<std::mutex> r(p->mu);
    p->aborted_from = generation;
    if (p->result.ok() && *p->result && (*p->result)->from().id == generation) {
      (*p->result)->Abort();
    }
  }
}

void Runtime::Impl::AbandonPrepare(int64_t generation) {
  std::lock_guard<std::mutex> l(prep_mu);
  if (prep && prep->generation == generation) stale.push_back(std::move(prep));
}

void Runtime::Impl::JoinStale() {
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

void Runtime::Impl::JoinOrDetachPrepares(std::chrono::milliseconds grace) {
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

StatusOr<Runtime::Impl::PreparedPtr> Runtime::Impl::TakePrepared(const CommitMsg& c,
                                                                 Deadline deadline) {
  PreparedPtr mine;
  {
    std::lock_guard<std::mutex> l(prep_mu);
    if (prep && prep->generation == c.next.id) {
      mine = std::move(prep);
      switching = mine;  // an abort still reaches it while it runs
    }
  }
  if (mine) {
    if (mine->thread.joinable()) mine->thread.join();
    return mine;
  }
  mine = std::make_shared<Prepared>();
  mine->generation = c.next.id;
  {
    std::lock_guard<std::mutex> l(prep_mu);  // an abort from now on reaches it
    switching = mine;
  }
  MORPH_ASSIGN_OR_RETURN(mine->store, store->ForGeneration(c.next.id, deadline));
  mine->SetResult(PrepareSwitch(manifest, agent->id(), AsPrepare(c), *mine->store, factory,
                                SwitchOpts(), deadline));
  return mine;
}

}  // namespace morph
