#include "reshard/inproc_transport.h"

#include <glog/logging.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "reshard/strided_copy.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace morph {

namespace {

// kPending: posted, queued for its counterpart. kMatched: paired with `partner`, waiting for
// one of the two owners' threads (in Wait) to copy. kCopying: being copied. kDone: `result`.
enum class OpState { kPending, kMatched, kCopying, kDone };

struct Group;

struct Op {
  Group* group = nullptr;
  int owner = 0;
  int peer = 0;
  bool is_send = false;
  char* data = nullptr;
  size_t bytes = 0;
  uint64_t tag = 0;
  // A strided op's layout, converted to bytes (elem_size 1): the message is bytes
  // [begin, begin + bytes) of `geom`'s source side (send) or destination side (receive).
  bool strided = false;
  CopyGeometry geom;
  int64_t begin = 0;
  OpState state = OpState::kPending;
  Op* partner = nullptr;
  Status result;
};

std::string Hex(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Moves the message of a matched host pair in one pass, whichever side is strided.
void CopyHost(const Op& send, const Op& recv) {
  const int64_t n = static_cast<int64_t>(send.bytes);
  if (!send.strided && !recv.strided) {
    BulkCopy(recv.data, send.data, send.bytes);
  } else if (!recv.strided) {  // gather: strided source -> contiguous destination
    CopyGeometry g = WithDenseDestination(send.geom);
    g.dst_offset = -send.begin;
    HostStridedCopy(g, recv.data, send.data, 1, send.begin, send.begin + n);
  } else if (!send.strided) {  // scatter: contiguous source -> strided destination
    CopyGeometry g = WithDenseSource(recv.geom);
    g.src_offset = -recv.begin;
    HostStridedCopy(g, recv.data, send.data, 1, recv.begin, recv.begin + n);
  } else {
    HostStridedTransfer(recv.geom, recv.data, recv.begin, send.geom, send.data, send.begin, 1, n);
  }
}

// `layout` in byte units (elem_size 1), so that layouts of different element sizes combine.
CopyGeometry InBytes(const CopyGeometry& g, int64_t es) {
  CopyGeometry b = g;
  for (int k = 0; k < g.outer_rank; ++k) {
    b.dst_stride[k] *= es;
    b.src_stride[k] *= es;
  }
  b.row *= es;
  b.dst_offset *= es;
  b.src_offset *= es;
  b.num_elements *= es;
  return b;
}

struct Group {
  int owner = 0;
  std::vector<std::unique_ptr<Op>> ops;
  bool finished = false;  // Wait returned or the work was destroyed
};

}  // namespace

struct InProcHub::State {
  explicit State(int n, bool dev)
      : size(n),
        device_memory(dev),
        ranks(static_cast<size_t>(n)),
        queues(static_cast<size_t>(n) * static_cast<size_t>(n)) {}

  struct RankState {
    bool closed = false;
    bool aborted = false;
    bool dead = false;
  };
  // Unmatched ops of one ordered pair (src -> dst), in posting order.
  struct PairQueue {
    std::deque<Op*> sends;
    std::deque<Op*> recvs;
  };

  const int size;
  const bool device_memory;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<RankState> ranks;
  std::vector<PairQueue> queues;
  int64_t fail_after_bytes = -1;
  int64_t delivered = 0;

  PairQueue& Pair(int src, int dst) {
    return queues[static_cast<size_t>(src) * static_cast<size_t>(size) + static_cast<size_t>(dst)];
  }
  RankState& Rank(int r) { return ranks[static_cast<size_t>(r)]; }

  // Why rank `r` cannot take part in a transfer any more, from a peer's point of view.
  std::optional<Status> PeerGone(int r) {
    const RankState& s = Rank(r);
    if (s.dead) return UnavailableError("peer " + std::to_string(r) + " is gone (killed)");
    if (s.aborted) return UnavailableError("peer " + std::to_string(r) + " aborted");
    if (s.closed) return UnavailableError("peer " + std::to_string(r) + " closed its transport");
    return std::nullopt;
  }

  static void Finish(Op* op, Status s) {
    op->state = OpState::kDone;
    op->result = std::move(s);
  }

