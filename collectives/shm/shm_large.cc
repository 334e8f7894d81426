// ShmCollectives::RunLarge: allreduce, reduce-scatter, allgather and broadcast too large for the
// per-rank buffers (shm_collectives.h), chunk by chunk through each rank's staging slots
// (shm_layout.h), one wait for every peer per chunk.
//
// Chunk c of an operation covers `per` elements of each rank's piece (ChunkBytes(n) of it; a
// reduce-scatter chunk holds that many for every rank). Chunks are numbered across operations
// (chunk_, the same on every rank: every rank stages the same chunks in the same order), and
// chunk g lives in slot g mod kStagingSlots. Each rank:
//   stage chunk 0 (allreduce, reduce-scatter: all but its own part, which only it reads);
//   publish the operation with its signature; wait; compare the calls;
//   for every chunk c:
//     read c: allreduce: reduce its piece [len * rank / n, len * (rank + 1) / n) of c in rank
//               order, the others' contributions from their slots, its own from its buffer,
//               into that piece of its own slot;
//             reduce-scatter: reduce its part of c (the others' from their slots, its own
//               from its input) into its output;
//             allgather, broadcast: copy the slots' chunk into the output;
//     stage c + 1; publish and wait (allreduce: also after the last chunk);
//     allreduce: copy every rank's reduced piece of c into the output.
// Why slots may be reused: a rank rewrites slot g mod 3 when it stages chunk g + 3; between it
// staged g and stages g + 3 it waited for three publishes of every peer, and every peer is done
// with chunk g before its third publish after staging g (allreduce: it reads g's pieces after
// its second and before its third; the others read g after its first and before its second).
// A rank's own piece of an allreduce slot is read by the others only after the wait that
// follows its reduction. So one wait per chunk, no acknowledgements.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/shm/shm_collectives.h"
#include "collectives/shm/shm_layout.h"

namespace morph {

Status ShmCollectives::Step(std::chrono::steady_clock::time_point deadline,
                            std::chrono::milliseconds timeout, std::string_view kind) {
  // An abort stops a large operation at its next chunk, even when its peers keep up (a wait
  // that finds every peer there does not look).
  if (failed_.load(std::memory_order_acquire)) {
    return AbortedError(what_ + ": " + std::string(kind) + ": aborted in shared memory")
        .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}, ""});
  }
  const uint64_t k = ++seq_;
  Publish(k);
  return WaitForPeers(k, -1, deadline, timeout, kind);
}

Status ShmCollectives::RunLarge(const CollectiveOp& op, gloo_algorithms::Workspace& workspace,
                                std::string_view kind) {
  using Kind = CollectiveOp::Kind;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(op.timeout, std::chrono::hours(24 * 365));
  const size_t es = DTypeSize(op.dtype);
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_);
  const size_t per = segment_->chunk_bytes / es / (op.kind == Kind::kReduceScatter ? n : 1);
  const size_t chunks = (op.count + per - 1) / per;
  auto first = [&](size_t c) { return c * per; };
  auto len = [&](size_t c) { return std::min(per, op.count - c * per); };
  // An allreduce's chunk c: rank p reduces elements [piece(c, p), piece(c, p + 1)) of it.
  auto piece = [&](size_t c, size_t p) { return len(c) * p / n; };
  const uint8_t* send = static_cast<const uint8_t*>(op.send);
  uint8_t* recv = static_cast<uint8_t*>(op.recv);
  const bool root = op.kind == Kind::kBroadcast && rank_ == op.root;
  const uint64_t g0 = chunk_;
  auto slot = [&](size_t rank, size_t c) {
    return segment_->staging(static_cast<int>(rank), g0 + c);
  };

  // This rank's contribution to chunk c into its slot.
  auto stage = [&](size_t c) {
    const size_t bytes = len(c) * es;
    switch (op.kind) {
      case Kind::kAllreduce: {  // what the others reduce: all but this rank's own piece
        const size_t lo = piece(c, me) * es, hi = piece(c, me + 1) * es;
        std::memcpy(slot(me, c), recv + first(c) * es, lo);
        std::memcpy(slot(me, c) + hi, recv + first(c) * es + hi, bytes - hi);
        break;
      }
      case Kind::kAllgather:
        std::memcpy(slot(me, c), send + first(c) * es, bytes);
        break;
      case Kind::kBroadcast:
        if (root) std::memcpy(slot(me, c), recv + first(c) * es, bytes);
        break;
      case Kind::kReduceScatter:  // every rank's part but this rank's own
        for (size_t q = 0; q < n; ++q) {
          if (q == me) continue;
          std::memcpy(slot(me, c) + q * bytes, send + (q * op.count + first(c)) * es, bytes);
        }
        break;
      case Kind::kBarrier:
      case Kind::kSendRecv:
        break;
    }
  };
  std::vector<const uint8_t*> pieces(n);
  // What this rank reads of chunk c once every rank staged it.
  auto read = [&](size_t c) {
    switch (op.kind) {
      case Kind::kAllreduce: {  // its own contribution from its buffer, the result to its slot
        const size_t lo = piece(c, me), hi = piece(c, me + 1);
        if (hi == lo) break;
        for (size_t p = 0; p < n; ++p) pieces[p] = slot(p, c) + lo * es;
        pieces[me] = recv + (first(c) + lo) * es;
        gloo_algorithms::ReduceInRankOrder(workspace, pieces, hi - lo, op.dtype, op.reduce,
                                           slot(me, c) + lo * es);
        break;
      }
      case Kind::kReduceScatter:
        for (size_t p = 0; p < n; ++p) pieces[p] = slot(p, c) + me * len(c) * es;
        pieces[me] = send + (me * op.count + first(c)) * es;
        gloo_algorithms::ReduceInRankOrder(workspace, pieces, len(c), op.dtype, op.reduce,
                                           recv + first(c) * es);
        break;
      case Kind::kAllgather:
        for (size_t p = 0; p < n; ++p) {
          std::memcpy(recv + (p * op.count + first(c)) * es, slot(p, c), len(c) * es);
        }
        break;
      case Kind::kBroadcast:
        if (!root) {
          std::memcpy(recv + first(c) * es, slot(static_cast<size_t>(op.root), c), len(c) * es);
        }
        break;
      case Kind::kBarrier:
      case Kind::kSendRecv:
        break;
    }
  };
  // An allreduce's last step: the reduced pieces of chunk c, this rank's own too.
  auto gather = [&](size_t c) {
    for (size_t p = 0; p < n; ++p) {
      const size_t lo = piece(c, p), hi = piece(c, p + 1);
      std::memcpy(recv + (first(c) + lo) * es, slot(p, c) + lo * es, (hi - lo) * es);
    }
  };

  stage(0);
  const uint64_t k = ++seq_;
  const OpSignature signature = OpSignature::Of(op);
  segment_->control(rank_)->signature[k & 1] = signature;
  Publish(k);
  MORPH_RETURN_IF_ERROR(WaitForPeers(k, -1, deadline, op.timeout, kind));
  MORPH_RETURN_IF_ERROR(Compare(k, signature, kind));
  chunk_ += chunks;  // only now: a refused call staged chunk 0, which nobody read
  const bool allreduce = op.kind == Kind::kAllreduce;
  for (size_t c = 0; c < chunks; ++c) {
    read(c);
    if (c + 1 < chunks) stage(c + 1);
    if (allreduce || c + 1 < chunks) {
      MORPH_RETURN_IF_ERROR(Step(deadline, op.timeout, kind));
    }
    if (allreduce) gather(c);
  }
  return Status::Ok();
}

}  // namespace morph
