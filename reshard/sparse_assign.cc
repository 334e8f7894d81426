// The exact sparse assignment: shortest augmenting paths (Hungarian / Jonker-Volgenant) on the
// implicitly complete matrix of sparse_assign.h, with groups scanned lazily. The argument for
// optimality is in docs/reshard-planner.md §2.5; in short:
//
// Minimize Σ c(i, σ(i)) with c = -W over injective σ: rows -> columns, with max(0, rows - cols)
// dummy columns of weight 0 so that one exists. LP dual: max Σu + Σv, u_i + v_j <= c_ij,
// v_j <= 0. We keep (u, v) feasible, every matched edge tight, and v_j = 0 on every free column.
// Start: v = 0, u_i = min_j c_ij; a row takes a free tight column if it has one. Then each free
// row runs Dijkstra on reduced costs c_ij - u_i - v_j >= 0 until it pops a free column (at
// distance D), augments along the path, and sets u_i += D - dist_i on the rows it reached and
// v_j -= D - dist_j on the columns it popped: feasibility, tightness and "free => v = 0" are
// preserved (the only free column popped is the last, with dist = D). When every row is
// matched, complementary slackness holds, so the assignment is optimal.
//
// The columns of group g at row i all cost -w for the entry (g, w): for Dijkstra they share a
// label L_g = min over reached rows of (dist_i - w - u_i), and column j's label via g is
// L_g - v_j. Each group keeps its unpopped columns ordered by (-v_j, matched, j), so its best
// column is its first; the global heap holds one candidate per group plus the direct labels.
// A row's relaxation therefore costs O((direct entries + list entries) log n), never O(cols).
#include "reshard/sparse_assign.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <set>
#include <string>
#include <tuple>

namespace morph::plan_internal {
namespace {

Status Bad(const std::string& m) { return InvalidArgumentError("sparse assignment: " + m); }

Status CheckCsr(const std::vector<int64_t>& begin, size_t n, size_t len, const char* what) {
  if (begin.size() != n + 1 || begin.front() != 0 || begin.back() != static_cast<int64_t>(len)) {
    return Bad(std::string(what) + " offsets do not match the sizes");
  }
  for (size_t i = 0; i < n; ++i) {
    if (begin[i] > begin[i + 1]) return Bad(std::string(what) + " offsets decrease");
  }
  return Status();
}

Status Validate(const SparseAssignProblem& pb) {
  if (pb.rows < 0 || pb.cols < 0 || pb.num_groups < 0) return Bad("negative size");
  const size_t rows = static_cast<size_t>(pb.rows), cols = static_cast<size_t>(pb.cols);
  if (pb.direct_col.size() != pb.direct_w.size()) return Bad("direct entries size mismatch");
  MORPH_RETURN_IF_ERROR(CheckCsr(pb.direct_begin, rows, pb.direct_col.size(), "direct"));
  for (size_t e = 0; e < pb.direct_col.size(); ++e) {
    if (pb.direct_col[e] < 0 || pb.direct_col[e] >= pb.cols) return Bad("direct column range");
    if (pb.direct_w[e] <= 0) return Bad("direct weight <= 0");
  }
  MORPH_RETURN_IF_ERROR(CheckCsr(pb.col_group_begin, cols, pb.col_group.size(), "column group"));
  for (int32_t g : pb.col_group) {
    if (g < 0 || g >= pb.num_groups) return Bad("column group out of range");
  }
  if (pb.list_group.size() != pb.list_w.size()) return Bad("list entries size mismatch");
  if (pb.list_begin.empty()) return Bad("list offsets empty");
  const size_t lists = pb.list_begin.size() - 1;
  MORPH_RETURN_IF_ERROR(CheckCsr(pb.list_begin, lists, pb.list_group.size(), "list"));
  for (size_t e = 0; e < pb.list_group.size(); ++e) {
    if (pb.list_group[e] < 0 || pb.list_group[e] >= pb.num_groups) return Bad("list group range");
    if (pb.list_w[e] <= 0) return Bad("list weight <= 0");
  }
  if (pb.row_lists.size() != rows) return Bad("row_lists size mismatch");
  for (const auto& ls : pb.row_lists) {
    for (int32_t l : ls) {
      if (l < -1 || l >= static_cast<int32_t>(lists)) return Bad("row list out of range");
    }
  }
  return Status();
}

struct Key {
  int64_t neg_v;
  uint8_t matched;
  int32_t col;
  friend bool operator<(const Key& a, const Key& b) {
    return std::tie(a.neg_v, a.matched, a.col) < std::tie(b.neg_v, b.matched, b.col);
  }
};

struct Entry {
  int64_t d;
  uint8_t matched;
  int32_t col;
  int32_t group;  // -1: a direct label
  // std::priority_queue pops the largest: invert for a min-heap; ties: free columns first,
  // then by column, then direct before groups. Fully ordered, so the search is deterministic.
  friend bool operator<(const Entry& a, const Entry& b) {
    return std::tie(b.d, b.matched, b.col, b.group) < std::tie(a.d, a.matched, a.col, a.group);
  }
};

class Solver {
 public:
  explicit Solver(const SparseAssignProblem& pb) : pb_(pb) {}

