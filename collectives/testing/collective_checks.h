// Reference checks of every collective, shared by the thread, forked and mpirun tests.
// Not installed.
//
//   MORPH_RETURN_IF_ERROR(CheckAllCollectives(*comm, std::chrono::seconds(20)));
#ifndef MORPH_COLLECTIVES_COLLECTIVE_CHECKS_H_
#define MORPH_COLLECTIVES_COLLECTIVE_CHECKS_H_

#include <chrono>

#include "collectives/communicator.h"

namespace morph {

// Runs allreduce (sum/max/min), broadcast (two roots), allgather, reduce-scatter for every
// data type and for counts 0, 1, 7, 1001 and 20001 (past the one-round sizes), then a barrier and a
// ring of sends/receives (several messages per pair, in order), and compares every result with
// values computed locally: kInternal naming the op, type, count and first wrong element.
// Collective: every rank of `comm` calls it.
Status CheckAllCollectives(Communicator& comm, std::chrono::milliseconds timeout);

// The Gloo backend's reduction order (docs/collectives.md, "Reduction algorithms"): sums of
// values whose floating-point sum depends on the order (mixed signs and magnitudes), for
// f32, f64, f16 and bf16, counts 0, 1, 7, 1001 and 20001 (counts that no world size divides),
// allreduce and reduce-scatter, compared bit for bit with a local reduction in the documented
// order: rank order for buffers up to `one_shot_max_bytes` (allreduce: the buffer; reduce-scatter:
// the whole input), ring order above (chunk c of count*c/size .. count*(c+1)/size elements,
// or piece c, reduced starting at rank c+1), except f32/f64 allreduces above the one-round
// size (Gloo's own ring), which must hold the same bits on every rank. f16/bf16 sum in f32
// and round once. kInternal
// naming op, type, count and the first wrong element. Collective.
Status CheckReductionOrder(Communicator& comm, size_t one_shot_max_bytes,
                           std::chrono::milliseconds timeout);

// Only the point-to-point part.
Status CheckSendRecv(Communicator& comm, std::chrono::milliseconds timeout);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_COLLECTIVE_CHECKS_H_
