// An independent reference for the planner's assignment, for plan_bench: resident bytes of a
// (participant, new rank) pair computed from the layout definition alone (docs/reshard-planner.md
// §1: stages of the layers, TP slice t*len/tp of the dimension or of each of its blocks, padded
// slices t*P/tp with only elements below the logical size counted, ZeRO chunk ceil(n/G) with
// range d % G), an upper bound on the
// resident bytes any assignment can keep, and the exact optimum by a dense Hungarian per
// stage component. Shares no code with reshard/plan*.cc (only the PlanInput struct and the
// rank algebra of ParallelConfig). Bench-only; single-threaded.
#ifndef MORPH_BENCH_PLAN_REFERENCE_H_
#define MORPH_BENCH_PLAN_REFERENCE_H_

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "reshard/plan.h"

namespace morph::benchref {

class Reference {
 public:
  explicit Reference(const PlanInput& in);

  // Bytes of new rank s's shards that participant q's old rank holds (0 for joiners).
  int64_t Resident(int32_t q, int s) const;
  // Bytes of new rank s's shards.
  int64_t Needed(int s) const;
  // min(Σ_s max_q Resident(q, s), Σ_q max_s Resident(q, s)) over available participants q:
  // no assignment keeps more. Both sums are returned too.
  struct Bound {
    int64_t by_rank = 0;
    int64_t by_participant = 0;
    int64_t bound = 0;
  };
  Bound UpperBound() const;
  // The exact optimum: a dense Hungarian per connected component of stages (old and new
  // stages sharing a tensor). O(Σ component^3): affordable up to a few hundred ranks per stage.
  int64_t Optimum() const;

 private:
  struct Class {
    int64_t elem = 0;
    std::vector<int64_t> shape;
    int tp_dim = -1;
    bool zero = false;
    int blocks = 1, pad = 0, group = 0;
  };
  int64_t Overlap(const Class& k, int d, int t, int dn, int tn) const;
  // Elements of the class a rank (d, t) of `c` holds (padding excluded).
  int64_t Count(const Class& k, const ParallelConfig& c, int d, int t) const;
  int64_t PairBytes(int p, int d, int t, int pn, int dn, int tn) const;

  const PlanInput& in_;
  std::vector<Class> classes_;
  // (old stage, new stage) -> (class, count).
  std::map<std::pair<int, int>, std::vector<std::pair<int, int64_t>>> pairs_;
  std::vector<std::vector<int>> old_of_new_, new_of_old_;
  std::vector<int32_t> old_rank_of_;  // per participant, -1 none
  std::vector<char> available_;
};

}  // namespace morph::benchref

#endif  // MORPH_BENCH_PLAN_REFERENCE_H_
