// Communicator: the collective and point-to-point operations training code and the reshard
// executor run between the ranks of one group, for one generation (a Step hands out the
// generation's: world, dp, tp, pp). Part of the public API (<morph/morph.h>). Backends: Gloo (CPU, TCP;
// gloo_communicator.h) and NCCL (CUDA; nccl_communicator.h).
//
//   std::unique_ptr<Communicator> comm = ...;            // from a backend or GroupBuilder
//   MORPH_RETURN_IF_ERROR(comm->Allreduce(grad, n, DType::kF32, ReduceOp::kSum,
//                                         std::chrono::seconds(30)));
//   MORPH_ASSIGN_OR_RETURN(auto work, comm->Start(CollectiveOp::Broadcast(buf, n, dt, 0, t)));
//   ...                                                   // overlap
//   MORPH_RETURN_IF_ERROR(work->Wait(Deadline::AfterMs(30000)));
//
// Contracts, for every backend:
// - Every rank of the group issues the same collectives in the same order (as with MPI/NCCL).
// - Every call returns a Status and is bounded by its own timeout: kDeadlineExceeded when it
//   passes, kUnavailable when a peer failed (closed its connection, NCCL remote error),
//   kAborted after Abort(), kInvalidArgument for bad arguments (checked before anything is
//   sent, so no peer is left waiting for this rank's data). Failures carry a typed
//   CollectiveFailure (status.collective_failure(), status.failed_peers(): morph/status.h):
//   the kind and the peers this rank saw fail, where the backend knows them.
// - After any non-OK result other than kInvalidArgument the communicator is broken: every
//   later call returns the same error. Build the next generation's communicator instead.
// - Abort() may be called from any thread, any time: the operation in progress (and every
//   later one) returns kAborted within a second.
// - Buffers must stay valid until the operation's Wait returned (also after an error).
#ifndef MORPH_COMMUNICATOR_H_
#define MORPH_COMMUNICATOR_H_

#include "morph/api.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "morph/deadline.h"
#include "morph/dtype.h"
#include "morph/status.h"

namespace morph {

enum class ReduceOp : uint8_t { kSum, kMax, kMin };

// Why a communicator is shrunk (Communicator::Shrink). kPlanned: the leavers left cleanly and
// this communicator is healthy (NCCL_SHRINK_DEFAULT). kFailure: ranks died; operations in
// flight are aborted first (NCCL_SHRINK_ABORT).
enum class ShrinkMode : uint8_t { kPlanned, kFailure };

// The default timeout of a collective (5 minutes: a first step, a checkpoint barrier or a slow
// joiner can take long; a failed peer is noticed sooner through its closed connection).
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{300000};

MORPH_API std::string_view ReduceOpName(ReduceOp op);     // "sum", "max", "min"

// What a backend supports, so callers decide before calling rather than on a failure.
struct MORPH_API Capabilities {
  std::string backend;          // "gloo", "nccl"
  bool host_memory = false;     // buffers in host memory
  bool device_memory = false;   // buffers in CUDA device memory
  bool point_to_point = false;  // kSendRecv groups
  bool shrink = false;          // Shrink() without a new rendezvous
  bool split = false;           // Split() into subgroups without a new rendezvous
  // Element types allreduce/reduce-scatter accept. On Gloo f16/bf16 are reduced in f32 in a
  // fixed order and rounded once, so results are identical on every rank; partial sums travel
  // as f32 (twice the bytes, not world-size times; docs/collectives.md).
  std::vector<DType> reduce_types;
  std::vector<ReduceOp> reduce_ops;
};

// One side of a point-to-point exchange.
struct MORPH_API P2POp {
  enum class Kind : uint8_t { kSend, kRecv };
  Kind kind;
  int peer;
  void* data;  // a send only reads it
  size_t bytes;
};

// An operation handed to Communicator::Start. Use the named constructors.
struct MORPH_API CollectiveOp {
  enum class Kind : uint8_t {
    kAllreduce,
    kBroadcast,
    kAllgather,
    kReduceScatter,
    kBarrier,
    kSendRecv
  };
  Kind kind = Kind::kBarrier;
  const void* send = nullptr;  // allgather / reduce-scatter input
  void* recv = nullptr;        // in-place buffer of allreduce / broadcast; output otherwise
  // Elements: of the buffer (allreduce, broadcast), of each rank's piece (allgather input,
  // reduce-scatter output). Allgather output and reduce-scatter input hold count * size.
  size_t count = 0;
  DType dtype = DType::kU8;
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  std::vector<P2POp> p2p;
  // The one default: equal to MORPH_COLLECTIVE_TIMEOUT_MS's default (communicator_test checks).
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  // A cudaStream_t for backends with device memory: the operation is enqueued on it, after the
  // work already there (e.g. the backward pass that produced the gradients), and Wait waits
  // for it only, so other streams' compute overlaps it. Null: the communicator's own stream
  // (the caller must then have finished writing the buffers). Host-memory backends refuse a
  // non-null stream (kInvalidArgument).
  void* stream = nullptr;

