// Exact maximum-weight assignment on a sparse, block-structured weight matrix: the planner's
// assignment of participants to new ranks (docs/reshard-planner.md §2.5). Internal to the
// planner and its tests; not installed.
//
// The matrix W (rows = new ranks, columns = participants, rows <= columns or not) is given
// implicitly. For row i and column j,
//   W(i, j) = max(0, direct(i, j), max{ w : (g, w) in an entry list of row i, j in group g })
// where direct entries are listed per row, groups are sets of columns, and each row names up to
// kListsPerRow entry lists (rows of one "cell" share a list). Every weight is >= 0. The solver
// returns an injective map rows -> columns (or kDummy) maximizing Σ W; a row mapped to kDummy
// gets weight 0 (the caller gives it any column nobody uses).
//
//   SparseAssignProblem pb;  ... fill ...
//   MORPH_ASSIGN_OR_RETURN(SparseAssignResult r, SolveSparseAssignment(pb));
//
// Pure; any thread.
#ifndef MORPH_RESHARD_SPARSE_ASSIGN_H_
#define MORPH_RESHARD_SPARSE_ASSIGN_H_

#include <array>
#include <cstdint>
#include <vector>

#include "morph/status.h"

namespace morph::plan_internal {

inline constexpr int kListsPerRow = 4;
inline constexpr int32_t kDummy = -1;

struct SparseAssignProblem {
  int32_t rows = 0;
  int32_t cols = 0;
  // Direct entries, CSR by row (row_begin has rows + 1 entries): column and weight (> 0).
  std::vector<int64_t> direct_begin;
  std::vector<int32_t> direct_col;
  std::vector<int64_t> direct_w;
  // Column groups, CSR by column (cols + 1 entries): the groups (< num_groups) of each column.
  int32_t num_groups = 0;
  std::vector<int64_t> col_group_begin;
  std::vector<int32_t> col_group;
  // Entry lists, CSR by list: (group, weight > 0).
  std::vector<int64_t> list_begin;
  std::vector<int32_t> list_group;
  std::vector<int64_t> list_w;
  // The entry lists of each row (-1: none).
  std::vector<std::array<int32_t, kListsPerRow>> row_lists;
};

struct SparseAssignResult {
  std::vector<int32_t> col_of_row;  // size rows; kDummy: weight 0, any unused column
  int64_t total = 0;                // Σ W(i, col_of_row[i])
  int64_t augmentations = 0;        // rows not matched by the greedy start
  int64_t columns_scanned = 0;      // columns popped over all shortest-path searches
};

// kInvalidArgument if the problem is malformed (sizes, indices out of range, a weight <= 0)
// or its weights are too large for exact int64 potentials (max weight * (rows + 2) >= 2^62),
// the message naming the limit. Deterministic: equal problems give equal results.
// Cost: O((augmentations * explored + rows) * log) where explored is the part of the graph a
// shortest augmenting path search reaches; memory linear in the problem.
StatusOr<SparseAssignResult> SolveSparseAssignment(const SparseAssignProblem& pb);

// W(i, j) by the definition above, by scanning (for tests).
int64_t SparseWeight(const SparseAssignProblem& pb, int32_t row, int32_t col);

}  // namespace morph::plan_internal

#endif  // MORPH_RESHARD_SPARSE_ASSIGN_H_
