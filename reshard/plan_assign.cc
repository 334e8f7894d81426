// The assignment of participants to new ranks: shard overlap counting, the sparse weight
// structure of a reconfiguration, and its exact solution (docs/reshard-planner.md §2.5).
#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <tuple>
#include <unordered_map>

#include "reshard/plan.h"
#include "reshard/plan_internal.h"
#include "reshard/sparse_assign.h"

namespace morph {
namespace plan_internal {

Shard ShardAt(const TensorSpec& spec, const ParallelConfig& config, int d, int t) {
  Shard s;
  s.frame = TpBoxOf(spec, config, t);
  const int64_t n = NumEl(s.frame);
  if (spec.layout.zero_sharded()) {
    const DpCut cut = DpCutOf(spec.layout, config, s.frame);
    const Interval r = cut.Range(d % cut.groups);
    s.flat_begin = r.begin;
    s.flat_end = r.end;
  } else {
    s.flat_end = n;
  }
  return s;
}

int64_t OverlapCount(const Shard& a, const Shard& b, const Box* state) {
  if (a.empty() || b.empty()) return 0;
  if (state != nullptr && state->Contains(a.frame)) state = nullptr;  // no padding in a
  if (a.frame == b.frame && state == nullptr) {
    return Intersect(Interval{a.flat_begin, a.flat_end}, Interval{b.flat_begin, b.flat_end}).size();
  }
  if (NumEl(Intersect(a.frame, b.frame)) == 0) return 0;
  const std::vector<Box> bb = ShardBoxes(b);
  int64_t n = 0;
  for (const Box& x : ShardBoxes(a)) {
    const Box xs = state ? Intersect(x, *state) : x;
    if (NumEl(xs) == 0) continue;
    for (const Box& y : bb) n += NumEl(Intersect(xs, y));
  }
  return n;
}

namespace {

// Rows [r0, r1) of the [outer, split dim, inner] view, each holding in-row positions [x0, x1)
// (position = split index * inner + inner index).
struct Piece {
  int64_t r0, r1, x0, x1;
};

int PiecesUnclipped(Interval r, int64_t w, int64_t c0, int64_t inner, Piece* out) {
  if (r.empty()) return 0;
  const int64_t row = w * inner, base = c0 * inner;
  const int64_t a = r.begin / row, b = (r.end - 1) / row;
  if (a == b) {
    out[0] = {a, a + 1, base + (r.begin - a * row), base + (r.end - a * row)};
    return 1;
  }
  int n = 0;
  out[n++] = {a, a + 1, base + (r.begin - a * row), base + row};
  if (b > a + 1) out[n++] = {a + 1, b, base, base + row};
  out[n++] = {b, b + 1, base, base + (r.end - b * row)};
  return n;
}

// `limit`: in-row positions at or past it are padding (dropped).
int Pieces(Interval r, int64_t w, int64_t c0, int64_t inner, int64_t limit, Piece* out) {
  const int n = PiecesUnclipped(r, w, c0, inner, out);
  int m = 0;
  for (int i = 0; i < n; ++i) {
    out[i].x1 = std::min(out[i].x1, limit);
    if (out[i].x0 < out[i].x1) out[m++] = out[i];
  }
  return m;
}

// The [outer, split dim, inner] view of a TP-split tensor: its split dim's logical length and
// where padding starts (in-row position).
struct SplitView {
  int64_t outer = 1, inner = 1, len = 0, limit = 0;
  explicit SplitView(const TensorSpec& spec) {
    const size_t k = static_cast<size_t>(spec.layout.tp_dim());
    for (size_t i = 0; i < k; ++i) outer *= spec.shape[i];
    for (size_t i = k + 1; i < spec.shape.size(); ++i) inner *= spec.shape[i];
    len = spec.shape[k];
    limit = len * inner;
  }
};

// A DP-sharded TP-local piece of a split tensor in the split view: its slice of the split dim
// (width w, from c0; ChunkTP slices differ in width) and its DP range index r's flat range.
struct SplitPiece {
  int64_t w = 0, c0 = 0;
  Interval range;
  SplitPiece(const TensorSpec& spec, const SplitView& v, const ParallelConfig& c, int d, int t) {
    const Interval slice = TpSlice(spec, c, t);
    w = slice.size();
    c0 = slice.begin;
    const int64_t rows = spec.layout.tp_dim() == 0 ? w : spec.shape[0];  // of dimension 0
    const DpCut cut = DpCutOf(spec.layout, c, v.outer * w * v.inner, rows);
    range = cut.Range(d % cut.groups);
  }
};

}  // namespace

DpSpan ZeroSplitSpan(const TensorSpec& spec, const ParallelConfig& oc, int d, int t,
                     const ParallelConfig& nc, int tn) {
  const SplitView v(spec);
  const int64_t inner = v.inner;
  const SplitPiece po(spec, v, oc, d, t);
  Piece a[3];
  const int na = Pieces(po.range, po.w, po.c0, inner, v.limit, a);
  const Interval sn = TpSlice(spec, nc, tn);
  const int64_t wn = sn.size();
  const int64_t lo = sn.begin * inner, hi = lo + wn * inner;  // new frame's in-row positions
  int64_t first = -1, last = -1;                              // flat positions in the new frame
  for (int i = 0; i < na; ++i) {
    const int64_t x0 = std::max(a[i].x0, lo), x1 = std::min(a[i].x1, hi);
    if (x0 >= x1) continue;
    const int64_t f = a[i].r0 * wn * inner + (x0 - lo);
    const int64_t l = (a[i].r1 - 1) * wn * inner + (x1 - 1 - lo);
    if (first < 0 || f < first) first = f;
    last = std::max(last, l);
  }
  if (first < 0) return {};
  const int64_t rows = spec.layout.tp_dim() == 0 ? wn : spec.shape[0];
  return DpCutOf(spec.layout, nc, v.outer * wn * inner, rows).RanksOf({first, last + 1});
}

int64_t ZeroSplitOverlap(const TensorSpec& spec, const ParallelConfig& oc, int d, int t,
                         const ParallelConfig& nc, int dn, int tn) {
  const SplitView v(spec);
  const SplitPiece po(spec, v, oc, d, t), pn(spec, v, nc, dn, tn);
  Piece a[3], b[3];
  const int na = Pieces(po.range, po.w, po.c0, v.inner, v.limit, a);
  const int nb = Pieces(pn.range, pn.w, pn.c0, v.inner, v.limit, b);
  int64_t n = 0;
  for (int i = 0; i < na; ++i) {
    for (int j = 0; j < nb; ++j) {
      const int64_t rows = std::min(a[i].r1, b[j].r1) - std::max(a[i].r0, b[j].r0);
      const int64_t xs = std::min(a[i].x1, b[j].x1) - std::max(a[i].x0, b[j].x0);
      if (rows > 0 && xs > 0) n += rows * xs;
    }
  }
  return n;
}

std::vector<int> Hungarian(const std::vector<std::vector<int64_t>>& cost) {
  // The classic potentials formulation (rows 1..n, columns 1..m, column 0 is a sentinel).
  const int n = static_cast<int>(cost.size());
  const int m = n ? static_cast<int>(cost[0].size()) : 0;
  const int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> u(static_cast<size_t>(n) + 1, 0), v(static_cast<size_t>(m) + 1, 0);
  std::vector<int> p(static_cast<size_t>(m) + 1, 0), way(static_cast<size_t>(m) + 1, 0);
  std::vector<int64_t> minv(static_cast<size_t>(m) + 1);
  std::vector<char> used(static_cast<size_t>(m) + 1);
  for (int i = 1; i <= n; ++i) {
    p[0] = i;
    int j0 = 0;
    std::fill(minv.begin(), minv.end(), kInf);
    std::fill(used.begin(), used.end(), 0);
    do {
      used[static_cast<size_t>(j0)] = 1;
      const int i0 = p[static_cast<size_t>(j0)];
      int64_t delta = kInf;
      int j1 = 0;
      for (int j = 1; j <= m; ++j) {
        if (used[static_cast<size_t>(j)]) continue;
        const int64_t cur = cost[static_cast<size_t>(i0 - 1)][static_cast<size_t>(j - 1)] -
                            u[static_cast<size_t>(i0)] - v[static_cast<size_t>(j)];
        if (cur < minv[static_cast<size_t>(j)]) {
          minv[static_cast<size_t>(j)] = cur;
          way[static_cast<size_t>(j)] = j0;
        }
        if (minv[static_cast<size_t>(j)] < delta) {
          delta = minv[static_cast<size_t>(j)];
          j1 = j;
        }
      }
      for (int j = 0; j <= m; ++j) {
        if (used[static_cast<size_t>(j)]) {
          u[static_cast<size_t>(p[static_cast<size_t>(j)])] += delta;
          v[static_cast<size_t>(j)] -= delta;
        } else {
          minv[static_cast<size_t>(j)] -= delta;
        }
      }
      j0 = j1;
    } while (p[static_cast<size_t>(j0)] != 0);
    do {
      const int j1 = way[static_cast<size_t>(j0)];
      p[static_cast<size_t>(j0)] = p[static_cast<size_t>(j1)];
      j0 = j1;
    } while (j0 != 0);
  }
  std::vector<int> col(static_cast<size_t>(n), -1);
  for (int j = 1; j <= m; ++j) {
    if (p[static_cast<size_t>(j)] > 0)
      col[static_cast<size_t>(p[static_cast<size_t>(j)] - 1)] = j - 1;
  }
  return col;
}

}  // namespace plan_internal

namespace {

using plan_internal::NumEl;
using plan_internal::OverlapCount;
using plan_internal::ShardAt;
using plan_internal::SparseAssignProblem;

// New TP (or DP) indices whose fraction [t/a, (t+1)/a) overlaps old index t's: [first, last].
std::pair<int, int> FractionOverlap(int t, int a, int b) {
  const int64_t lo = int64_t{t} * b, hi = int64_t{t + 1} * b;
  return {static_cast<int>(lo / a), static_cast<int>((hi + a - 1) / a - 1)};
}

// The resident bytes of one (old stage, new stage) pair, split by what they depend on:
//   W(q, s) = w1 + w2(t, t') + w3(d, d') + w4(d, t, d', t')
// w1: replicated unsplit classes (constant), w2: replicated TP-split classes, w3: unsplit ZeRO
// classes, w4: TP-split ZeRO classes. Every part is exact integer arithmetic.
class PairWeights {
 public:
  PairWeights(const Planner::Classes& cl, const ParallelConfig& oc, const ParallelConfig& nc,
              const std::vector<std::pair<int, int64_t>>& group)
      : cl_(cl), oc_(oc), nc_(nc) {
    for (const auto& [cls, count] : group) {
      const auto& k = cl.classes[static_cast<size_t>(cls)];
      if (k.elems == 0) continue;
      const bool split = k.rep.layout.tp_split(), zero = k.rep.layout.zero_sharded();
      const int64_t bytes = count * k.elem;
      padded_ |= k.rep.layout.pad_multiple() > 0 || k.rep.layout.tp_chunked();
      if (!split && !zero) w1_ += bytes * k.elems;
      if (split && !zero) rep_split_.push_back({&k, bytes});
      if (!split && zero) zero_unsplit_.push_back({&k, bytes});
      if (split && zero) zero_split_.push_back({&k, bytes});
    }
  }
  int64_t W1() const { return w1_; }
  // TP indices of `to` whose slices may overlap the state of index t's slice of `from`: the
  // fraction overlap (equal logical lengths), widened by each padded or ChunkTP class's own
  // overlap (its slice widths, P/tp or ceil(L/tp), are not L/tp). A hull: indices without
  // overlap get weight 0.
  std::pair<int, int> TpRange(int t, const ParallelConfig& from, const ParallelConfig& to) const {
    std::pair<int, int> r = FractionOverlap(t, from.tp, to.tp);
    if (!padded_) return r;
    for (const auto* parts : {&rep_split_, &zero_split_}) {
      for (const auto& [k, bytes] : *parts) {
        if (k->rep.layout.pad_multiple() <= 0 && !k->rep.layout.tp_chunked()) continue;
        const int64_t len = k->rep.shape[static_cast<size_t>(k->rep.layout.tp_dim())];
        const int64_t sf = TpSliceWidth(k->rep, from);
        const int64_t st = TpSliceWidth(k->rep, to);
        const int64_t lo = sf * t, hi = std::min(sf * (t + 1), len);
        if (lo >= hi) continue;
        r.first = std::min(r.first, static_cast<int>(lo / st));
        r.second = std::max(r.second, static_cast<int>((hi - 1) / st));
      }
    }
    r.first = std::max(r.first, 0);
    r.second = std::min(r.second, to.tp - 1);
    return r;
  }
  bool HasW2() const { return !rep_split_.empty(); }
  bool HasW3() const { return !zero_unsplit_.empty(); }
  bool HasW4() const { return !zero_split_.empty(); }