  // Pairs `send` and `recv` (both pending, same pair). The copy is left to whichever owner's
  // thread gets to it first in Wait, so copies spread over the ranks' threads the way a real
  // transport's progress runs beside the caller.
  void Match(Op* send, Op* recv) {
    if (send->bytes != recv->bytes) {
      const std::string msg = "size mismatch: rank " + std::to_string(send->owner) + " sends " +
                              std::to_string(send->bytes) + " bytes to rank " +
                              std::to_string(recv->owner) + ", which expects " +
                              std::to_string(recv->bytes);
      Finish(send, InternalError(msg));
      Finish(recv, InternalError(msg));
    } else if (send->tag != recv->tag) {
      const std::string msg = "message tag mismatch: rank " + std::to_string(send->owner) +
                              " sends a message tagged " + Hex(send->tag) + " to rank " +
                              std::to_string(recv->owner) + ", whose receive is tagged " +
                              Hex(recv->tag) + " (the two sides run different plans or steps)";
      Finish(send, FailedPreconditionError(msg));
      Finish(recv, FailedPreconditionError(msg));
    } else {
      send->state = OpState::kMatched;
      recv->state = OpState::kMatched;
      send->partner = recv;
      recv->partner = send;
    }
    cv.notify_all();
  }

  // Copies the matched pair of `op` (called by one of its owners); releases `lock` meanwhile.
  void Copy(Op* op, std::unique_lock<std::mutex>& lock) {
    Op* send = op->is_send ? op : op->partner;
    Op* recv = op->is_send ? op->partner : op;
    for (Op* o : {send, recv}) {
      if (auto gone = PeerGone(o->owner)) {
        Finish(send == o ? recv : send, *gone);
        Finish(o, AbortedError("rank " + std::to_string(o->owner) + " is no longer usable"));
        cv.notify_all();
        return;
      }
    }
    if (fail_after_bytes >= 0 && delivered + static_cast<int64_t>(send->bytes) > fail_after_bytes) {
      const std::string msg = "injected fault: transport fails after " +
                              std::to_string(fail_after_bytes) + " bytes (transfer " +
                              std::to_string(send->owner) + "->" + std::to_string(recv->owner) +
                              " of " + std::to_string(send->bytes) + " bytes)";
      Finish(send, UnavailableError(msg));
      Finish(recv, UnavailableError(msg));
      cv.notify_all();
      return;
    }
    delivered += static_cast<int64_t>(send->bytes);
    send->state = OpState::kCopying;
    recv->state = OpState::kCopying;
    lock.unlock();
    Status copied;
    if (send->bytes > 0) {
#if MORPH_WITH_CUDA
      if (device_memory) {
        cudaError_t e = cudaMemcpy(recv->data, send->data, send->bytes, cudaMemcpyDefault);
        if (e != cudaSuccess) {
          copied = InternalError(std::string("cudaMemcpy in the in-process transport: ") +
                                 cudaGetErrorString(e));
        }
      } else {
        CopyHost(*send, *recv);
      }
#else
      CopyHost(*send, *recv);
#endif
    }
    lock.lock();
    Finish(send, copied);
    Finish(recv, copied);
    cv.notify_all();
  }

  // Posts one op of rank `owner`; matches it if its counterpart is waiting.
  void Post(Op* op) {
    if (auto gone = PeerGone(op->peer)) {
      Finish(op, *gone);
      return;
    }
    PairQueue& q = op->is_send ? Pair(op->owner, op->peer) : Pair(op->peer, op->owner);
    std::deque<Op*>& other = op->is_send ? q.recvs : q.sends;
    if (!other.empty()) {
      Op* counterpart = other.front();
      other.pop_front();
      if (op->is_send) {
        Match(op, counterpart);
      } else {
        Match(counterpart, op);
      }
      return;
    }
    (op->is_send ? q.sends : q.recvs).push_back(op);
  }

  // Withdraws every pending op of `group` from the queues and waits until none of its ops is
  // being copied, so that the caller may release the group's buffers.
  void Withdraw(Group* group, std::unique_lock<std::mutex>& lock) {
    for (auto& op : group->ops) {
      if (op->state == OpState::kMatched) {
        Finish(op->partner, UnavailableError("peer " + std::to_string(op->owner) +
                                             " withdrew from the exchange"));
        Finish(op.get(), AbortedError("withdrawn"));
        continue;
      }
      // A queued op may already be done (failed because its peer is gone): unqueue it too, so
      // no queue ever points into a destroyed group.
      PairQueue& q = op->is_send ? Pair(op->owner, op->peer) : Pair(op->peer, op->owner);
      std::deque<Op*>& mine = op->is_send ? q.sends : q.recvs;
      for (auto it = mine.begin(); it != mine.end(); ++it) {
        if (*it == op.get()) {
          mine.erase(it);
          break;
        }
      }
      if (op->state == OpState::kPending) Finish(op.get(), AbortedError("withdrawn"));
    }
    cv.wait(lock, [&] {
      for (auto& op : group->ops) {
        if (op->state == OpState::kCopying) return false;
      }
      return true;
    });
  }

