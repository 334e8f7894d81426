// The reductions the Gloo backend runs itself over Gloo's point-to-point messages (unbound
// buffers), instead of Gloo's collectives: they fix the reduction order (so results are
// bitwise reproducible and equal on every rank), keep f16/bf16 partial sums in f32, and take
// one round trip for small messages. Internal to collectives/ (not installed): only
// gloo_communicator.cc includes it. docs/collectives.md ("Reduction algorithms") describes
// the algorithms and the order each one reduces in.
//
// Every function is collective over the ranks of `ctx` (all call it with the same tag,
// count, type and op), runs on the calling thread, and returns OK, kAborted when a wait was
// aborted, or throws Gloo's exceptions (gloo::IoException on a closed connection or a
// timeout), which the caller maps to a Status.
#ifndef MORPH_COLLECTIVES_GLOO_ALGORITHMS_H_
#define MORPH_COLLECTIVES_GLOO_ALGORITHMS_H_

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "collectives/communicator.h"

namespace morph::gloo_algorithms {

// Scratch buffers kept by a communicator between operations, so that large reductions do not
// fault in fresh pages on every call (measured: a third of a 64 MiB bf16 allreduce). Used by
// one operation at a time; holds up to the largest operation's needs until destroyed.
class Workspace {
 public:
  // Buffer `i` (0..2) of at least `bytes`; its contents are unspecified.
  uint8_t* Get(int i, size_t bytes) {
    if (bufs_[i].size() < bytes) bufs_[i].resize(bytes);
    return bufs_[i].data();
  }

 private:
  std::vector<uint8_t> bufs_[3];
};

// The unbound buffers an operation is waiting on, so that Abort() from another thread wakes
// those waits whatever state Gloo left them in. Gloo's pair signal is not enough: a send whose
// write to a peer that just died failed with EPIPE is dropped by Gloo's event loop without a
// completion or an error, and its waitSend would sit until the operation's timeout (seen: a
// survivor's one-shot allreduce held 60 s after its runtime aborted it). Thread-safe.
class AbortableWaits {
 public:
  // Registers `b` (aborted at once when Abort() already ran) / forgets it.
  void Add(gloo::transport::UnboundBuffer* b);
  void Remove(gloo::transport::UnboundBuffer* b);
  // Wakes every registered buffer's waitSend/waitRecv with false, and every later one's.
  void Abort();

 private:
  std::mutex mu_;
  bool aborted_ = false;
  std::vector<gloo::transport::UnboundBuffer*> bufs_;
};

// The messages of one collective: unbound-buffer sends and receives on slots derived from
// the collective's tag and a step number, so that they never match another operation's.
class Messenger {
 public:
  // `waits` (may be null) is told of every buffer this posts, until WaitAll or destruction.
  Messenger(gloo::Context* ctx, Workspace* workspace, uint32_t tag, Deadline deadline,
            std::string what, AbortableWaits* waits = nullptr)
      : ctx_(ctx),
        workspace_(workspace),
        tag_(tag),
        deadline_(deadline),
        what_(std::move(what)),
        waits_(waits) {}
  ~Messenger() { Forget(); }
  Messenger(const Messenger&) = delete;
  Messenger& operator=(const Messenger&) = delete;
  Workspace& workspace() { return *workspace_; }
  Deadline deadline() const { return deadline_; }
  const std::string& what() const { return what_; }
  // Posts a receive / a send of `bytes` (none when 0). Buffers stay valid until WaitAll.
  void Recv(int peer, uint32_t step, void* data, size_t bytes);
  void Send(int peer, uint32_t step, const void* data, size_t bytes);
  // A send / a receive on an explicit slot (a Mailboxes round, a point-to-point sequence).
  void SendToSlot(int peer, uint64_t slot, const void* data, size_t bytes);
  void RecvFromSlot(int peer, uint64_t slot, void* data, size_t bytes);
  // Waits for everything posted (receives first). kAborted naming the peer if a wait was
  // aborted; Gloo's exception on an error or at the deadline.
  Status WaitAll();

