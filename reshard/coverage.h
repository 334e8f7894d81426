// Exact coverage of a shard by pieces: the check that makes a plan unable to leave an element of
// a new shard unwritten or to write one twice. The executor runs it on every plan (recvs +
// local_copies + lost against each new shard); planner tests can run it on what they build.
//
//   std::vector<CoveragePiece> pieces = {{box_a, "recvs[0]"}, {box_b, "local_copies[3]"}};
//   MORPH_RETURN_IF_ERROR(ValidateCoverage("w1", new_shard, pieces));
//
// Cost: O(p log p · rank²) for p pieces of grid-aligned boxes (the planner's pieces are
// intersections of two layouts' boxes); it never touches the tensor's elements. Pure function,
// any thread.
#ifndef MORPH_RESHARD_COVERAGE_H_
#define MORPH_RESHARD_COVERAGE_H_

#include <span>
#include <string>
#include <string_view>

#include "morph/status.h"
#include "morph/box.h"
#include "morph/shard.h"

namespace morph {

struct CoveragePiece {
  Box box;
  std::string label;  // how error messages name the piece, e.g. "recvs[2] (peer 3)"
};

// OK iff every piece lies inside `shard` (its elements, not just its frame), no two pieces share
// an element, and together they hold every element of the shard. Empty pieces are ignored.
// kInvalidArgument otherwise, naming `tensor` and the offending box(es): a piece outside the
// shard, the first two pieces found overlapping (with their common box), or a shard box whose
// elements are not all covered (with the count).
// With `state` (a padded tensor's state box, local_plan.h TensorInfo), only the shard's elements
// inside it count: pieces must lie in shard ∩ state and cover all of it.
Status ValidateCoverage(std::string_view tensor, const Shard& shard,
                        std::span<const CoveragePiece> pieces, const Box* state = nullptr);

// The first pair of overlapping boxes among `boxes` (indices into it), or {-1, -1} if they are
// pairwise disjoint. Boxes must have equal rank. Empty boxes overlap nothing.
std::pair<int, int> FindOverlap(std::span<const Box> boxes);

}  // namespace morph

#endif  // MORPH_RESHARD_COVERAGE_H_