  int64_t W2(int t, int tn) const {
    int64_t w = 0;
    for (const auto& [k, bytes] : rep_split_) {
      const int64_t len = k->rep.shape[static_cast<size_t>(k->rep.layout.tp_dim())];
      const int64_t so = TpSliceWidth(k->rep, oc_), sn = TpSliceWidth(k->rep, nc_);
      if (len == 0) continue;
      w += bytes * (k->elems / len) *
           Intersect(Intersect(Interval{so * t, so * (t + 1)}, Interval{sn * tn, sn * (tn + 1)}),
                     Interval{0, len})
               .size();
    }
    return w;
  }
  int64_t W3(int d, int dn) const {
    int64_t w = 0;
    for (const auto& [k, bytes] : zero_unsplit_) {
      const DpCut co = Cut(*k, oc_), cn = Cut(*k, nc_);
      w += bytes * Intersect(co.Range(d % co.groups), cn.Range(dn % cn.groups)).size();
    }
    return w;
  }
  int64_t W4(int d, int t, int dn, int tn) const {
    int64_t w = 0;
    for (const auto& [k, bytes] : zero_split_) {
      w += bytes * plan_internal::ZeroSplitOverlap(k->rep, oc_, d, t, nc_, dn, tn);
    }
    return w;
  }
  // New DP ranks whose unsplit ZeRO ranges overlap old DP rank d's, ascending, each once
  // (per class a span; classes of different sizes sit at different places).
  void Span3(int d, std::vector<int>& out) const {
    out.clear();
    for (const auto& [k, bytes] : zero_unsplit_) {
      const DpCut co = Cut(*k, oc_), cn = Cut(*k, nc_);
      const int gn = cn.groups;
      const DpSpan s = cn.RanksOf(co.Range(d % co.groups));
      for (int g = s.first; g <= s.last; ++g) {
        for (int dn = g; dn < nc_.dp; dn += gn) out.push_back(dn);  // hybrid: every replica
      }
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  }
  // Appends (tn, dn) for the new DP ranks of new TP rank tn that a split ZeRO shard of old
  // (d, t) touches (per class, a hull of that class's shard; duplicates possible).
  void Span4(int d, int t, int tn, std::vector<std::pair<int, int>>& out) const {
    for (const auto& [k, bytes] : zero_split_) {
      const int gn = ZeroGroupSize(k->rep.layout, nc_);
      const DpSpan s = plan_internal::ZeroSplitSpan(k->rep, oc_, d, t, nc_, tn);
      for (int g = s.first; g <= s.last; ++g) {
        for (int dn = g; dn < nc_.dp; dn += gn) out.push_back({tn, dn});
      }
    }
  }

 private:
  using Part = std::pair<const Planner::Classes::Class*, int64_t>;  // class, bytes/element
  // The DP cut of an unsplit class (its piece is the whole tensor).
  static DpCut Cut(const Planner::Classes::Class& k, const ParallelConfig& c) {
    return DpCutOf(k.rep.layout, c, k.elems, k.rep.shape.empty() ? 1 : k.rep.shape[0]);
  }
  const Planner::Classes& cl_;
  const ParallelConfig& oc_;
  const ParallelConfig& nc_;
  int64_t w1_ = 0;
  bool padded_ = false;
  std::vector<Part> rep_split_, zero_unsplit_, zero_split_;
};

// One direct entry of an old (d, t) towards a new (d', t') of a stage pair.
struct Direct {
  int dn, tn;
  int64_t w;
};

// The direct entries of old (d, t) for a stage pair: every new (d', t') where
// W > w1 + max(w2, w3) (only there does W exceed what the group entries give).
std::vector<Direct> DirectEntries(const PairWeights& pw, const ParallelConfig& oc,
                                  const ParallelConfig& nc, int d, int t) {
  std::vector<std::pair<int, int>> cand;  // (tn, dn)
  const auto [t0, t1] = pw.TpRange(t, oc, nc);
  if (pw.HasW2() && pw.HasW3()) {
    std::vector<int> s3;
    pw.Span3(d, s3);
    for (int tn = t0; tn <= t1; ++tn) {
      for (int dn : s3) cand.push_back({tn, dn});
    }
  }
  if (pw.HasW4()) {
    for (int tn = t0; tn <= t1; ++tn) pw.Span4(d, t, tn, cand);
  }
  std::sort(cand.begin(), cand.end());
  cand.erase(std::unique(cand.begin(), cand.end()), cand.end());
  std::vector<Direct> out;
  for (const auto& [tn, dn] : cand) {
    const int64_t w2 = pw.HasW2() ? pw.W2(t, tn) : 0, w3 = pw.HasW3() ? pw.W3(d, dn) : 0;
    const int64_t w4 = pw.HasW4() ? pw.W4(d, t, dn, tn) : 0;
    if (w2 + w3 + w4 > std::max(w2, w3)) out.push_back({dn, tn, pw.W1() + w2 + w3 + w4});
  }
  return out;
}

int Find(std::vector<int>& parent, int x) {
  while (parent[static_cast<size_t>(x)] != x) {
    parent[static_cast<size_t>(x)] = parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
    x = parent[static_cast<size_t>(x)];
  }
  return x;
}

}  // namespace

Status Planner::SolveAssignment(std::vector<int32_t>& out) const {
  const ParallelConfig& oc = in_->old_config;
  const ParallelConfig& nc = in_->new_config;
  const Classes& cl = *classes_;
  const int world = nc.world();
  const size_t po = static_cast<size_t>(oc.pp), pn = static_cast<size_t>(nc.pp);
  // Stage pairs that hold a tensor, their weights (shared by equal groups), and the
  // components: old stage p and new stage p' are joined when a tensor lives on both. No
  // positive weight crosses components, so they are solved independently.
  std::vector<std::unique_ptr<PairWeights>> weights_of_gid;
  std::vector<const PairWeights*> pair(po * pn, nullptr);
  std::vector<int> parent(po + pn);
  std::iota(parent.begin(), parent.end(), 0);
  std::vector<std::vector<int>> old_stages_of_new(pn);
  for (const auto& [stages, group] : cl.groups) {
    const size_t i = static_cast<size_t>(stages.first) * pn + static_cast<size_t>(stages.second);
    const size_t gid = static_cast<size_t>(cl.group_id[i]);
    if (weights_of_gid.size() <= gid) weights_of_gid.resize(gid + 1);
    if (!weights_of_gid[gid])
      weights_of_gid[gid] = std::make_unique<PairWeights>(cl, oc, nc, group);
    pair[i] = weights_of_gid[gid].get();
    parent[static_cast<size_t>(Find(parent, stages.first))] =
        Find(parent, static_cast<int>(po) + stages.second);
    old_stages_of_new[static_cast<size_t>(stages.second)].push_back(stages.first);
  }
  // Columns: available survivors, by component of their old stage (ascending participant id).
  std::vector<std::vector<int32_t>> cols_of(po + pn);
  for (int32_t q : in_->available) {
    const int32_t r = assignment_.old_rank_of_participant[static_cast<size_t>(q)];
    if (r < 0) continue;
    cols_of[static_cast<size_t>(Find(parent, oc.CoordsOf(r).p))].push_back(q);
  }
  std::vector<std::vector<int>> new_stages_of(po + pn);
  for (int p = 0; p < nc.pp; ++p) {
    new_stages_of[static_cast<size_t>(Find(parent, static_cast<int>(po) + p))].push_back(p);
  }
  // Group ids per old (p), (p, t), (p, d) and list ids per new (p'), (p', t'), (p', d'): local
  // to a component, stored in arrays indexed globally (a stage is in one component only).
  std::vector<int32_t> g1(po, -1), g2(po * static_cast<size_t>(oc.tp), -1),
      g3(po * static_cast<size_t>(oc.dp), -1);
  std::vector<int32_t> row_of_rank(static_cast<size_t>(world), -1);
  // Direct entries memoized by (group id, old d, old t): stages with equal groups share them.
  std::unordered_map<uint64_t, std::vector<Direct>> direct_memo;
  const uint64_t dt_cells = uint64_t(oc.dp) * uint64_t(oc.tp);
  // Hybrid ZeRO: every weight depends on DP ranks only through d mod lo and d' mod ln (the lcm of
  // the classes' ZeRO range counts; plain ZeRO counts dp). When ln < new dp, the new ranks of a
  // cell (p', t', d' mod ln) share one list of what would be direct entries, keyed by old groups
  // (p, t, d mod lo): without it, every old rank would list every replica of its ranges (dense in
  // dp). Same weights either way: W = max(lists, direct).
  int lo = 1, ln = 1;
  bool any_zero = false;
  for (const auto& k : cl.classes) {
    if (!k.rep.layout.zero_sharded()) continue;
    any_zero = true;
    lo = std::lcm(lo, ZeroGroupSize(k.rep.layout, oc));
    ln = std::lcm(ln, ZeroGroupSize(k.rep.layout, nc));
  }
  const bool share = any_zero && ln < nc.dp;
  std::vector<int32_t> g4(share ? po * size_t(oc.tp) * size_t(lo) : 0, -1);
  auto direct_of = [&](size_t pi, int d, int t) -> const std::vector<Direct>& {
    const uint64_t key =
        uint64_t(cl.group_id[pi]) * dt_cells + uint64_t(d) * uint64_t(oc.tp) + uint64_t(t);
    auto [it, fresh] = direct_memo.try_emplace(key);
    if (fresh) it->second = DirectEntries(*pair[pi], oc, nc, d, t);
    return it->second;
  };

  for (size_t comp = 0; comp < po + pn; ++comp) {
    const std::vector<int>& stages = new_stages_of[comp];
    const std::vector<int32_t>& cols = cols_of[comp];
    if (stages.empty() || cols.empty()) continue;  // no positive weight: completion below
    SparseAssignProblem pb;
    std::vector<int32_t> rank_of_row;
    for (int p : stages) {
      for (int s = nc.RankOf({p, 0, 0}); s < nc.RankOf({p + 1, 0, 0}); ++s) {
        row_of_rank[static_cast<size_t>(s)] = static_cast<int32_t>(rank_of_row.size());
        rank_of_row.push_back(s);
      }
    }
    pb.rows = static_cast<int32_t>(rank_of_row.size());
    pb.cols = static_cast<int32_t>(cols.size());
    // Entry lists of the new cells, and the groups they name.
    int32_t groups = 0;
    auto group_id = [&](int32_t& slot) {
      if (slot < 0) slot = groups++;
      return slot;
    };
    pb.list_begin.push_back(0);
    auto close_list = [&]() -> int32_t {
      const int64_t b = pb.list_begin.back();
      if (static_cast<int64_t>(pb.list_group.size()) == b) return -1;
      pb.list_begin.push_back(static_cast<int64_t>(pb.list_group.size()));
      return static_cast<int32_t>(pb.list_begin.size()) - 2;
    };
    auto add = [&](int32_t g, int64_t w) {
      pb.list_group.push_back(g);
      pb.list_w.push_back(w);
    };
    pb.row_lists.assign(static_cast<size_t>(pb.rows), {-1, -1, -1, -1});
    for (int pnew : stages) {
      const auto& olds = old_stages_of_new[static_cast<size_t>(pnew)];
      auto pw_of = [&](int pold) { return pair[static_cast<size_t>(pold) * pn + size_t(pnew)]; };
      for (int pold : olds) {
        if (pw_of(pold)->W1() > 0) add(group_id(g1[static_cast<size_t>(pold)]), pw_of(pold)->W1());
      }
      const int32_t l1 = close_list();
      for (int tn = 0; tn < nc.tp; ++tn) {
        for (int pold : olds) {
          const PairWeights& pw = *pw_of(pold);
          if (!pw.HasW2()) continue;
          const auto [t0, t1] = pw.TpRange(tn, nc, oc);
          for (int t = t0; t <= t1; ++t) {
            const int64_t w2 = pw.W2(t, tn);
            if (w2 > 0) {
              add(group_id(g2[static_cast<size_t>(pold) * size_t(oc.tp) + size_t(t)]),
                  pw.W1() + w2);
            }
          }
        }
        const int32_t l2 = close_list();
        for (int dn = 0; dn < nc.dp; ++dn) {
          auto& ls =
              pb.row_lists[static_cast<size_t>(row_of_rank[size_t(nc.RankOf({pnew, dn, tn}))])];
          ls[0] = l1;
          ls[1] = l2;
        }
      }
      // Unsplit ZeRO: old (p, d) towards new (p', d'), collected per new d'.
      std::vector<std::vector<std::pair<int32_t, int64_t>>> per_dn(static_cast<size_t>(nc.dp));
      for (int pold : olds) {
        const PairWeights& pw = *pw_of(pold);
        if (!pw.HasW3()) continue;
        std::vector<int> s3;
        for (int d = 0; d < oc.dp; ++d) {
          pw.Span3(d, s3);
          for (int dn : s3) {
            const int64_t w3 = pw.W3(d, dn);
            if (w3 > 0) {
              per_dn[static_cast<size_t>(dn)].push_back(
                  {group_id(g3[static_cast<size_t>(pold) * size_t(oc.dp) + size_t(d)]),
                   pw.W1() + w3});
            }
          }
        }
      }
      for (int dn = 0; dn < nc.dp; ++dn) {
        for (const auto& [g, w] : per_dn[static_cast<size_t>(dn)]) add(g, w);
        const int32_t l3 = close_list();
        for (int tn = 0; tn < nc.tp; ++tn) {
          pb.row_lists[static_cast<size_t>(row_of_rank[size_t(nc.RankOf({pnew, dn, tn}))])][2] = l3;
        }
      }
      if (share) {  // the shared cell lists (see above), from representatives d < lo, d' < ln
        std::vector<std::vector<std::pair<int32_t, int64_t>>> per_cell(size_t(nc.tp) * size_t(ln));
        for (int pold : olds) {
          const size_t pi = static_cast<size_t>(pold) * pn + static_cast<size_t>(pnew);
          for (int t = 0; t < oc.tp; ++t) {
            for (int dm = 0; dm < lo; ++dm) {
              for (const Direct& e : direct_of(pi, dm, t)) {
                if (e.dn >= ln) continue;
                const size_t gi =
                    (size_t(pold) * size_t(oc.tp) + size_t(t)) * size_t(lo) + size_t(dm);
                per_cell[size_t(e.tn) * size_t(ln) + size_t(e.dn)].push_back(
                    {group_id(g4[gi]), e.w});
              }
            }
          }
        }
        for (int tn = 0; tn < nc.tp; ++tn) {
          for (int dm = 0; dm < ln; ++dm) {
            for (const auto& [g, w] : per_cell[size_t(tn) * size_t(ln) + size_t(dm)]) add(g, w);
            const int32_t l4 = close_list();
            for (int dn = dm; dn < nc.dp; dn += ln) {
              pb.row_lists[static_cast<size_t>(row_of_rank[size_t(nc.RankOf({pnew, dn, tn}))])][3] =
                  l4;
            }
          }
        }
      }
    }
    pb.num_groups = groups;
    // Columns: their groups, and their direct entries (collected per row).
    std::vector<std::vector<std::pair<int32_t, int64_t>>> direct(static_cast<size_t>(pb.rows));
    pb.col_group_begin.push_back(0);
    for (size_t j = 0; j < cols.size(); ++j) {
      const auto o = oc.CoordsOf(assignment_.old_rank_of_participant[static_cast<size_t>(cols[j])]);
      const int32_t g4j =
          share ? g4[(size_t(o.p) * size_t(oc.tp) + size_t(o.t)) * size_t(lo) + size_t(o.d % lo)]
                : -1;
      for (int32_t g : {g1[size_t(o.p)], g2[size_t(o.p) * size_t(oc.tp) + size_t(o.t)],
                        g3[size_t(o.p) * size_t(oc.dp) + size_t(o.d)], g4j}) {
        if (g >= 0) pb.col_group.push_back(g);
      }
      pb.col_group_begin.push_back(static_cast<int64_t>(pb.col_group.size()));
      if (share) continue;  // its direct entries are in the shared cell lists
      for (int pnew : cl.new_stages_of_old[static_cast<size_t>(o.p)]) {
        const size_t pi = static_cast<size_t>(o.p) * pn + static_cast<size_t>(pnew);
        for (const Direct& e : direct_of(pi, o.d, o.t)) {
          const int32_t row = row_of_rank[static_cast<size_t>(nc.RankOf({pnew, e.dn, e.tn}))];
          direct[static_cast<size_t>(row)].push_back({static_cast<int32_t>(j), e.w});
        }
      }
    }
    pb.direct_begin.push_back(0);
    for (const auto& es : direct) {  // columns ascending already (j increases)
      for (const auto& [j, w] : es) {
        pb.direct_col.push_back(j);
        pb.direct_w.push_back(w);
      }
      pb.direct_begin.push_back(static_cast<int64_t>(pb.direct_col.size()));
    }
    MORPH_ASSIGN_OR_RETURN(plan_internal::SparseAssignResult res,
                           plan_internal::SolveSparseAssignment(pb));
    for (size_t i = 0; i < rank_of_row.size(); ++i) {
      const int32_t j = res.col_of_row[i];
      if (j != plan_internal::kDummy) out[static_cast<size_t>(rank_of_row[i])] = cols[size_t(j)];
    }
  }
  // Completion: ranks with no positive-weight partner take the unused participants in id
  // order (weight 0 either way: a positive pair left unmatched would contradict optimality).
  std::vector<char> taken(static_cast<size_t>(in_->num_participants), 0);
  for (int32_t q : out) {
    if (q >= 0) taken[static_cast<size_t>(q)] = 1;
  }
  size_t next = 0;
  for (int s = 0; s < world; ++s) {
    if (out[static_cast<size_t>(s)] >= 0) continue;
    while (taken[static_cast<size_t>(in_->available[next])]) ++next;
    out[static_cast<size_t>(s)] = in_->available[next];
    taken[static_cast<size_t>(in_->available[next])] = 1;
  }
  return Status();
}

}  // namespace morph