  StatusOr<SparseAssignResult> Run() {
    const int32_t rows = pb_.rows;
    m_ = pb_.cols + std::max(0, rows - pb_.cols);
    all_ = pb_.num_groups;
    // Column -> groups, with the all-columns group last; dummies are only in that one.
    groups_of_.assign(static_cast<size_t>(m_), {});
    members_.assign(static_cast<size_t>(all_) + 1, {});
    for (int32_t j = 0; j < m_; ++j) {
      if (j < pb_.cols) {
        for (int64_t e = pb_.col_group_begin[static_cast<size_t>(j)];
             e < pb_.col_group_begin[static_cast<size_t>(j) + 1]; ++e) {
          const int32_t g = pb_.col_group[static_cast<size_t>(e)];
          groups_of_[static_cast<size_t>(j)].push_back(g);
          members_[static_cast<size_t>(g)].push_back(j);
        }
      }
      groups_of_[static_cast<size_t>(j)].push_back(all_);
    }
    // The all-columns group, dummies first: a greedy zero-weight row takes a dummy before a
    // real column some other row may want.
    for (int32_t j = pb_.cols; j < m_; ++j) members_[static_cast<size_t>(all_)].push_back(j);
    for (int32_t j = 0; j < pb_.cols; ++j) members_[static_cast<size_t>(all_)].push_back(j);

    u_.assign(static_cast<size_t>(rows), 0);
    v_.assign(static_cast<size_t>(m_), 0);
    row_of_col_.assign(static_cast<size_t>(m_), -1);
    col_of_row_.assign(static_cast<size_t>(rows), -1);
    Greedy();
    sets_.assign(static_cast<size_t>(all_) + 1, {});
    for (int32_t j = 0; j < m_; ++j) Insert(j);
    dist_col_.assign(static_cast<size_t>(m_), 0);
    col_epoch_.assign(static_cast<size_t>(m_), 0);
    popped_epoch_.assign(static_cast<size_t>(m_), 0);
    pred_row_.assign(static_cast<size_t>(m_), -1);
    dist_row_.assign(static_cast<size_t>(rows), 0);
    label_.assign(static_cast<size_t>(all_) + 1, 0);
    label_row_.assign(static_cast<size_t>(all_) + 1, -1);
    label_epoch_.assign(static_cast<size_t>(all_) + 1, 0);
    SparseAssignResult res;
    for (int32_t i = 0; i < rows; ++i) {
      if (col_of_row_[static_cast<size_t>(i)] >= 0) continue;
      ++res.augmentations;
      if (!Augment(i)) {
        return InternalError("sparse assignment: row " + std::to_string(i) +
                             " found no free column (columns >= rows is an invariant)");
      }
    }
    res.columns_scanned = scanned_;
    res.col_of_row.resize(static_cast<size_t>(rows));
    for (int32_t i = 0; i < rows; ++i) {
      const int32_t j = col_of_row_[static_cast<size_t>(i)];
      res.col_of_row[static_cast<size_t>(i)] = j < pb_.cols ? j : kDummy;
      res.total -= Cost(i, j);
    }
    return res;
  }

  // c(i, j) = -W(i, j), by scanning row i's entries (used for the result only).
  int64_t Cost(int32_t i, int32_t j) const { return j < pb_.cols ? -SparseWeight(pb_, i, j) : 0; }

 private:
  template <typename F>
  void ForLists(int32_t i, F&& f) const {
    for (int32_t l : pb_.row_lists[static_cast<size_t>(i)]) {
      if (l < 0) continue;
      for (int64_t e = pb_.list_begin[static_cast<size_t>(l)];
           e < pb_.list_begin[static_cast<size_t>(l) + 1]; ++e) {
        f(pb_.list_group[static_cast<size_t>(e)], pb_.list_w[static_cast<size_t>(e)]);
      }
    }
  }

