// Test helpers for reshard plans: a single-threaded reference applier that runs LocalPlans
// between in-memory buffers, and brute-force references. Test-only; not installed.
//
//   MORPH_ASSERT_OK_AND_ASSIGN(auto plans, planner.PlanAll());
//   MORPH_ASSERT_OK(testutil::ApplyAndCheck(in, planner.assignment(), plans));
#ifndef MORPH_RESHARD_PLAN_TESTUTIL_H_
#define MORPH_RESHARD_PLAN_TESTUTIL_H_

#include <random>
#include <string>
#include <vector>

#include "morph/status.h"
#include "reshard/local_plan.h"
#include "reshard/plan.h"

namespace morph::testutil {

// A random non-decreasing stage map of `layers` layers that uses every one of `pp` stages
// (1 <= pp <= layers).
std::vector<int> RandomStageMap(std::mt19937_64& rng, int layers, int pp);

// Byte `b` of element `linear` (row-major global index) of tensor `tensor` in the reference.
uint8_t ReferenceByte(int tensor, int64_t linear, int b);

// What `rank`'s local buffer of `spec` holds, slot by slot: the real row-major linear index
// (in spec.shape) of each element, -1 for padding; empty off-stage. Built element by element
// from the layout's definition (stages of its layers; TP rank t's slice of the split dimension,
// or of each of its blocks, or of the padded dimension, or its torch.chunk; the flattened
// TP-local piece cut into ceil(n / G) ranges, or for ChunkDP its dimension 0 cut into
// ceil(rows / G) row ranges, range d % G), sharing no code with ShardOf or the planner.
std::vector<int64_t> ReferenceSlots(const TensorSpec& spec, const ParallelConfig& config, int rank);

// Checks that for every pair (a, b) a's sends to b and b's recvs from a list the same
// (tensor, box) in the same order. kInternal naming the pair otherwise.
Status CheckPairsMatch(const std::vector<LocalPlan>& plans);

// Fills every surviving old rank's buffers from the reference (slot k of a buffer holds element
// ReferenceSlots[k]; padding slots get garbage), applies `plans` (local copies, then each recv
// from the matching sender's old buffer, via ViewOf) and checks that every new rank's buffers
// equal the reference bitwise slot by slot, each state element written exactly once and no
// padding slot written, that buffer sizes equal the reference's, and that the plans' old/new
// shards equal ShardOf. `lost` (one list per participant, from PlanAll) are
// filled from the reference, as a checkpoint would, after checking that no surviving old rank
// holds any of their elements. kInternal describing the first difference.
Status ApplyAndCheck(const PlanInput& in, const Assignment& assignment,
                     const std::vector<LocalPlan>& plans,
                     const std::vector<std::vector<PieceMove>>* lost = nullptr);

// resident[j][s]: bytes of new rank s's shards that available participant in.available[j]
// (sorted) already holds, counted element by element from ReferenceSlots.
std::vector<std::vector<int64_t>> BruteResidentMatrix(const PlanInput& in);
// The largest total over every injective map new rank -> available participant: by trying
// every map (Brute, tiny worlds only) and by the dense Hungarian (Dense, O(world^2 * |avail|)).
int64_t BruteBestResident(const std::vector<std::vector<int64_t>>& resident);
int64_t DenseBestResident(const std::vector<std::vector<int64_t>>& resident);

// One line per move; for comparing plans.
std::string PlanToString(const LocalPlan& plan);

}  // namespace morph::testutil

#endif  // MORPH_RESHARD_PLAN_TESTUTIL_H_
