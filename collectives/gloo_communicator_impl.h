// GlooCommunicator::Impl and GlooDevice::Impl (gloo_communicator.h): the op thread, the
// collectives on Gloo, point-to-point groups, peer-loss detection and abort. Split out of
// gloo_communicator.cc, its only includer (not installed).
#ifndef MORPH_COLLECTIVES_GLOO_COMMUNICATOR_IMPL_H_
#define MORPH_COLLECTIVES_GLOO_COMMUNICATOR_IMPL_H_

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include <net/if.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "base/logging.h"
#include "base/params.h"
#include "collectives/gloo_communicator.h"
#include "collectives/gloo_algorithms.h"
#include "collectives/gloo_support.h"
#include "collectives/shm_collectives.h"

namespace morph {

class GlooDevice::Impl {
 public:
  std::shared_ptr<gloo::transport::Device> device;
  bool unbind_threads = true;
  ShmCollectives::Options shm;
};

class GlooCommunicator::Impl {
 public:
  // Slots of point-to-point messages: above every slot Gloo's collectives use (their prefixes
  // are small), one sequence per (peer, direction).
  static constexpr uint64_t kP2PSlotBase = uint64_t{0xAB} << 56;
  static constexpr uint64_t kHeaderSlotBase = uint64_t{0xAC} << 56;
  // A receive from every peer that no peer ever sends to: see Impl::Sentinel.
  static constexpr uint64_t kSentinelSlot = uint64_t{0xAD} << 56;
  static constexpr uint64_t kP2PSlotMask = (uint64_t{1} << 56) - 1;
  // How long an operation may still finish after a peer's connection closed (see Sentinel).
  static constexpr auto kPeerLossGrace = std::chrono::milliseconds(250);
  // How long a rank whose operation saw a peer's connection close waits before it closes its
  // own (RunOne): the peers then learn of the closure from the dead peer first.
  static constexpr auto kReactionDelay = std::chrono::milliseconds(100);

