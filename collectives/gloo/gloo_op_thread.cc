// GlooCommunicator::Impl's op thread (gloo_communicator_impl.h): the queue and its one
// thread, the sentinel receive that sees a peer's connection close, the grace before a
// peer's loss fails an operation, abort from any thread, and the mapping of Gloo's errors.
#include "collectives/gloo/gloo_communicator_impl.h"

namespace morph {

void GlooCommunicator::Impl::Shutdown() {
  std::deque<std::shared_ptr<Task>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (running_ || !queue_.empty()) AbortLocked("communicator destroyed");
    left.swap(queue_);
  }
  queue_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (sentinel_thread_.joinable()) {
    stopping_sentinel_.store(true);
    sentinel_->abortWaitRecv();
    sentinel_thread_.join();
  }
  for (auto& task : left) {
    std::lock_guard<std::mutex> lock(task->mu);
    task->done = true;
    task->status = AbortedError(Describe() + ": destroyed before the operation ran");
    task->cv.notify_all();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (shm_ != nullptr) shm_->Close();  // peers waiting for this rank fail now
  shm_.reset();
  sentinel_.reset();
  mailboxes_.reset();
  context_.reset();
}

void GlooCommunicator::Impl::StartThreads() {
  gloo_support::ScopedUnbind unbind(device_->impl()->unbind_threads);  // threads inherit it
  thread_ = std::thread([this] {
    gloo_support::BlockSigpipeInThisThread();
    Loop();
  });
  if (size_ > 1) {
    mailboxes_ = std::make_unique<gloo_algorithms::Mailboxes>(context_.get(), rank_, size_,
                                                              GlooCommunicator::kOneShotMaxBytes);
    sentinel_bytes_.assign(size_, 0);
    sentinel_ = context_->createUnboundBuffer(sentinel_bytes_.data(), sentinel_bytes_.size());
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_) sentinel_->recv(peer, kSentinelSlot, peer, 1);
    }
    sentinel_thread_ = std::thread([this] {
      gloo_support::BlockSigpipeInThisThread();
      Sentinel();
    });
  }
}

void GlooCommunicator::Impl::Sentinel() {
  Status lost;
  try {
    if (!sentinel_->waitRecv(nullptr, std::chrono::hours(24 * 365))) return;  // shutdown
    lost = InternalError(Describe() + ": a peer wrote to the reserved sentinel slot");
  } catch (const std::exception& e) {
    if (stopping_sentinel_.load()) return;
    lost = UnavailableError(Describe() + ": a peer connection closed: " + e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    NoteClosedPeersLocked();  // now, before survivors' reactions close more pairs
    peer_lost_ = lost;
    peer_lost_at_ = std::chrono::steady_clock::now();
  }
  // An operation that runs on its caller's thread (TryRunInline) has no GlooWork::Wait to
  // notice the loss: fail whatever still runs once the grace period has passed.
  while (!stopping_sentinel_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (PeerLossPastGrace().ok()) continue;
    bool running;
    {
      std::lock_guard<std::mutex> lock(mu_);
      running = running_;
    }
    if (running) {
      FailWith(lost);
      return;
    }
  }
}

Status GlooCommunicator::Impl::PeerLossPastGrace() {
  std::lock_guard<std::mutex> lock(mu_);
  if (peer_lost_.ok() || std::chrono::steady_clock::now() - peer_lost_at_ < kPeerLossGrace) {
    return Status::Ok();
  }
  return peer_lost_;
}

void GlooCommunicator::Impl::Abort(std::string_view why) {
  std::lock_guard<std::mutex> lock(mu_);
  AbortLocked(why);
}

void GlooCommunicator::Impl::FailWith(const Status& error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_.ok()) error_ = WithFailureLocked(error);
  AbortLocked("failed");
}

void GlooCommunicator::Impl::AbortLocked(std::string_view why) {
  if (aborted_.exchange(true)) return;
  if (error_.ok()) {
    error_ = WithFailureLocked(AbortedError(Describe() + ": aborted (" + std::string(why) + ")"));
  }
  broken_.store(true);
  SignalAllPairs("morph: communicator aborted");
  // A wait on a pair that already failed is not always woken by the signal; these are.
  waits_.Abort();
  if (mailboxes_ != nullptr) mailboxes_->Abort();
}

void GlooCommunicator::Impl::NoteClosedPeersLocked() {
  if (closed_peers_.empty() && context_ != nullptr) {
    closed_peers_ = gloo_support::PeersWithClosedPairs(*context_);
  }
}

Status GlooCommunicator::Impl::WithFailureLocked(const Status& s) {
  CollectiveFailure f;
  switch (s.code()) {
    case StatusCode::kUnavailable:
      f.kind = CollectiveFailure::Kind::kPeerClosed;
      break;
    case StatusCode::kDeadlineExceeded:
      f.kind = CollectiveFailure::Kind::kTimeout;
      break;
    case StatusCode::kAborted:
      return s.WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}, name_});
    default:
      return s;
  }
  NoteClosedPeersLocked();
  // The shared-memory path names the peers it saw exit or leave itself.
  const CollectiveFailure* own = s.collective_failure();
  f.peers = own != nullptr && !own->peers.empty() ? own->peers : closed_peers_;
  f.group = name_;
  return s.WithCollectiveFailure(std::move(f));
}

