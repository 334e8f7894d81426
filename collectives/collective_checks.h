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
// data type and for counts 0, 1, 7 and 1001, then a barrier and a ring of sends/receives
// (several messages per pair, in order), and compares every result with values computed
// locally: kInternal naming the op, type, count and first wrong element. Collective: every
// rank of `comm` calls it.
Status CheckAllCollectives(Communicator& comm, std::chrono::milliseconds timeout);

// Only the point-to-point part.
Status CheckSendRecv(Communicator& comm, std::chrono::milliseconds timeout);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_COLLECTIVE_CHECKS_H_