  template <typename T>
  static gloo::AllreduceOptions::Func ReduceFn(ReduceOp op) {
    switch (op) {
      case ReduceOp::kSum:
        return static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<T>);
      case ReduceOp::kMax:
        return static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<T>);
      case ReduceOp::kMin:
        return static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::min<T>);
    }
    return nullptr;
  }

 public:
  struct Task {
    CollectiveOp op;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
  };

  Impl(std::string name, int rank, int size, int64_t generation)
      : name_(std::move(name)),
        rank_(rank),
        size_(size),
        generation_(generation),
        log_("collectives") {
    log_.Set(generation, rank, size);
  }

  ~Impl() { Shutdown(); }

  // Aborts what is queued or running, joins the thread and releases the context (its sockets).
  // Idempotent. Not from the op thread.
  void Shutdown() {
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

  void StartThreads() {
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

  // Gloo wakes a wait only when the pair it waits on fails. A rank blocked on a healthy pair
  // while another of its pairs died (e.g. its writes to a dead peer got EPIPE, which Gloo's
  // event loop never reports) would sit until its timeout. The sentinel is a receive posted
  // on every pair and never matched: when any pair closes, Gloo wakes it. A peer that simply
  // destroyed its communicator after the last operation looks the same, so the loss only
  // fails an operation that is still unfinished kPeerLossGrace later (GlooWork::Wait).
  void Sentinel() {
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

  // The sentinel's status once a peer has been gone for longer than the grace period.
  Status PeerLossPastGrace() {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer_lost_.ok() || std::chrono::steady_clock::now() - peer_lost_at_ < kPeerLossGrace) {
      return Status::Ok();
    }
    return peer_lost_;
  }

  std::shared_ptr<Task> Enqueue(CollectiveOp op) {
    auto task = std::make_shared<Task>();
    task->op = std::move(op);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(task);
    }
    queue_cv_.notify_one();
    return task;
  }

  void Abort(std::string_view why) {
    std::lock_guard<std::mutex> lock(mu_);
    AbortLocked(why);
  }

  // Fails the communicator with `error` (unless it already failed) and wakes everything.
  void FailWith(const Status& error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = WithFailureLocked(error);
    AbortLocked("failed");
  }

  void AbortLocked(std::string_view why) {
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

  // Remembers which peers' connections had failed when this rank first noticed a failure,
  // before its own reaction (SignalAllPairs) closes its other pairs and theirs.
  void NoteClosedPeersLocked() {
    if (closed_peers_.empty() && context_ != nullptr) {
      closed_peers_ = gloo_support::PeersWithClosedPairs(*context_);
    }
  }

  // `s` with its typed CollectiveFailure: the kind follows the code (the code was chosen by
  // ClassifyGlooError); the peers are those noted by NoteClosedPeersLocked.
  Status WithFailureLocked(const Status& s) {
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

  // Breaks every pair (and leaves the shared-memory segment) so that waits wake now and peers
  // see the connection close.
  void SignalAllPairs(const std::string& msg) {
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

  std::string Describe() const {
    return "gloo communicator '" + name_ + "' generation " + std::to_string(generation_) +
           " rank " + std::to_string(rank_) + "/" + std::to_string(size_);
  }

  // Runs on the thread: executes tasks in order.
  void Loop() {
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

  // Whether `op` may run on its caller's thread: collectives whose messages are all small
  // (kOneShotMaxBytes), so that a wait can hardly be caught in the middle of a payload, which
  // Gloo's own pair signal does not wake (docs/collectives.md, "Small-message latency"; ours,
  // gloo_support::PairAccess::Signal, now does); larger ones and send/recv groups keep the op thread, whose
  // Wait notices an abort or a lost peer whatever Gloo does.
  bool SmallEnoughToRunInline(const CollectiveOp& op) const {
    const size_t bytes = op.count * DTypeSize(op.dtype);
    switch (op.kind) {
      case CollectiveOp::Kind::kBarrier:
        return true;
      case CollectiveOp::Kind::kAllreduce:
      case CollectiveOp::Kind::kBroadcast:
        return bytes <= GlooCommunicator::kOneShotMaxBytes;
      case CollectiveOp::Kind::kAllgather:
      case CollectiveOp::Kind::kReduceScatter:
        return bytes * static_cast<size_t>(size_) <= GlooCommunicator::kOneShotMaxBytes;
      case CollectiveOp::Kind::kSendRecv:
        return false;
    }
    return false;
  }

  // Runs a small `op` on the calling thread if nothing started before it is queued or running
  // (the blocking calls: no hand-off to the op thread and back, two thread wake-ups per
  // operation that cost up to a scheduler tick each on a busy host); nullopt otherwise.
  // Gloo's own waits enforce op.timeout; Abort() wakes them as it does the op thread's (and
  // the mailboxes' receives directly).
  std::optional<Status> TryRunInline(const CollectiveOp& op) {
    if (!SmallEnoughToRunInline(op) && !(shm_ != nullptr && shm_->Handles(op))) {
      return std::nullopt;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ || running_ || !queue_.empty()) return std::nullopt;
      running_ = true;
    }
    Status s;
    {
      // The shared-memory path writes to no socket, and blocking SIGPIPE costs three system
      // calls (0.8 us measured here), as much as a whole 8 B allreduce there. RunOne blocks it
      // itself where an error makes it signal the pairs.
      std::optional<gloo_support::ScopedSigpipeBlock> no_sigpipe;
      if (shm_ == nullptr || !shm_->Handles(op)) no_sigpipe.emplace();
      s = RunOne(op);
    }
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    return s;
  }

  // One operation on the thread that runs it (the op thread, or the caller's: TryRunInline).
  // Fails the communicator on its first error.
  Status RunOne(const CollectiveOp& op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_.ok()) return error_;
    }
    Status s = Execute(op);
    // The shared-memory path needs no such delay: every rank there sees a dead peer's pidfd
    // itself and names it before any rank that merely left (ShmCollectives::PeerFailure).
    const bool in_shm = shm_ != nullptr && shm_->Handles(op);
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
        gloo_support::ScopedSigpipeBlock no_sigpipe;  // not blocked by a shared-memory caller (TryRunInline)
        SignalAllPairs("morph: peer rank " + std::to_string(rank_) +
                       " failed: " + std::string(s.message()));
      }
    }
    return s;
  }

  Status Execute(const CollectiveOp& op) {
    // Collectives are issued by every rank in the same order, point-to-point groups by some
    // ranks only: only collectives advance the tag, so it agrees on every rank.
    uint32_t tag = 0;
    if (op.kind != CollectiveOp::Kind::kSendRecv) {
      tag = static_cast<uint32_t>(++collective_seq_ & 0x7fffffff);
    }
    if (shm_ != nullptr && shm_->Handles(op)) return shm_->Run(op, workspace_, KindName(op));
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

  Status MapIoError(const CollectiveOp& op, std::string_view what) {
    std::string msg = Describe() + ": " + KindName(op) + ": " + std::string(what);
    if (aborted_.load()) return AbortedError(msg);
    if (ClassifyGlooError(what) == GlooErrorKind::kTimeout) return DeadlineExceededError(msg);
    return UnavailableError(msg);
  }

  static const char* KindName(const CollectiveOp& op) {
    switch (op.kind) {
      case CollectiveOp::Kind::kAllreduce:
        return "allreduce";
      case CollectiveOp::Kind::kBroadcast:
        return "broadcast";
      case CollectiveOp::Kind::kAllgather:
        return "allgather";
      case CollectiveOp::Kind::kReduceScatter:
        return "reduce_scatter";
      case CollectiveOp::Kind::kBarrier:
        return "barrier";
      case CollectiveOp::Kind::kSendRecv:
        return "send/recv";
    }
    return "?";
  }

  Status ExecuteOrThrow(const CollectiveOp& op, uint32_t tag) {
    const size_t esize = DTypeSize(op.dtype);
    switch (op.kind) {
      case CollectiveOp::Kind::kAllreduce:
        return AllreduceInPlace(op.recv, op.count, op.dtype, op.reduce, op.timeout, tag);
      case CollectiveOp::Kind::kBroadcast: {
        if (op.count == 0 || size_ == 1) return Status::Ok();
        gloo::BroadcastOptions opts(context_);
        opts.setOutput(static_cast<uint8_t*>(op.recv), op.count * esize);
        opts.setRoot(op.root);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::broadcast(opts);
        return Status::Ok();
      }
      case CollectiveOp::Kind::kAllgather:
        return Allgather(op.send, op.recv, op.count * esize, op.timeout, tag);
      case CollectiveOp::Kind::kReduceScatter: {
        if (op.count == 0) return Status::Ok();
        if (size_ == 1) {
          std::memmove(op.recv, op.send, op.count * esize);
          return Status::Ok();
        }
        gloo_algorithms::Messenger m(context_.get(), &workspace_, tag, Deadline::After(op.timeout),
                                     Describe() + ": reduce_scatter", &waits_);
        if (op.count * esize * size_ <= GlooCommunicator::kOneShotMaxBytes) {
          return gloo_algorithms::ReduceScatterDirect(m, *mailboxes_, rank_, size_, op.send,
                                                      op.recv, op.count, op.dtype, op.reduce);
        }
        return gloo_algorithms::ReduceScatterRing(m, rank_, size_, op.send, op.recv, op.count,
                                                  op.dtype, op.reduce);
      }
      case CollectiveOp::Kind::kBarrier: {
        if (size_ == 1) return Status::Ok();
        gloo::BarrierOptions opts(context_);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::barrier(opts);
        return Status::Ok();
      }
      case CollectiveOp::Kind::kSendRecv:
        return SendRecv(op);
    }
    return InternalError("unknown operation");
  }

  Status Allgather(const void* send, void* recv, size_t bytes, std::chrono::milliseconds timeout, uint32_t tag) {
    if (bytes == 0) return Status::Ok();  // Gloo divides by the size: guard empty inputs
    if (size_ == 1) {
      std::memmove(recv, send, bytes);
      return Status::Ok();
    }
    gloo::AllgatherOptions opts(context_);
    opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
    opts.setOutput(static_cast<uint8_t*>(recv), bytes * size_);
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allgather(opts);
    return Status::Ok();
  }

  // Up to kOneShotMaxBytes: one round, rank order (gloo_algorithms.h). Larger f16/bf16: our
  // ring with f32 partial sums (Gloo has no 16-bit float reduction). Larger other types:
  // Gloo's pipelined ring, measured 1.5-2x faster than ours at 64 MiB; its reduction order
  // is its own, the same on every rank and in every run.
  Status AllreduceInPlace(void* buf, size_t count, DType dtype, ReduceOp reduce,
                          std::chrono::milliseconds timeout, uint32_t tag) {
    if (count == 0 || size_ == 1) return Status::Ok();
    gloo_algorithms::Messenger m(context_.get(), &workspace_, tag, Deadline::After(timeout),
                                 Describe() + ": allreduce", &waits_);
    if (count * DTypeSize(dtype) <= GlooCommunicator::kOneShotMaxBytes) {
      return gloo_algorithms::AllreduceOneShot(m, *mailboxes_, rank_, size_, buf, count, dtype,
                                               reduce);
    }
    gloo::AllreduceOptions opts(context_);
    switch (dtype) {
      case DType::kF16:
      case DType::kBF16:
        return gloo_algorithms::AllreduceRing(m, rank_, size_, buf, count, dtype, reduce);
      case DType::kF32:
        opts.setOutput(static_cast<float*>(buf), count);
        opts.setReduceFunction(ReduceFn<float>(reduce));
        break;
      case DType::kF64:
        opts.setOutput(static_cast<double*>(buf), count);
        opts.setReduceFunction(ReduceFn<double>(reduce));
        break;
      case DType::kI32:
        opts.setOutput(static_cast<int32_t*>(buf), count);
        opts.setReduceFunction(ReduceFn<int32_t>(reduce));
        break;
      case DType::kI64:
        opts.setOutput(static_cast<int64_t*>(buf), count);
        opts.setReduceFunction(ReduceFn<int64_t>(reduce));
        break;
      case DType::kU8:
        opts.setOutput(static_cast<uint8_t*>(buf), count);
        opts.setReduceFunction(ReduceFn<uint8_t>(reduce));
        break;
      case DType::kI8:
        opts.setOutput(static_cast<int8_t*>(buf), count);
        opts.setReduceFunction(ReduceFn<int8_t>(reduce));
        break;
    }
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allreduce(opts);
    return Status::Ok();
  }

  // Posts one unbound buffer per message (receives first) and waits for all of them.
  struct Message {
    bool send;
    int peer;
    void* data;
    size_t bytes;
  };
  Status Exchange(const std::vector<Message>& messages, uint64_t slot_base, Deadline deadline,
                  std::vector<uint64_t>& send_seq, std::vector<uint64_t>& recv_seq) {
    gloo_algorithms::Messenger m(context_.get(), &workspace_, 0, deadline,
                                 Describe() + ": send/recv", &waits_);
    for (int pass = 0; pass < 2; ++pass) {  // receives first
      for (const Message& msg : messages) {
        if ((pass == 0) == msg.send || msg.bytes == 0) continue;
        uint64_t& seq = msg.send ? send_seq[msg.peer] : recv_seq[msg.peer];
        uint64_t slot = slot_base | (seq++ & kP2PSlotMask);
        if (msg.send) {
          m.SendToSlot(msg.peer, slot, msg.data, msg.bytes);
        } else {
          m.RecvFromSlot(msg.peer, slot, msg.data, msg.bytes);
        }
      }
    }
    return m.WaitAll();
  }

  // Two phases. First every pair that exchanges messages in this group compares the number
  // of messages and a hash of their sizes (one 16-byte message per direction), because Gloo
  // cannot survive a message larger than the receive posted for it (its event thread throws).
  // Then the payloads move.
  Status SendRecv(const CollectiveOp& op) {
    Deadline deadline = Deadline::After(op.timeout);
    struct Header {
      uint64_t count = 0;
      uint64_t hash = 14695981039346656037ull;  // FNV-1a over the sizes
      void Add(uint64_t bytes) {
        ++count;
        for (int i = 0; i < 8; ++i) {
          hash = (hash ^ ((bytes >> (8 * i)) & 0xff)) * 1099511628211ull;
        }
      }
    };
    std::vector<Header> out(size_), expected(size_), got(size_);
    std::vector<bool> sends_to(size_, false), recvs_from(size_, false);
    for (const P2POp& p : op.p2p) {
      if (p.kind == P2POp::Kind::kSend) {
        out[p.peer].Add(p.bytes);
        sends_to[p.peer] = true;
      } else {
        expected[p.peer].Add(p.bytes);
        recvs_from[p.peer] = true;
      }
    }
    std::vector<Message> headers;
    for (int peer = 0; peer < size_; ++peer) {
      if (sends_to[peer]) headers.push_back({true, peer, &out[peer], sizeof(Header)});
      if (recvs_from[peer]) headers.push_back({false, peer, &got[peer], sizeof(Header)});
    }
    MORPH_RETURN_IF_ERROR(
        Exchange(headers, kHeaderSlotBase, deadline, header_send_seq_, header_recv_seq_));
    for (int peer = 0; peer < size_; ++peer) {
      if (!recvs_from[peer]) continue;
      if (got[peer].count != expected[peer].count || got[peer].hash != expected[peer].hash) {
        return InternalError(Describe() + ": send/recv: peer " + std::to_string(peer) + " sends " +
                             std::to_string(got[peer].count) + " messages, this rank receives " +
                             std::to_string(expected[peer].count) +
                             (got[peer].count == expected[peer].count ? " (sizes differ)" : ""));
      }
    }
    std::vector<Message> payload;
    payload.reserve(op.p2p.size());
    for (const P2POp& p : op.p2p) {
      payload.push_back({p.kind == P2POp::Kind::kSend, p.peer, p.data, p.bytes});
    }
    return Exchange(payload, kP2PSlotBase, deadline, send_seq_, recv_seq_);
  }

  const std::string name_;
  const int rank_;
  const int size_;
  const int64_t generation_;
  LogContext log_;
  std::shared_ptr<GlooDevice> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;

  std::mutex mu_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool stopping_ = false;
  bool running_ = false;
  Status error_;  // first error; every later op returns it
  std::atomic<bool> aborted_{false};
  std::atomic<bool> broken_{false};
  std::thread thread_;
  std::unique_ptr<gloo::transport::UnboundBuffer> sentinel_;
  std::vector<char> sentinel_bytes_;
  std::thread sentinel_thread_;
  std::atomic<bool> stopping_sentinel_{false};
  Status peer_lost_;  // under mu_
  std::vector<int> closed_peers_;  // under mu_: see NoteClosedPeersLocked
  gloo_algorithms::AbortableWaits waits_;  // what the running operation waits on (Abort wakes)
  std::chrono::steady_clock::time_point peer_lost_at_;

  // Used by the op thread only.
  gloo_algorithms::Workspace workspace_;
  std::unique_ptr<gloo_algorithms::Mailboxes> mailboxes_;  // null for size 1
  // Null unless every rank is on this host (and it is enabled). Set in Create, reset in
  // Shutdown; Fail()/Close() under mu_ from any thread, Run by the thread that runs ops.
  std::unique_ptr<ShmCollectives> shm_;
  uint64_t collective_seq_ = 0;
  std::vector<uint64_t> send_seq_ = std::vector<uint64_t>(size_, 0);
  std::vector<uint64_t> recv_seq_ = std::vector<uint64_t>(size_, 0);
  std::vector<uint64_t> header_send_seq_ = std::vector<uint64_t>(size_, 0);
  std::vector<uint64_t> header_recv_seq_ = std::vector<uint64_t>(size_, 0);
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_GLOO_COMMUNICATOR_IMPL_H_