  void Greedy() {
    std::vector<size_t> cursor(static_cast<size_t>(all_) + 1, 0);
    auto take_from = [&](int32_t g) -> int32_t {
      auto& mem = members_[static_cast<size_t>(g)];
      size_t& c = cursor[static_cast<size_t>(g)];
      while (c < mem.size() && row_of_col_[static_cast<size_t>(mem[c])] >= 0) ++c;
      return c < mem.size() ? mem[c] : -1;
    };
    for (int32_t i = 0; i < pb_.rows; ++i) {
      int64_t best = 0;
      for (int64_t e = pb_.direct_begin[static_cast<size_t>(i)];
           e < pb_.direct_begin[static_cast<size_t>(i) + 1]; ++e) {
        best = std::max(best, pb_.direct_w[static_cast<size_t>(e)]);
      }
      ForLists(i, [&](int32_t g, int64_t w) {
        if (!members_[static_cast<size_t>(g)].empty()) best = std::max(best, w);
      });
      u_[static_cast<size_t>(i)] = -best;
      int32_t pick = -1;
      if (best == 0) {
        pick = take_from(all_);
      } else {
        for (int64_t e = pb_.direct_begin[static_cast<size_t>(i)];
             e < pb_.direct_begin[static_cast<size_t>(i) + 1] && pick < 0; ++e) {
          const int32_t j = pb_.direct_col[static_cast<size_t>(e)];
          if (pb_.direct_w[static_cast<size_t>(e)] == best &&
              row_of_col_[static_cast<size_t>(j)] < 0) {
            pick = j;
          }
        }
        ForLists(i, [&](int32_t g, int64_t w) {
          if (pick < 0 && w == best) pick = take_from(g);
        });
      }
      if (pick >= 0) {
        col_of_row_[static_cast<size_t>(i)] = pick;
        row_of_col_[static_cast<size_t>(pick)] = i;
      }
    }
  }

  Key KeyOf(int32_t j) const {
    return {-v_[static_cast<size_t>(j)], uint8_t(row_of_col_[static_cast<size_t>(j)] >= 0 ? 1 : 0),
            j};
  }
  void Insert(int32_t j) {
    const Key k = KeyOf(j);
    for (int32_t g : groups_of_[static_cast<size_t>(j)]) sets_[static_cast<size_t>(g)].insert(k);
  }

  void PushGroup(int32_t g) {
    const auto& s = sets_[static_cast<size_t>(g)];
    if (s.empty() || label_epoch_[static_cast<size_t>(g)] != epoch_) return;
    const Key& k = *s.begin();
    heap_.push({label_[static_cast<size_t>(g)] + k.neg_v, k.matched, k.col, g});
  }

  void Lower(int32_t g, int64_t val, int32_t row) {
    if (label_epoch_[static_cast<size_t>(g)] == epoch_ && label_[static_cast<size_t>(g)] <= val)
      return;
    label_epoch_[static_cast<size_t>(g)] = epoch_;
    label_[static_cast<size_t>(g)] = val;
    label_row_[static_cast<size_t>(g)] = row;
    PushGroup(g);
  }

  void Relax(int32_t i) {
    const int64_t di = dist_row_[static_cast<size_t>(i)], ui = u_[static_cast<size_t>(i)];
    for (int64_t e = pb_.direct_begin[static_cast<size_t>(i)];
         e < pb_.direct_begin[static_cast<size_t>(i) + 1]; ++e) {
      const int32_t j = pb_.direct_col[static_cast<size_t>(e)];
      if (popped_epoch_[static_cast<size_t>(j)] == epoch_) continue;
      const int64_t nd =
          di - pb_.direct_w[static_cast<size_t>(e)] - ui - v_[static_cast<size_t>(j)];
      if (col_epoch_[static_cast<size_t>(j)] == epoch_ && dist_col_[static_cast<size_t>(j)] <= nd)
        continue;
      col_epoch_[static_cast<size_t>(j)] = epoch_;
      dist_col_[static_cast<size_t>(j)] = nd;
      pred_row_[static_cast<size_t>(j)] = i;
      heap_.push({nd, uint8_t(row_of_col_[static_cast<size_t>(j)] >= 0 ? 1 : 0), j, -1});
    }
    ForLists(i, [&](int32_t g, int64_t w) { Lower(g, di - w - ui, i); });
    Lower(all_, di - ui, i);
  }