 private:
  uint64_t Slot(uint32_t step) const;
  void Track(gloo::transport::UnboundBuffer* b);
  void Forget();  // unregisters (and then frees) everything posted
  struct Posted {
    std::unique_ptr<gloo::transport::UnboundBuffer> buf;
    bool send;
    int peer;
  };
  gloo::Context* ctx_;
  Workspace* workspace_;
  uint32_t tag_;
  Deadline deadline_;
  std::string what_;
  AbortableWaits* waits_;
  std::vector<Posted> posted_;
};

// Receives posted ahead of time, one per peer, for the one-round algorithms. Gloo sends an
// unbound buffer only once the receiver's "receive posted" notice has reached the sender, so
// a receive posted when the operation starts costs an extra message hop (two scheduler
// wake-ups). These are posted kDepth rounds ahead: at creation, then again as soon as a
// round's data has been consumed. kDepth 2 (back-to-back operations would not wait for the
// notice) showed no gain measurable on the shared test machine and doubles the memory, so it
// is 1. Rounds are counted per communicator (every rank runs the same one-round operations
// in the same order). Messages must fit `bytes`; memory: kDepth x size x bytes.
class Mailboxes {
 public:
  Mailboxes(gloo::Context* ctx, int rank, int size, size_t bytes);
  // Slot of the current round, for the senders.
  uint64_t slot() const;
  // Waits for every peer's message of the current round. kAborted naming the peer if a wait
  // was aborted; Gloo's exception on an error or at the deadline.
  Status WaitAll(Deadline deadline, const std::string& what);
  // Peer `peer`'s message of the current round (after WaitAll).
  const uint8_t* data(int peer) const;
  // Starts the next round: reposts the current round's receives for round + kDepth (the
  // current data must have been consumed).
  void Next();
  // Makes every wait on these receives, now and later, return kAborted (a receive caught in
  // the middle of its payload is not woken by Gloo's own pair signal). Any thread; the others
  // are the operation thread's.
  void Abort();

 private:
  static constexpr uint64_t kDepth = 1;
  static uint64_t SlotOf(uint64_t round);
  void Post(uint64_t round);
  gloo::Context* ctx_;
  int rank_;
  int size_;
  size_t bytes_;
  uint64_t round_ = 0;
  std::vector<uint8_t> storage_;
  std::mutex mu_;  // guards bufs_ (replaced by Post) and aborted_ against Abort
  bool aborted_ = false;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bufs_;  // [round % kDepth][peer]
};

// `pieces[p]` = rank p's contribution (count elements of `t`); `out` (may be one of the
// pieces: each block of all of them is read before that block of `out` is written) = their
// reduction in rank order, ((x0 op x1) op x2) ... op x(size-1), f16/bf16 in f32 rounded once.
// Runs in blocks of 8 KiB of accumulator (cache-resident). The one-round algorithms below and
// the shared-memory paths (shm_collectives.h, its staging path included) all reduce with it,
// so they agree bit for bit.
void ReduceInRankOrder(Workspace& ws, const std::vector<const uint8_t*>& pieces, size_t count,
                       DType t, ReduceOp op, void* out);

// In place over `count` elements of `buf`. Every rank sends its buffer to every other rank,
// then reduces the `size` contributions in rank order: ((x0 op x1) op x2) ... op x(size-1),
// f16/bf16 in f32 with one rounding at the end. (size - 1) x bytes per rank, one round.
// Receives into `mb` (count * element size must fit its mailboxes).
Status AllreduceOneShot(Messenger& m, Mailboxes& mb, int rank, int size, void* buf, size_t count,
                        DType dtype, ReduceOp op);

// In place over `count` elements of `buf`: a ring reduce-scatter (chunk c = elements
// [c*count/size, (c+1)*count/size), f16/bf16 partial sums travel as f32), then a ring
// allgather of the reduced chunks (in the buffer's type). Chunk c is reduced in ring order
// starting after c: ((x(c+1) op x(c+2)) op ...) op x(c), indices mod size.
Status AllreduceRing(Messenger& m, int rank, int size, void* buf, size_t count, DType dtype,
                     ReduceOp op);

// `in` holds size x count elements, `out` receives this rank's count: piece `rank` of the
// reduction. Direct: every rank sends piece p to rank p, which reduces in rank order (one
// round). Ring: size - 1 steps, piece c reduced in ring order starting after c (as above).
// Both send (size - 1) x count elements per rank (f16/bf16: the ring sends f32 partials,
// twice the bytes); f16/bf16 reduce in f32 and round once.
Status ReduceScatterDirect(Messenger& m, Mailboxes& mb, int rank, int size, const void* in,
                           void* out, size_t count, DType dtype, ReduceOp op);
Status ReduceScatterRing(Messenger& m, int rank, int size, const void* in, void* out, size_t count,
                         DType dtype, ReduceOp op);

}  // namespace morph::gloo_algorithms

#endif  // MORPH_COLLECTIVES_GLOO_ALGORITHMS_H_