  // Marks rank `r` closed: peers stop matching with it. Its queued ops (other groups) are
  // withdrawn when their own works finish.
  void CloseRank(int r) {
    Rank(r).closed = true;
    for (int p = 0; p < size; ++p) {
      for (PairQueue* q : {&Pair(r, p), &Pair(p, r)}) {
        for (std::deque<Op*>* d : {&q->sends, &q->recvs}) {
          for (Op* op : *d) {
            if (op->owner == r) continue;
            Finish(op, UnavailableError("peer " + std::to_string(r) + " closed its transport"));
          }
          // Ops of the peer stay queued but are done; drop them so they never match.
          std::erase_if(*d, [r](Op* op) { return op->owner != r; });
        }
      }
    }
    cv.notify_all();
  }
};

namespace {

class InProcWork final : public TransportWork {
 public:
  InProcWork(std::shared_ptr<InProcHub::State> state, std::unique_ptr<Group> group)
      : state_(std::move(state)), group_(std::move(group)) {}

  ~InProcWork() override {
    std::unique_lock<std::mutex> lock(state_->mu);
    if (group_->finished) return;
    // Destroyed without a successful Wait: in-order matching is broken for this rank. Closed
    // first: Withdraw may wait (releasing the lock) for a copy in flight, and meanwhile a peer
    // must not match this rank's ops of later groups against what this group withdrew.
    state_->CloseRank(group_->owner);
    state_->Withdraw(group_.get(), lock);
    group_->finished = true;
  }

  Status Wait(Deadline deadline) override {
    auto& s = *state_;
    std::unique_lock<std::mutex> lock(s.mu);
    if (group_->finished) return FailedPreconditionError("Wait called twice on one transport work");
    const int r = group_->owner;
    Status err;
    while (true) {
      const auto& me = s.Rank(r);
      if (me.dead) {
        err = AbortedError("rank " + std::to_string(r) + " was killed");
        break;
      }
      if (me.aborted) {
        err = AbortedError("transport of rank " + std::to_string(r) + " was aborted");
        break;
      }
      if (me.closed) {
        err = AbortedError("transport of rank " + std::to_string(r) +
                           " was closed after an earlier failure");
        break;
      }
      bool all_done = true;
      bool copied = false;
      for (auto& op : group_->ops) {
        if (op->state == OpState::kPending) {
          if (auto gone = s.PeerGone(op->peer)) InProcHub::State::Finish(op.get(), *gone);
        }
        if (op->state == OpState::kMatched) {
          s.Copy(op.get(), lock);  // releases the lock while copying: rescan afterwards
          copied = true;
          break;
        }
        if (op->state == OpState::kDone && !op->result.ok()) {
          err = op->result.WithContext(std::string(op->is_send ? "send to " : "receive from ") +
                                       "rank " + std::to_string(op->peer));
          break;
        }
        if (op->state != OpState::kDone) all_done = false;
      }
      if (!err.ok()) break;
      if (copied) continue;
      if (all_done) {
        group_->finished = true;
        return Status();
      }
      if (deadline.Expired()) {
        err = DeadlineExceededError("rank " + std::to_string(r) +
                                    ": transport group not complete by its deadline");
        break;
      }
      // Bounded waits so that a missed notification can never turn into a hang.
      auto until =
          std::min(deadline.when(), Deadline::Clock::now() + std::chrono::milliseconds(100));
      s.cv.wait_until(lock, until);
    }
    // Closed before the withdrawal (see the destructor): a peer posting while Withdraw waits
    // for a copy in flight would otherwise match this rank's next queued op in place of one
    // this group withdrew (a tag mismatch, 1 run in ~50 of executor_test's FailureTest).
    s.CloseRank(r);
    s.Withdraw(group_.get(), lock);
    group_->finished = true;
    return err;
  }

 private:
  std::shared_ptr<InProcHub::State> state_;
  std::unique_ptr<Group> group_;
};

}  // namespace

InProcHub::InProcHub(int size, bool device_memory)
    : state_(std::make_shared<State>(size, device_memory)) {
  CHECK_GT(size, 0);
#if !MORPH_WITH_CUDA
  CHECK(!device_memory) << "InProcHub with device memory needs a CUDA build";
#endif
}
InProcHub::~InProcHub() = default;
int InProcHub::size() const { return state_->size; }
bool InProcHub::device_memory() const { return state_->device_memory; }

void InProcHub::AbortAll() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& r : state_->ranks) r.aborted = true;
  state_->cv.notify_all();
}

void InProcHub::InjectFailAfterBytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->fail_after_bytes = bytes;
  state_->cv.notify_all();
}

