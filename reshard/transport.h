// Transport: the one thing the reshard executor needs from a communication library — grouped,
// concurrent point-to-point sends and receives of contiguous buffers.
//
// Ranks of a transport are the participant numbers of a reconfiguration: the runtime numbers
// every worker that takes part (old members, joiners, leavers) 0..n-1 and hands the same
// numbering to the planner and to the transport, so a Transfer's src/dst are transport ranks.
//
// collectives/ implements it on a Communicator (Gloo, NCCL); reshard/ has an in-process one
// (ranks as threads) for tests and benchmarks.
//
//   std::vector<SendOp> sends{{/*peer=*/2, buf, n}};
//   std::vector<RecvOp> recvs{{/*peer=*/1, dst, m}};
//   MORPH_ASSIGN_OR_RETURN(auto work, transport.Start(sends, recvs));
//   MORPH_RETURN_IF_ERROR(work->Wait(Deadline::AfterMs(30000)));
#ifndef MORPH_RESHARD_TRANSPORT_H_
#define MORPH_RESHARD_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "morph/deadline.h"
#include "morph/status.h"
#include "reshard/buffer.h"

namespace morph {

struct CopyGeometry;  // reshard/strided_copy.h

// Where the bytes of a strided message lie in its buffer: elements [begin, end) (row-major
// linear index over the box) of one side of `geometry`, `elem_size` bytes each. A SendOp reads
// the message from the geometry's source side (src_offset, src_stride, row) of its `data`; a
// RecvOp writes it to the destination side (dst_offset, dst_stride, row) of its `data`. Byte k of
// the message is byte k % elem_size of element begin + k / elem_size.
//
// Contract:
//   - only a transport whose SupportsStridedOps() is true may be given ops with a layout; any
//     other transport returns kInvalidArgument from Start for such an op;
//   - either side of a pair may use a layout independently of the other (a strided send may
//     match a contiguous receive and vice versa): the layout describes only this side's memory;
//   - `bytes` is still the message size, (end - begin) * elem_size (kInvalidArgument otherwise),
//     and matching and size checks are on `bytes` only;
//   - Start reads the layout and the geometry and keeps a copy; only `data` (every element the
//     layout names) must stay valid until Wait returns;
//   - host memory only.
struct StridedLayout {
  const CopyGeometry* geometry = nullptr;
  int elem_size = 1;
  int64_t begin = 0;
  int64_t end = 0;
};

// Message identity (tags). Every op carries a 64-bit tag; the executor derives it from the plan
// digest, the pair and the message index (so a message from another plan, another reshard or
// another position fails instead of landing in the wrong place). Contract for every transport:
//   - a send and the receive it matches (by pair and posting order, see Start) must carry equal
//     tags; if they do not, the group fails on the receiving side (and on the sending side where
//     the transport can tell) with kFailedPrecondition naming both tags and the pair, and the
//     received bytes must be treated as garbage (the receiver's Wait does not return OK);
//   - a transport checks tags with its own bookkeeping (InProcTransport compares them when it
//     matches the pair; CommTransport sends the tags of each group ahead of its payload, one
//     16-byte message per direction and peer, and checks them before Wait returns OK);
//   - 0 is an ordinary tag (ops of callers that do not tag match each other).
struct SendOp {
  int peer;
  const void* data;
  size_t bytes;
  // Null: the message is the contiguous `bytes` at `data`.
  const StridedLayout* strided = nullptr;
  uint64_t tag = 0;
};

struct RecvOp {
  int peer;
  void* data;
  size_t bytes;
  // Null: the message goes to the contiguous `bytes` at `data`.
  const StridedLayout* strided = nullptr;
  uint64_t tag = 0;
};

class TransportWork {
 public:
  virtual ~TransportWork() = default;
  // Blocks until every op of the group completed (OK), the deadline passed
  // (kDeadlineExceeded), the transport was aborted (kAborted), or a peer failed
  // (kUnavailable / kAborted; the message names the peer where the transport knows it), or a
  // received message's tag differed from its receive's (kFailedPrecondition). After a non-OK
  // result the buffers may have been partly written; the transport must not be used again
  // except to Abort it.
  // Buffer lifetime: when Wait returns, with any status, the transport no longer reads or
  // writes the group's buffers (it withdrew or drained the ops), so the caller may free them.
  // A transport that cannot drain in time must keep blocking (after Abort, at most a few
  // seconds) rather than return early; the executor relies on this (executor.h).
  virtual Status Wait(Deadline deadline) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // True if buffers may be CUDA device memory (NCCL); false: host memory only.
  virtual bool SupportsDeviceMemory() const = 0;
  // True if Start accepts ops with a StridedLayout (see there); false: contiguous ops only.
  virtual bool SupportsStridedOps() const { return false; }
  // Where the executor's staging buffers for this transport come from (a device transport's
  // device memory); null: the executor's own (host memory, or cudaMalloc on the current device
  // for CUDA shards). Owning thread.
  virtual Allocator StagingAllocator() { return nullptr; }

  // Starts a group of sends and receives that progress concurrently. Between one pair of
  // ranks, messages match in the order they were posted (the i-th send from a to b matches
  // the i-th receive at b from a, across groups too); sizes of matching ops must be equal, else
  // the group fails with kInternal. Buffers must stay valid until Wait returns. Only the
  // thread that owns the transport calls Start. kInvalidArgument for a peer out of range, or an
  // op with a StridedLayout that this transport does not support or that is malformed.
  virtual StatusOr<std::unique_ptr<TransportWork>> Start(std::span<const SendOp> sends,
                                                         std::span<const RecvOp> recvs) = 0;

  // Makes pending and later Waits return kAborted promptly (within a second). Callable from
  // any thread, any number of times.
  virtual void Abort() = 0;
};

}  // namespace morph

#endif  // MORPH_RESHARD_TRANSPORT_H_
