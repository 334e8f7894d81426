// PlanHandshake: the reshard executor's agreement step (executor.h, "Agreement"). Before the
// first data byte, every pair of participants that exchanges pieces swaps one fixed-size record
// per direction over the Transport: the plan digest (all parts, message layout included), a hash
// and count of the pieces each side lists for the pair in each direction, and a fresh nonce.
// Equal records prove the pair runs the same plan; each side also says whether its messages of
// each direction need staging (the executor groups directions in place at both ends more
// coarsely, and both ends must group alike); the nonces and the digest then seed the
// transport tag of every data message (transport.h), so a stray message fails loudly.
//
//   MORPH_ASSIGN_OR_RETURN(PlanHandshake hs, PlanHandshake::Run(plan, digest, transport, dl));
//   SendOp op{peer, data, bytes, nullptr, hs.SendTag(peer, message_index)};
//
// Internal to the executor (not installed). Called by the thread that owns the transport.
#ifndef MORPH_RESHARD_PLAN_HANDSHAKE_H_
#define MORPH_RESHARD_PLAN_HANDSHAKE_H_

#include <cstdint>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "reshard/local_plan.h"
#include "reshard/transport.h"

namespace morph {

class PlanHandshake {
 public:
  PlanHandshake() = default;

  // Swaps records with every peer `plan` (already validated) exchanges pieces with.
  //   kFailedPrecondition  a peer's digest differs (names the parts and both digests), or its
  //                        piece lists for the pair differ from ours, or it is another
  //                        participant / has another participant count, or it sent garbage;
  //   kAborted             a peer failed before the exchange (names it and its reason);
  //   the transport's status otherwise (deadline, peer gone, abort, tag mismatch).
  // `in_place`, indexed by participant (empty: none), says which of this side's messages need
  // no staging: bit kSendsInPlace for the messages to that peer, kRecvsInPlace for those from
  // it. Both sides' bits travel in the records; InPlace() combines them.
  static constexpr uint8_t kSendsInPlace = 1;
  static constexpr uint8_t kRecvsInPlace = 2;
  static StatusOr<PlanHandshake> Run(const LocalPlan& plan, const PlanDigest& digest,
                                     Transport& transport, Deadline deadline,
                                     const std::vector<uint8_t>& in_place = {});

  // Best effort, for a participant whose plan failed validation: offers `why` to the peers its
  // plan names (as failed records) until `deadline`, so that peers waiting in Run fail at once
  // with kAborted naming this participant and the reason. The plan's peers out of range are
  // skipped; the transport must be the plan's (rank and size).
  static void NotifyFailure(const LocalPlan& plan, Transport& transport, const Status& why,
                            Deadline deadline);

  // Transport tags of message `index` to / from `peer` (a peer Run swapped records with).
  uint64_t SendTag(int peer, int64_t index) const;
  uint64_t RecvTag(int peer, int64_t index) const;
  // True when every message of the direction (to `peer` if `send`, else from it) needs no
  // staging at either end: equal at both ends of the pair (both combine the same two bits).
  bool InPlace(int peer, bool send) const;

 private:
  int me_ = 0;
  uint64_t session_ = 0;  // the digest's combined value
  uint64_t nonce_ = 0;    // this execution's
  std::vector<uint64_t> peer_nonce_;
  std::vector<uint8_t> in_place_;  // per peer: kSendsInPlace / kRecvsInPlace of the pair
};

}  // namespace morph

#endif  // MORPH_RESHARD_PLAN_HANDSHAKE_H_
