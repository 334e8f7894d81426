#include "runtime/switch/change_builder.h"

#include <glog/logging.h>

#include <algorithm>

#include "base/logging.h"

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;

PrepareMsg AsPrepare(const CommitMsg& c) {
  return PrepareMsg{
      .next = c.next, .from_generation = c.from_generation, .from = c.from, .change = c.change};
}

}  // namespace

void ChangeBuilder::Built::SetResult(StatusOr<std::unique_ptr<PreparedSwitch>> built) {
  std::lock_guard<std::mutex> l(mu);
  result = std::move(built);
  if (aborted_from >= 0 && result.ok() && *result && (*result)->from().id == aborted_from) {
    (*result)->Abort();
  }
}

void ChangeBuilder::Start(const PrepareMsg& p, SwitchOptions options, std::function<void()> ready) {
  std::lock_guard<std::mutex> l(mu_);
  if (latest_ && latest_->generation >= p.next.id) return;  // a duplicate: the first one reports
  if (latest_) {
    // A newer proposal replaces it (a successor's, after the one built here died with its
    // leader): its late answer would promise a step for a proposal nobody runs.
    latest_->superseded.store(true);
    stale_.push_back(std::move(latest_));
  }
  auto job = std::make_shared<Built>();
  job->generation = p.next.id;
  job->from = p.from.id;
  job->cancel = options.cancel;
  // The thread gets copies of what it reads (see Built).
  job->thread = std::thread([job_ref = job, p, in = in_, options = std::move(options),
                             gate = gate_, ready = std::move(ready)] {
    Built* raw = job_ref.get();
    // Answer the prepare however this ends (a failure shows at the switch step).
    struct Ready {
      const std::function<void()>& f;
      ReadyGate& gate;
      std::atomic<bool>& finished;
      const std::atomic<bool>& superseded;
      ~Ready() {
        {
          std::lock_guard<std::mutex> l(gate.mu);
          if (gate.open && f && !superseded.load()) f();
        }
        finished.store(true);
      }
    } answer{ready, *gate, raw->finished, raw->superseded};
    const auto began = Clock::now();
    Deadline deadline = Deadline::AfterMs(in.timeout_ms);
    // A fresh client (the training thread's store may not exist yet: a prepare can arrive while
    // Start is still connecting).
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
      raw->store_address = in.store_address;
    }
    StatusOr<std::unique_ptr<PreparedSwitch>> built =
        PrepareSwitch(in.manifest, in.me, p, *client, in.factory, options, deadline);
    LogContext log("switch");
    log.Set(p.next.id, p.next.RankOf(in.me), p.next.config.world());
    MORPH_LOG(INFO, log) << "worker " << in.me << " prepared the generation in "
                         << std::chrono::duration<double>(Clock::now() - began).count() << " s"
                         << (built.ok() ? std::string() : ": " + built.status().ToString());
    raw->SetResult(std::move(built));  // AbortFrom reads it
  });
  latest_ = std::move(job);
}

void ChangeBuilder::AbortFrom(int64_t from) {
  std::lock_guard<std::mutex> l(mu_);
  for (Built* p : {latest_.get(), switching_.get()}) {
    if (!p) continue;
    std::lock_guard<std::mutex> r(p->mu);
    p->aborted_from = from;
    if (p->result.ok() && *p->result && (*p->result)->from().id == from) (*p->result)->Abort();
    // A build in progress: its communicators still being created end at their next poll.
    if (p->from == from && p->cancel) p->cancel->Cancel();
  }
}

void ChangeBuilder::Abandon(int64_t generation) {
  std::lock_guard<std::mutex> l(mu_);
  if (latest_ && latest_->generation == generation) stale_.push_back(std::move(latest_));
}

void ChangeBuilder::JoinStale() {
  std::vector<BuiltPtr> done;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& p : stale_) {
      if (p->finished.load()) done.push_back(std::move(p));
    }
    std::erase(stale_, nullptr);
  }
  for (auto& p : done) {
    if (p->thread.joinable()) p->thread.join();
  }
}

void ChangeBuilder::JoinOrDetach(std::chrono::milliseconds grace) {
  std::vector<BuiltPtr> all;
  {
    std::lock_guard<std::mutex> l(mu_);
    all.swap(stale_);
    if (latest_) all.push_back(std::move(latest_));
  }
  const auto until = Clock::now() + grace;
  for (auto& p : all) {
    while (!p->finished.load() && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  {
    std::lock_guard<std::mutex> l(gate_->mu);
    gate_->open = false;
  }
  for (auto& p : all) {
    if (!p->thread.joinable()) continue;
    if (p->finished.load()) {
      p->thread.join();
    } else {
      LogContext log("switch");
      log.Set(p->generation, -1, 0);
      MORPH_LOG(WARNING, log) << "worker " << in_.me
                              << ": the abandoned build is still waiting on its peers; left to "
                                 "end at its deadline";
      p->thread.detach();
    }
  }
}

StatusOr<ChangeBuilder::BuiltPtr> ChangeBuilder::Take(const CommitMsg& c, TcpStoreClient& store,
                                                      const SwitchOptions& options,
                                                      Deadline deadline) {
  BuiltPtr mine;
  std::string address;
  bool moved = false;  // a successor's store: the training thread's may be the dead leader's
  {
    std::lock_guard<std::mutex> l(mu_);
    address = in_.store_address;
    moved = store_moved_;
    if (latest_ && latest_->generation == c.next.id) mine = std::move(latest_);
    if (!mine) {
      mine = std::make_shared<Built>();
      mine->generation = c.next.id;
    }
    switching_ = mine;  // an abort reaches it from now on, until Done()
  }
  if (mine->thread.joinable()) {
    mine->thread.join();
    return mine;
  }
  if (!moved) {
    MORPH_ASSIGN_OR_RETURN(mine->store, store.ForGeneration(c.next.id, deadline));
  } else {
    MORPH_ASSIGN_OR_RETURN(mine->store,
                           TcpStoreClient::Connect(address, in_.token, c.next.id, deadline));
  }
  mine->store_address = address;
  mine->SetResult(
      PrepareSwitch(in_.manifest, in_.me, AsPrepare(c), *mine->store, in_.factory, options,
                    deadline));
  return mine;
}

void ChangeBuilder::Done() {
  std::lock_guard<std::mutex> l(mu_);
  switching_.reset();
}

}  // namespace morph