void InProcHub::KillRank(int rank) {
  std::lock_guard<std::mutex> lock(state_->mu);
  CHECK(rank >= 0 && rank < state_->size);
  state_->Rank(rank).dead = true;
  state_->cv.notify_all();
}

int64_t InProcHub::bytes_delivered() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->delivered;
}

InProcTransport::InProcTransport(std::shared_ptr<InProcHub> hub, int rank)
    : hub_(std::move(hub)), rank_(rank) {
  CHECK(hub_ != nullptr);
  CHECK(rank >= 0 && rank < hub_->size()) << "rank " << rank << " of " << hub_->size();
}

InProcTransport::~InProcTransport() {
  auto& s = *hub_->state_;
  std::lock_guard<std::mutex> lock(s.mu);
  s.CloseRank(rank_);
}

int InProcTransport::size() const { return hub_->size(); }
bool InProcTransport::SupportsDeviceMemory() const { return hub_->device_memory(); }
bool InProcTransport::SupportsStridedOps() const { return !hub_->device_memory(); }

StatusOr<std::unique_ptr<TransportWork>> InProcTransport::Start(std::span<const SendOp> sends,
                                                                std::span<const RecvOp> recvs) {
  auto& s = *hub_->state_;
  auto group = std::make_unique<Group>();
  group->owner = rank_;
  auto add = [&](bool is_send, int peer, const void* data, size_t bytes,
                 const StridedLayout* layout, uint64_t tag) -> Status {
    if (peer < 0 || peer >= s.size || peer == rank_) {
      return InvalidArgumentError(std::string(is_send ? "send to" : "receive from") + " peer " +
                                  std::to_string(peer) + " from rank " + std::to_string(rank_) +
                                  " of " + std::to_string(s.size));
    }
    if (data == nullptr && bytes > 0) {
      return InvalidArgumentError("null buffer of " + std::to_string(bytes) + " bytes for peer " +
                                  std::to_string(peer));
    }
    auto op = std::make_unique<Op>();
    op->group = group.get();
    op->owner = rank_;
    op->peer = peer;
    op->is_send = is_send;
    op->data = static_cast<char*>(const_cast<void*>(data));
    op->bytes = bytes;
    op->tag = tag;
    if (layout != nullptr) {
      const std::string what = std::string(is_send ? "strided send to" : "strided receive from") +
                               " peer " + std::to_string(peer) + ": ";
      if (!SupportsStridedOps()) {
        return InvalidArgumentError(what +
                                    "this transport moves device memory, which it only "
                                    "does contiguously (SupportsStridedOps() is false)");
      }
      const CopyGeometry* g = layout->geometry;
      if (g == nullptr || layout->elem_size <= 0 || layout->begin < 0 ||
          layout->end < layout->begin || layout->end > g->num_elements || g->outer_rank < 0 ||
          g->outer_rank > kMaxCopyDims || g->row <= 0) {
        return InvalidArgumentError(what + "malformed layout");
      }
      if (static_cast<uint64_t>(layout->end - layout->begin) *
              static_cast<uint64_t>(layout->elem_size) !=
          bytes) {
        return InvalidArgumentError(what + "layout holds " +
                                    std::to_string(layout->end - layout->begin) + " elements of " +
                                    std::to_string(layout->elem_size) + " bytes, op says " +
                                    std::to_string(bytes) + " bytes");
      }
      op->strided = true;
      op->geom = InBytes(*g, layout->elem_size);
      op->begin = layout->begin * layout->elem_size;
    }
    group->ops.push_back(std::move(op));
    return Status();
  };
  for (const SendOp& op : sends) {
    MORPH_RETURN_IF_ERROR(add(true, op.peer, op.data, op.bytes, op.strided, op.tag));
  }
  for (const RecvOp& op : recvs) {
    MORPH_RETURN_IF_ERROR(add(false, op.peer, op.data, op.bytes, op.strided, op.tag));
  }

  std::unique_lock<std::mutex> lock(s.mu);
  const auto& me = s.Rank(rank_);
  if (me.dead || me.aborted || me.closed) {
    return FailedPreconditionError("transport of rank " + std::to_string(rank_) + " is " +
                                   (me.dead      ? "dead"
                                    : me.aborted ? "aborted"
                                                 : "closed") +
                                   " after an earlier failure");
  }
  for (auto& op : group->ops) s.Post(op.get());
  return std::unique_ptr<TransportWork>(new InProcWork(hub_->state_, std::move(group)));
}

void InProcTransport::Abort() {
  auto& s = *hub_->state_;
  std::lock_guard<std::mutex> lock(s.mu);
  s.Rank(rank_).aborted = true;
  s.cv.notify_all();
}

}  // namespace morph