void GlooCommunicator::Impl::SignalAllPairs(const std::string& msg) {
  if (shm_ != nullptr) shm_->Fail();  // wakes this rank's shared-memory wait and the peers'
  if (context_ == nullptr) return;
  for (int i = 0; i < size_; ++i) {
    if (i == rank_) continue;
    auto& pair = context_->getPair(i);
    if (auto* tcp = dynamic_cast<gloo::transport::tcp::Pair*>(pair.get())) {
      gloo_support::PairAccess::Signal(tcp, msg);
    }
  }
}

void GlooCommunicator::Impl::Loop() {
  while (true) {
    std::shared_ptr<Task> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = queue_.front();
      queue_.pop_front();
      running_ = true;
    }
    Status s = RunOne(task->op);
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    {
      std::lock_guard<std::mutex> lock(task->mu);
      task->done = true;
      task->status = s;
    }
    task->cv.notify_all();
  }
}

Status GlooCommunicator::Impl::RunOne(const CollectiveOp& op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
  }
  Status s = Execute(op);
  // The shared-memory path needs no such delay: every rank there sees a dead peer's pidfd
  // itself and names it before any rank that merely left (ShmCollectives::PeerFailure).
  const bool in_shm = shm_ != nullptr && (op.kind == CollectiveOp::Kind::kSendRecv
                                               ? shm_->HandlesP2P()
                                               : shm_->Handles(op));
  // Ranks that disagreed on the collective (CheckAgreement) found out before anything moved:
  // the communicator is as healthy as before.
  if (s.code() == StatusCode::kInvalidArgument) return s;
  if (!s.ok() && !aborted_.load() && s.code() == StatusCode::kUnavailable && !in_shm) {
    // A peer's connection closed. Before this rank closes its own pairs (below), let that
    // closure reach the other ranks: a rank that saw ours first would name this survivor,
    // not the dead peer, in its failed_peers. (Seen 2 times in 8 kill tests without it.)
    std::this_thread::sleep_for(kReactionDelay);
  }
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load()) {
      s = error_;  // the abort is the reason, not the error it caused inside Gloo
    } else if (error_.ok()) {
      error_ = s = WithFailureLocked(s);
      broken_.store(true);
      // Fail the peers now rather than at their timeouts.
      gloo_support::ScopedSigpipeBlock
          no_sigpipe;  // not blocked by a shared-memory caller (TryRunInline)
      SignalAllPairs("morph: peer rank " + std::to_string(rank_) +
                     " failed: " + std::string(s.message()));
    }
  }
  return s;
}

Status GlooCommunicator::Impl::Execute(const CollectiveOp& op) {
  // Collectives are issued by every rank in the same order, point-to-point groups by some
  // ranks only: only collectives advance the tag, so it agrees on every rank.
  // Point-to-point on one host: through the shared segment's pair rings.
  if (op.kind == CollectiveOp::Kind::kSendRecv && shm_ != nullptr && shm_->HandlesP2P()) {
    return shm_->SendRecv(op);
  }
  uint32_t tag = 0;
  if (op.kind != CollectiveOp::Kind::kSendRecv) {
    // On one host the shared-memory operation compares the ranks' calls itself (or, for one
    // too large for it, a round of its own there); otherwise one small allgather does.
    if (shm_ != nullptr) {
      if (shm_->Handles(op)) return shm_->Run(op, workspace_, KindName(op));
      MORPH_RETURN_IF_ERROR(shm_->Agree(op, KindName(op)));
    } else if (size_ > 1) {
      MORPH_RETURN_IF_ERROR(CheckAgreement(op));
    }
    tag = NextTag();
  }
  try {
    return ExecuteOrThrow(op, tag);
  } catch (const gloo::IoException& e) {
    return MapIoError(op, e.what());
  } catch (const gloo::EnforceNotMet& e) {
    return InternalError(Describe() + ": " + KindName(op) + ": " + e.what());
  } catch (const std::exception& e) {
    return MapIoError(op, e.what());
  }
}

Status GlooCommunicator::Impl::CheckAgreement(const CollectiveOp& op) {
  const OpSignature mine = OpSignature::Of(op);
  std::vector<OpSignature> all(static_cast<size_t>(size_));
  const uint32_t tag = NextTag();
  try {
    MORPH_RETURN_IF_ERROR(Allgather(&mine, all.data(), sizeof(mine), op.timeout, tag));
  } catch (const std::exception& e) {
    return MapIoError(op, e.what());
  }
  for (int r = 0; r < size_; ++r) {
    if (!(all[r] == mine)) {
      return DisagreementError(Describe() + ": " + KindName(op), r, all[r], rank_, mine);
    }
  }
  return Status::Ok();
}

Status GlooCommunicator::Impl::MapIoError(const CollectiveOp& op, std::string_view what) {
  std::string msg = Describe() + ": " + KindName(op) + ": " + std::string(what);
  if (aborted_.load()) return AbortedError(msg);
  if (ClassifyGlooError(what) == GlooErrorKind::kTimeout) return DeadlineExceededError(msg);
  return UnavailableError(msg);
}

}  // namespace morph
