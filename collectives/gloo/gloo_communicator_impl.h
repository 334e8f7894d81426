// GlooCommunicator::Impl and GlooDevice::Impl (gloo_communicator.h), not installed. Defined
// by meaning: the op thread, peer-loss detection and abort in gloo_op_thread.cc; the
// collective bodies in gloo_collectives.cc; construction and the public calls in
// gloo_communicator.cc.
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
#include "collectives/gloo/gloo_algorithms.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/gloo/gloo_support.h"
#include "collectives/op_signature.h"
#include "collectives/shm/shm_collectives.h"

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
  void Shutdown();

  void StartThreads();

  // Gloo wakes a wait only when the pair it waits on fails. A rank blocked on a healthy pair
  // while another of its pairs died (e.g. its writes to a dead peer got EPIPE, which Gloo's
  // event loop never reports) would sit until its timeout. The sentinel is a receive posted
  // on every pair and never matched: when any pair closes, Gloo wakes it. A peer that simply
  // destroyed its communicator after the last operation looks the same, so the loss only
  // fails an operation that is still unfinished kPeerLossGrace later (GlooWork::Wait).
  void Sentinel();

  // The sentinel's status once a peer has been gone for longer than the grace period.
  Status PeerLossPastGrace();

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

  void Abort(std::string_view why);

  // Fails the communicator with `error` (unless it already failed) and wakes everything.
  void FailWith(const Status& error);

  void AbortLocked(std::string_view why);

  // Remembers which peers' connections had failed when this rank first noticed a failure,
  // before its own reaction (SignalAllPairs) closes its other pairs and theirs.
  void NoteClosedPeersLocked();

  // `s` with its typed CollectiveFailure: the kind follows the code (the code was chosen by
  // ClassifyGlooError); the peers are those noted by NoteClosedPeersLocked.
  Status WithFailureLocked(const Status& s);

  // Breaks every pair (and leaves the shared-memory segment) so that waits wake now and peers
  // see the connection close.
  void SignalAllPairs(const std::string& msg);

  std::string Describe() const {
    return "gloo communicator '" + name_ + "' generation " + std::to_string(generation_) +
           " rank " + std::to_string(rank_) + "/" + std::to_string(size_);
  }

  // Runs on the thread: executes tasks in order.
  void Loop();

  // Whether `op` may run on its caller's thread: collectives whose messages are all small
  // (kOneShotMaxBytes), so that a wait can hardly be caught in the middle of a payload, which
  // Gloo's own pair signal does not wake (docs/collectives.md, "Small-message latency"; ours,
  // gloo_support::PairAccess::Signal, now does); larger ones and send/recv groups keep the op
  // thread, whose Wait notices an abort or a lost peer whatever Gloo does.
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
    const bool shm = shm_ != nullptr && (op.kind == CollectiveOp::Kind::kSendRecv
                                             ? shm_->HandlesP2P()
                                             : shm_->Handles(op));
    if (!SmallEnoughToRunInline(op) && !shm) return std::nullopt;
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
      if (!shm) no_sigpipe.emplace();
      s = RunOne(op);
    }
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    return s;
  }

  // One operation on the thread that runs it (the op thread, or the caller's: TryRunInline).
  // Fails the communicator on its first error.
  Status RunOne(const CollectiveOp& op);

  Status Execute(const CollectiveOp& op);

  // Over TCP: every rank's OpSignature of its collective (op_signature.h), gathered before any
  // byte of it moves; ranks whose calls differ all get kInvalidArgument naming both, and
  // nothing else happens. The shared-memory path compares them in the operation itself.
  Status CheckAgreement(const CollectiveOp& op);
  uint32_t NextTag() { return static_cast<uint32_t>(++collective_seq_ & 0x7fffffff); }

  Status MapIoError(const CollectiveOp& op, std::string_view what);

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

  Status ExecuteOrThrow(const CollectiveOp& op, uint32_t tag);

  Status Allgather(const void* send, void* recv, size_t bytes, std::chrono::milliseconds timeout,
                   uint32_t tag);

  // Up to kOneShotMaxBytes: one round, rank order (gloo_algorithms.h). Larger f16/bf16: our
  // ring with f32 partial sums (Gloo has no 16-bit float reduction). Larger other types:
  // Gloo's pipelined ring, measured 1.5-2x faster than ours at 64 MiB; its reduction order
  // is its own, the same on every rank and in every run.
  Status AllreduceInPlace(void* buf, size_t count, DType dtype, ReduceOp reduce,
                          std::chrono::milliseconds timeout, uint32_t tag);

  // Posts one unbound buffer per message (receives first) and waits for all of them.
  struct Message {
    bool send;
    int peer;
    void* data;
    size_t bytes;
  };
  Status Exchange(const std::vector<Message>& messages, uint64_t slot_base, Deadline deadline,
                  std::vector<uint64_t>& send_seq, std::vector<uint64_t>& recv_seq);

  // Two phases. First every pair that exchanges messages in this group compares the number
  // of messages and a hash of their sizes (one 16-byte message per direction), because Gloo
  // cannot survive a message larger than the receive posted for it (its event thread throws).
  // Then the payloads move.
  Status SendRecv(const CollectiveOp& op);

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
  Status peer_lost_;                       // under mu_
  std::vector<int> closed_peers_;          // under mu_: see NoteClosedPeersLocked
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
