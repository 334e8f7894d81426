// OpSignature: a collective as the ranks compare it before any of its bytes move (kind,
// element type and count, root, reduction: 16 bytes). Ranks whose calls differ — a program's
// mistake: 4 floats against 8, float32 against float64, an allreduce against a broadcast —
// would otherwise read each other's bytes as what they expect, or make Gloo throw on its
// event thread and end the process. The Gloo communicator compares every collective's
// signature across its ranks (in the shared-memory operation itself when every rank is on one
// host, else in one small allgather) and returns kInvalidArgument on every rank, the
// communicator still usable (docs/collectives.md "Calls that differ across ranks").
#ifndef MORPH_COLLECTIVES_OP_SIGNATURE_H_
#define MORPH_COLLECTIVES_OP_SIGNATURE_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "collectives/communicator.h"

namespace morph {

struct OpSignature {
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t reduce = 0;
  uint8_t pad = 0;
  int32_t root = 0;
  uint64_t count = 0;
  friend bool operator==(const OpSignature&, const OpSignature&) = default;

  // What of `op` every rank must pass alike (the buffers aside).
  static OpSignature Of(const CollectiveOp& op);
  // "allreduce of 4 x f32 (sum)", "broadcast of 3 x f32 from rank 0", "barrier".
  std::string ToString() const;
};
static_assert(sizeof(OpSignature) == 16);

// kInvalidArgument: "<what>: the ranks' calls differ: rank R calls <theirs>, rank M (this
// one) <mine>".
Status DisagreementError(std::string_view what, int rank, const OpSignature& theirs, int me,
                         const OpSignature& mine);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_OP_SIGNATURE_H_
