// Internals shared by plan.cc and plan_assign.cc; not installed, not a public API.
#ifndef MORPH_RESHARD_PLAN_INTERNAL_H_
#define MORPH_RESHARD_PLAN_INTERNAL_H_

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "morph/parallel_config.h"
#include "reshard/layout.h"
#include "reshard/plan.h"
#include "morph/shard.h"

namespace morph {

// Tensors that differ only in their layer are one class: they overlap identically between any
// old and new rank, so the assignment works on classes times counts.
struct Planner::Classes {
  struct Class {
    TensorSpec rep;     // layer ignored; a planning spec (no blocks)
    int64_t elem = 0;   // bytes per element
    int64_t elems = 0;  // elements of the whole tensor (padding excluded)
    // The state box of padded classes (overlaps count only state), else nullptr.
    const Box* state() const { return rep.layout.pad_multiple() > 0 ? &state_box : nullptr; }
    Box state_box;
  };
  std::vector<Class> classes;
  // (old stage, new stage) -> (class, number of tensors of that class), in class order.
  std::map<std::pair<int, int>, std::vector<std::pair<int, int64_t>>> groups;
  // groups by old stage * new pp + new stage; nullptr where empty. Points into `groups`.
  std::vector<const std::vector<std::pair<int, int64_t>>*> group_of;
  // Same indexing: equal groups (same classes and counts) share an id, -1 where empty.
  std::vector<int> group_id;
  int new_pp = 1;
  const std::vector<std::pair<int, int64_t>>* Group(int old_stage, int new_stage) const {
    return group_of[static_cast<size_t>(old_stage) * static_cast<size_t>(new_pp) +
                    static_cast<size_t>(new_stage)];
  }
  std::vector<std::vector<int>> new_stages_of_old;  // with at least one tensor, ascending
  // New stage -> (class, number of tensors of that class on it): each tensor once per new
  // stage holding it (groups count a tensor on several old stages once per old stage).
  std::vector<std::vector<std::pair<int, int64_t>>> on_new_stage;
  bool any_unsplit = false;
};

namespace plan_internal {

// Elements of a box (0 when empty).
inline int64_t NumEl(const Box& b) {
  int64_t n = 1;
  for (const Interval& i : b.dims()) n *= i.size();
  return n;
}

// Row-major index, inside `frame`, of the first (last = false) or last element of box `b`.
inline int64_t LinearIn(const Box& frame, const Box& b, bool last) {
  int64_t l = 0;
  for (int d = 0; d < frame.rank(); ++d) {
    const int64_t i = last ? b.dim(d).end - 1 : b.dim(d).begin;
    l = l * frame.dim(d).size() + (i - frame.dim(d).begin);
  }
  return l;
}

// What DP rank d, TP rank t holds of `spec`, assuming its stage holds the tensor.
Shard ShardAt(const TensorSpec& spec, const ParallelConfig& config, int d, int t);

// Number of elements two shards of the same tensor have in common (inside `state`, if given).
int64_t OverlapCount(const Shard& a, const Shard& b, const Box* state = nullptr);

// OverlapCount(ShardAt(spec, oc, d, t), ShardAt(spec, nc, dn, tn)) for a TP-split ZeRO tensor,
// in closed form without allocating: each shard is at most three (row range x in-row interval)
// pieces of the [outer, split dim, inner] view of the tensor.
int64_t ZeroSplitOverlap(const TensorSpec& spec, const ParallelConfig& oc, int d, int t,
                         const ParallelConfig& nc, int dn, int tn);
// The new DP ranks of new TP rank tn whose ZeRO ranges the same old shard touches: a hull
// (every dn with ZeroSplitOverlap > 0 is inside it). Empty span if none.
DpSpan ZeroSplitSpan(const TensorSpec& spec, const ParallelConfig& oc, int d, int t,
                     const ParallelConfig& nc, int tn);

// Minimum-cost assignment of every row to a distinct column (rows <= columns): the column of
// each row. O(rows^2 * columns); exact integer arithmetic, deterministic. The dense reference
// the tests check the planner's sparse assignment (sparse_assign.h) against.
std::vector<int> Hungarian(const std::vector<std::vector<int64_t>>& cost);

}  // namespace plan_internal
}  // namespace morph

#endif  // MORPH_RESHARD_PLAN_INTERNAL_H_