  bool Augment(int32_t i0) {
    ++epoch_;
    heap_ = {};
    reached_.clear();
    popped_.clear();
    dist_row_[static_cast<size_t>(i0)] = 0;
    reached_.push_back(i0);
    Relax(i0);
    int32_t end = -1;
    int64_t big_d = 0;
    while (end < 0) {
      // Terminates: a free column exists (columns >= rows) and the all-columns group holds it.
      if (heap_.empty()) return false;
      const Entry e = heap_.top();
      heap_.pop();
      const size_t j = static_cast<size_t>(e.col);
      if (popped_epoch_[j] == epoch_) continue;
      int32_t pred = -1;
      if (e.group < 0) {
        if (col_epoch_[j] != epoch_ || dist_col_[j] != e.d) continue;
        pred = pred_row_[j];
      } else {
        const auto& s = sets_[static_cast<size_t>(e.group)];
        if (s.empty() || s.begin()->col != e.col ||
            label_[static_cast<size_t>(e.group)] + s.begin()->neg_v != e.d) {
          continue;
        }
        pred = label_row_[static_cast<size_t>(e.group)];
      }
      popped_epoch_[j] = epoch_;
      col_epoch_[j] = epoch_;
      dist_col_[j] = e.d;
      pred_row_[j] = pred;
      popped_.push_back(e.col);
      ++scanned_;
      const Key k = KeyOf(e.col);
      for (int32_t g : groups_of_[j]) {
        auto& s = sets_[static_cast<size_t>(g)];
        const bool first = s.begin()->col == e.col;
        s.erase(k);
        if (first) PushGroup(g);
      }
      const int32_t r = row_of_col_[j];
      if (r < 0) {
        end = e.col;
        big_d = e.d;
        break;
      }
      dist_row_[static_cast<size_t>(r)] = e.d;
      reached_.push_back(r);
      Relax(r);
    }
    for (int32_t i : reached_)
      u_[static_cast<size_t>(i)] += big_d - dist_row_[static_cast<size_t>(i)];
    for (int32_t j : popped_)
      v_[static_cast<size_t>(j)] -= big_d - dist_col_[static_cast<size_t>(j)];
    for (int32_t j = end;;) {
      const int32_t i = pred_row_[static_cast<size_t>(j)];
      const int32_t prev = col_of_row_[static_cast<size_t>(i)];
      col_of_row_[static_cast<size_t>(i)] = j;
      row_of_col_[static_cast<size_t>(j)] = i;
      if (i == i0) break;
      j = prev;
    }
    for (int32_t j : popped_) Insert(j);
    return true;
  }

  const SparseAssignProblem& pb_;
  int32_t m_ = 0, all_ = 0;
  std::vector<std::vector<int32_t>> groups_of_, members_;
  std::vector<int64_t> u_, v_;
  std::vector<int32_t> row_of_col_, col_of_row_;
  std::vector<std::set<Key>> sets_;
  // Per search (valid where the epoch matches).
  int64_t epoch_ = 0, scanned_ = 0;
  std::vector<int64_t> dist_col_, dist_row_, label_;
  std::vector<int64_t> col_epoch_, popped_epoch_, label_epoch_;
  std::vector<int32_t> pred_row_, label_row_, reached_, popped_;
  std::priority_queue<Entry> heap_;
};

}  // namespace

int64_t SparseWeight(const SparseAssignProblem& pb, int32_t row, int32_t col) {
  int64_t w = 0;
  const size_t i = static_cast<size_t>(row);
  for (int64_t e = pb.direct_begin[i]; e < pb.direct_begin[i + 1]; ++e) {
    if (pb.direct_col[static_cast<size_t>(e)] == col) {
      w = std::max(w, pb.direct_w[static_cast<size_t>(e)]);
    }
  }
  const size_t c = static_cast<size_t>(col);
  for (int32_t l : pb.row_lists[i]) {
    if (l < 0) continue;
    for (int64_t e = pb.list_begin[static_cast<size_t>(l)];
         e < pb.list_begin[static_cast<size_t>(l) + 1]; ++e) {
      const int32_t g = pb.list_group[static_cast<size_t>(e)];
      for (int64_t k = pb.col_group_begin[c]; k < pb.col_group_begin[c + 1]; ++k) {
        if (pb.col_group[static_cast<size_t>(k)] == g) {
          w = std::max(w, pb.list_w[static_cast<size_t>(e)]);
        }
      }
    }
  }
  return w;
}

StatusOr<SparseAssignResult> SolveSparseAssignment(const SparseAssignProblem& pb) {
  MORPH_RETURN_IF_ERROR(Validate(pb));
  int64_t max_w = 0;
  for (int64_t w : pb.direct_w) max_w = std::max(max_w, w);
  for (int64_t w : pb.list_w) max_w = std::max(max_w, w);
  // Each search moves a potential by at most max_w (D <= -u of a free row <= max_w), so
  // |u|, |v| <= (rows + 1) * max_w, and labels add at most two of those.
  if (static_cast<__int128>(max_w) * (pb.rows + 2) * 4 >= (static_cast<__int128>(1) << 62)) {
    return Bad("largest weight " + std::to_string(max_w) + " times (rows + 2) = " +
               std::to_string(pb.rows + 2) + " exceeds the exact int64 limit 2^60");
  }
  Solver s(pb);
  return s.Run();
}

}  // namespace morph::plan_internal
