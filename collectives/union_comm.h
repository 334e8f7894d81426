// The union communicator of a change: one communicator over every participant of a reshard —
// the old members (leavers too) and the new ones (joiners) — that the device transport
// (device_transport.h) moves device state over. NCCL 2.28 cannot grow a communicator
// (docs/facts.md), so where it comes from depends on who takes part:
//
//   kOldWorld  every participant is a member of the running generation's world communicator and
//              nobody in it is dead (a planned shrink, a DP/TP/PP change at the same size): that
//              communicator itself, ranks mapped; nothing is built. Used at the switch step,
//              when the training thread no longer runs collectives on it.
//   kShrunk    every participant is an alive member of the old world, some members are dead, and
//              the old world can shrink (NCCL): ncclCommShrink without the dead (no unique id;
//              dead ranks do not block it). Consumes the old world.
//   kNewWorld  every participant is a member of the next generation's world communicator (a
//              grow where nobody leaves; a recovery whose world was shrunk): built during
//              prepare anyway, so the union costs nothing more.
//   kFresh     otherwise (members leave and others join): a new communicator over the
//              participants, ranks = participant numbers, with a fresh unique id through the
//              generation's store — a non-blocking init, run during prepare beside training.
//
//   UnionCommInput in{.participants = change.participants, .old_world = from.ranks,
//                     .new_world = next.ranks, .dead = lost, .old_world_shrinks = true};
//   MORPH_ASSIGN_OR_RETURN(UnionCommPlan plan, PlanUnionComm(in));   // same on every participant
//   MORPH_ASSIGN_OR_RETURN(UnionComm u, BuildUnionComm(plan, me, old_world, new_world,
//                                                      NcclFactory(device), store, g, deadline));
//
// PlanUnionComm is a pure function of the change (every participant derives the same plan);
// BuildUnionComm is collective as the source requires (kShrunk: the old world's survivors;
// kFresh: every participant; the others: nothing).
#ifndef MORPH_COLLECTIVES_UNION_COMM_H_
#define MORPH_COLLECTIVES_UNION_COMM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/groups.h"
#include "collectives/store/store.h"

namespace morph {

struct UnionCommInput {
  std::vector<int64_t> participants;  // participant number -> worker id
  // Communicator rank -> worker id of the running generation's world and of the next one's;
  // empty when that communicator cannot carry device state (e.g. Gloo step groups) or does not
  // exist.
  std::vector<int64_t> old_world;
  std::vector<int64_t> new_world;
  std::vector<int64_t> dead;  // workers known dead (their old ranks are gone)
  bool old_world_shrinks = false;  // the old world can Shrink (capabilities().shrink)
};

struct UnionCommPlan {
  enum class Source { kOldWorld, kShrunk, kNewWorld, kFresh };
  Source source = Source::kFresh;
  std::vector<int> comm_rank_of_participant;  // for DeviceTransport::Create
  std::vector<int> exclude;                   // kShrunk: old world ranks left out
  int comm_size = 0;
};
const char* UnionSourceName(UnionCommPlan::Source s);  // "old world", "shrunk", ...

// kInvalidArgument for no participants or a worker listed twice in one list. Any thread.
StatusOr<UnionCommPlan> PlanUnionComm(const UnionCommInput& in);

struct UnionComm {
  UnionCommPlan plan;
  std::unique_ptr<Communicator> owned;  // kShrunk / kFresh: built here
  Communicator* comm = nullptr;         // owned, or the world communicator it reuses
};

// The communicator `plan` names, for participant `participant`. kOldWorld / kShrunk use
// `old_world`, kNewWorld `new_world` (each must then be the communicator the plan was made
// from: kInvalidArgument if null or of another size); kFresh builds "change/device" with `fresh`
// over `store` (generation's). Errors: Shrink's, the factory's (kDeadlineExceeded at
// `deadline`), with context. Any thread, collective as above.
StatusOr<UnionComm> BuildUnionComm(const UnionCommPlan& plan, int participant,
                                   Communicator* old_world, Communicator* new_world,
                                   const CommunicatorFactory& fresh, Store& store,
                                   int64_t generation, Deadline deadline);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_UNION_COMM_H_
