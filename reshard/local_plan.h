// LocalPlan: the part of a reshard plan that concerns one participant. It is the contract
// between the planner (plan.h), which produces it, and the executor (executor.h), which runs it.
//
// Participants are numbered 0..n-1 by the runtime (old members, joiners and leavers of the
// reconfiguration); the same numbers are the ranks of the Transport the executor uses.
//
// Ordering contract: for every pair (a, b), the `sends` of a whose peer is b and the `recvs`
// of b whose peer is a list the same pieces in the same order (the planner sorts them by
// tensor index, then by box origin). The executor may pack consecutive pieces to one peer
// into one message and split large pieces, but both sides derive message boundaries only
// from these lists and from ExecutorOptions fields that must be equal on all participants.
// The executor checks both before any data moves (a per-pair handshake of list hashes and of
// the plan digest, executor.h "Agreement"), and checks that recvs + local_copies + lost cover
// every new shard exactly once (reshard/coverage.h).
#ifndef MORPH_RESHARD_LOCAL_PLAN_H_
#define MORPH_RESHARD_LOCAL_PLAN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "morph/box.h"
#include "morph/dtype.h"
#include "reshard/plan_digest.h"
#include "morph/shard.h"

namespace morph {

// A registered tensor as the executor needs it: identity, element type and global shape (in
// planning coordinates: layout.h). `shape` is the state. A padded tensor (layout.h
// PadToMultiple) also has `padded_shape`, which bounds every frame; its elements outside
// `shape` are padding: no piece moves them, and the executor zero-fills them in new shards.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<int64_t> padded_shape;  // empty: not padded
  // The box every frame lies in: padded_shape if set, else shape.
  const std::vector<int64_t>& frame_shape() const {
    return padded_shape.empty() ? shape : padded_shape;
  }
};

// The elements of `box` (global coordinates) of tensor `tensor`, exchanged with `peer`.
struct PieceMove {
  int32_t tensor = 0;
  int32_t peer = 0;
  Box box;
};

struct LocalPlan {
  int32_t participant = 0;
  int32_t num_participants = 0;
  // What the plan was derived from (set by the Planner; unknown, all 0, for a hand-built plan).
  // The executor proves every peer it exchanges with runs a plan of the same digest.
  PlanDigest digest;
  std::vector<TensorInfo> tensors;
  // Indexed like `tensors`: what this participant holds before and after. nullopt (or an
  // empty shard) = nothing.
  std::vector<std::optional<Shard>> old_shards;
  std::vector<std::optional<Shard>> new_shards;
  // Pieces this participant sends from its old storage / receives into its new storage.
  std::vector<PieceMove> sends;
  std::vector<PieceMove> recvs;
  // Pieces copied from this participant's old storage into its new storage (peer == self).
  std::vector<PieceMove> local_copies;
  // Pieces of new shards that no surviving participant holds (peer -1): the executor leaves
  // them unwritten and the caller fills them (e.g. from a checkpoint). recvs + local_copies +
  // lost cover every element of every new shard exactly once; the executor rejects a plan
  // where they do not (kInvalidArgument naming tensor and box).
  std::vector<PieceMove> lost;
};

}  // namespace morph

#endif  // MORPH_RESHARD_LOCAL_PLAN_H_