  static CollectiveOp Allreduce(void* buf, size_t count, DType dtype, ReduceOp op,
                                std::chrono::milliseconds timeout);
  static CollectiveOp Broadcast(void* buf, size_t count, DType dtype, int root,
                                std::chrono::milliseconds timeout);
  static CollectiveOp Allgather(const void* send, void* recv, size_t count, DType dtype,
                                std::chrono::milliseconds timeout);
  static CollectiveOp ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                                    ReduceOp op, std::chrono::milliseconds timeout);
  static CollectiveOp Barrier(std::chrono::milliseconds timeout);
  // Sends and receives that progress together. Between a pair of ranks, the i-th send from a
  // to b matches b's i-th receive from a (across groups too); sizes must agree.
  static CollectiveOp SendRecv(std::vector<P2POp> ops, std::chrono::milliseconds timeout);
};

// A started operation.
class MORPH_API Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation finished (its Status), `deadline` passed (kDeadlineExceeded;
  // the communicator is then aborted, since the peers are out of step), or the communicator
  // was aborted (kAborted); kFailedPrecondition if the communicator was destroyed first.
  // When it returns, the backend no longer touches the buffers. Returns the same Status
  // when called again. Only the thread that started the operation calls Wait.
  virtual Status Wait(Deadline deadline) = 0;
  // True once Wait would not block. On NCCL only once no kernel can touch the buffers any more
  // (the op's event completed, or the communicator was stopped and has drained). Any thread.
  virtual bool Done() const = 0;
};

class MORPH_API Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int64_t generation() const = 0;
  virtual Capabilities capabilities() const = 0;

  // Starts `op` after the operations started before it (FIFO). kInvalidArgument (nothing
  // started) for a null buffer with a non-zero count, a root or peer out of range, a type or
  // reduction the backend does not support (see capabilities()); the communicator's error if
  // it is broken. Only one thread at a time calls Start (the one that owns the communicator).
  virtual StatusOr<std::unique_ptr<Work>> Start(CollectiveOp op) = 0;

  // Collective over this communicator: ranks passing the same `color` form a new
  // communicator named `name`, ordered by `key`; color < 0 opts out (returns null). Only
  // where capabilities().split (NCCL: ncclCommSplit); elsewhere kUnimplemented. Owning thread.
  virtual StatusOr<std::unique_ptr<Communicator>> Split(int color, int key, std::string name,
                                                        Deadline deadline);

  // Survivors only, collectively (every rank of this communicator not in `exclude`): a new
  // communicator without the `exclude`d ranks (numbered in this one), over the existing
  // connections, with no rendezvous; survivors keep their order (new rank = old rank minus
  // the excluded ranks below it), and the new one belongs to `generation`. This communicator
  // is released afterwards (later calls: kFailedPrecondition). kInvalidArgument for an empty
  // `exclude`, a rank out of range or this rank excluded; kFailedPrecondition for kPlanned on
  // a broken communicator; the backend's errors (kDeadlineExceeded at the deadline). Only
  // where capabilities().shrink (NCCL: ncclCommShrink); elsewhere kUnimplemented. Owning
  // thread.
  virtual StatusOr<std::unique_ptr<Communicator>> Shrink(std::span<const int> exclude,
                                                         ShrinkMode mode, int64_t generation,
                                                         Deadline deadline);

  // Makes the operation in progress and every later one return kAborted within a second.
  // Any thread, any number of times; never blocks on the network.
  virtual void Abort() = 0;
  // True after Abort() or after an operation failed.
  virtual bool broken() const = 0;

  // Blocking forms: Start(op) then Wait(now + op.timeout), or what a backend does instead with
  // the same result (Gloo runs it on the calling thread). Owning thread.
  virtual Status Run(CollectiveOp op);
  Status Allreduce(void* buf, size_t count, DType dtype, ReduceOp op,
                   std::chrono::milliseconds timeout) {
    return Run(CollectiveOp::Allreduce(buf, count, dtype, op, timeout));
  }
  Status Broadcast(void* buf, size_t count, DType dtype, int root,
                   std::chrono::milliseconds timeout) {
    return Run(CollectiveOp::Broadcast(buf, count, dtype, root, timeout));
  }
  Status Allgather(const void* send, void* recv, size_t count, DType dtype,
                   std::chrono::milliseconds timeout) {
    return Run(CollectiveOp::Allgather(send, recv, count, dtype, timeout));
  }
  Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                       std::chrono::milliseconds timeout) {
    return Run(CollectiveOp::ReduceScatter(send, recv, count, dtype, op, timeout));
  }
  Status Barrier(std::chrono::milliseconds timeout) { return Run(CollectiveOp::Barrier(timeout)); }
  Status SendRecv(std::vector<P2POp> ops, std::chrono::milliseconds timeout) {
    return Run(CollectiveOp::SendRecv(std::move(ops), timeout));
  }

 protected:
  // The argument checks every backend shares: kInvalidArgument naming the field.
  Status ValidateOp(const CollectiveOp& op, const Capabilities& caps) const;
};

}  // namespace morph

#endif  // MORPH_COMMUNICATOR_H_
