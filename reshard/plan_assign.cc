// The assignment of participants to new ranks: shard overlap counting, the exact method
// (Hungarian) and the structured greedy for large worlds (docs/reshard-planner.md).
#include <algorithm>
#include <deque>
#include <limits>
#include <tuple>

#include "reshard/plan.h"
#include "reshard/plan_internal.h"

namespace morph {
namespace plan_internal {

Shard ShardAt(const TensorSpec& spec, const ParallelConfig& config, int d, int t) {
  Shard s;
  s.frame = TpBoxOf(spec, config, t);
  const int64_t n = NumEl(s.frame);
  if (spec.layout.zero_sharded()) {
    const Interval r = ZeroRange(n, config.dp, d);
    s.flat_begin = r.begin;
    s.flat_end = r.end;
  } else {
    s.flat_end = n;
  }
  return s;
}

int64_t OverlapCount(const Shard& a, const Shard& b) {
  if (a.empty() || b.empty()) return 0;
  if (a.frame == b.frame) {
    return Intersect(Interval{a.flat_begin, a.flat_end}, Interval{b.flat_begin, b.flat_end}).size();
  }
  if (NumEl(Intersect(a.frame, b.frame)) == 0) return 0;
  const std::vector<Box> bb = ShardBoxes(b);
  int64_t n = 0;
  for (const Box& x : ShardBoxes(a)) {
    for (const Box& y : bb) n += NumEl(Intersect(x, y));
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

using Weight = __int128;

// Resident bytes of old rank `o` at new rank `c`, times U = tp*dp*tp'*dp', with every shard
// replaced by its ideal fraction of the tensor: a TP slice is [t/tp, (t+1)/tp) of its split
// dimension; a ZeRO range [d/dp, (d+1)/dp) of the TP-local piece's row-major order is that
// fraction of the TP slice when the split dimension is 0 (both cut the same axis) and of
// dimension 0 otherwise. Exact for replicated tensors; for ZeRO tensors exact up to rounding
// to whole rows and the ceil-division padding. O(classes) integer arithmetic, no allocation.
Weight ApproxWeight(const Planner::Classes& cl, const ParallelConfig& oc, const ParallelConfig& nc,
                    ParallelConfig::Coords o, ParallelConfig::Coords c) {
  auto it = cl.groups.find({o.p, c.p});
  if (it == cl.groups.end()) return 0;
  const int64_t tt = int64_t{oc.tp} * nc.tp, dd = int64_t{oc.dp} * nc.dp;
  // Overlap of [a/n, (a+1)/n) and [b/m, (b+1)/m), in units of 1/(n*m).
  auto frac = [](int64_t a, int64_t n, int64_t b, int64_t m) {
    return Intersect(Interval{a * m, (a + 1) * m}, Interval{b * n, (b + 1) * n}).size();
  };
  Weight w = 0;
  for (const auto& [cls, count] : it->second) {
    const TensorSpec& spec = cl.classes[static_cast<size_t>(cls)].rep;
    int64_t elems = 1;
    for (int64_t d : spec.shape) elems *= d;
    if (elems == 0) continue;
    const bool split = spec.layout.tp_split(), zero = spec.layout.zero_sharded();
    Weight units;  // of 1/U
    if (split && zero && spec.layout.tp_dim() == 0) {
      units = frac(int64_t{o.t} * oc.dp + o.d, oc.tp * int64_t{oc.dp}, int64_t{c.t} * nc.dp + c.d,
                   nc.tp * int64_t{nc.dp});
    } else {
      units = Weight(split ? frac(o.t, oc.tp, c.t, nc.tp) : tt) *
              (zero ? frac(o.d, oc.dp, c.d, nc.dp) : dd);
    }
    w += Weight(count) * cl.classes[static_cast<size_t>(cls)].elem * elems * units;
  }
  return w;
}

// New TP ranks whose slice overlaps old TP rank t's: [first, last].
std::pair<int, int> TpOverlap(int t, int tp_old, int tp_new) {
  const int64_t a = int64_t{t} * tp_new, b = int64_t{t + 1} * tp_new;
  return {static_cast<int>(a / tp_old), static_cast<int>((b + tp_old - 1) / tp_old - 1)};
}

}  // namespace

void Planner::StructuredAssign(std::vector<int32_t>& out) const {
  const ParallelConfig& oc = in_->old_config;
  const ParallelConfig& nc = in_->new_config;
  const Classes& cl = *classes_;
  const int world = nc.world();
  std::vector<char> taken(static_cast<size_t>(in_->num_participants), 0);
  std::vector<int32_t> survivors;
  for (int32_t q : in_->available) {
    if (assignment_.old_rank_of_participant[static_cast<size_t>(q)] >= 0) survivors.push_back(q);
  }
  struct Edge {
    Weight w;
    int s;
    int32_t q;
  };
  auto by_weight = [](const Edge& a, const Edge& b) {
    if (a.w != b.w) return a.w > b.w;
    return std::tie(a.s, a.q) < std::tie(b.s, b.q);
  };
  // Phase 1: each survivor's natural targets (overlapping TP slices, fractionally overlapping
  // DP ranks, its own DP index), greedy by weight: a 1/2-approximation on these edges.
  std::vector<Edge> edges;
  for (int32_t q : survivors) {
    const auto o = oc.CoordsOf(assignment_.old_rank_of_participant[static_cast<size_t>(q)]);
    const auto [t0, t1] = TpOverlap(o.t, oc.tp, nc.tp);
    const auto [d0, d1] = TpOverlap(o.d, oc.dp, nc.dp);
    for (int p : cl.new_stages_of_old[static_cast<size_t>(o.p)]) {
      for (int t = t0; t <= t1; ++t) {
        auto add = [&](int d) {
          const int s = nc.RankOf({p, d, t});
          const Weight w = ApproxWeight(cl, oc, nc, o, {p, d, t});
          if (w > 0) edges.push_back({w, s, q});
        };
        for (int d = d0; d <= d1; ++d) add(d);
        if (o.d < nc.dp && (o.d < d0 || o.d > d1)) add(o.d);
        // ZeRO pieces split on dimension 0: the DP ranks of TP rank t whose ranges cover the
        // same rows (the TP slice and the ZeRO range cut the same axis).
        const auto [c0, c1] = TpOverlap(o.t * oc.dp + o.d, oc.tp * oc.dp, nc.tp * nc.dp);
        for (int x = std::max(c0, t * nc.dp); x <= std::min(c1, t * nc.dp + nc.dp - 1); ++x) {
          const int d = x - t * nc.dp;
          if ((d < d0 || d > d1) && d != o.d) add(d);
        }
      }
    }
  }
  std::sort(edges.begin(), edges.end(), by_weight);
  for (const Edge& e : edges) {
    if (out[static_cast<size_t>(e.s)] >= 0 || taken[static_cast<size_t>(e.q)]) continue;
    out[static_cast<size_t>(e.s)] = e.q;
    taken[static_cast<size_t>(e.q)] = 1;
  }
  // Phase 2: leftover survivors to leftover ranks of the (stage, TP rank) cells they overlap.
  std::vector<std::deque<int>> cell(static_cast<size_t>(nc.pp) * nc.tp);
  for (int s = 0; s < world; ++s) {
    if (out[static_cast<size_t>(s)] >= 0) continue;
    const auto c = nc.CoordsOf(s);
    cell[static_cast<size_t>(c.p) * nc.tp + c.t].push_back(s);
  }
  edges.clear();
  for (int32_t q : survivors) {
    if (taken[static_cast<size_t>(q)]) continue;
    const auto o = oc.CoordsOf(assignment_.old_rank_of_participant[static_cast<size_t>(q)]);
    auto [t0, t1] = TpOverlap(o.t, oc.tp, nc.tp);
    if (cl.any_unsplit) t0 = 0, t1 = nc.tp - 1;
    for (int p : cl.new_stages_of_old[static_cast<size_t>(o.p)]) {
      for (int t = t0; t <= t1; ++t) {
        const auto& cq = cell[static_cast<size_t>(p) * nc.tp + t];
        if (cq.empty()) continue;
        const Weight w = ApproxWeight(cl, oc, nc, o, nc.CoordsOf(cq.front()));
        if (w > 0) edges.push_back({w, p * nc.tp + t, q});
      }
    }
  }
  std::sort(edges.begin(), edges.end(), by_weight);
  for (const Edge& e : edges) {
    auto& cq = cell[static_cast<size_t>(e.s)];
    if (cq.empty() || taken[static_cast<size_t>(e.q)]) continue;
    out[static_cast<size_t>(cq.front())] = e.q;
    cq.pop_front();
    taken[static_cast<size_t>(e.q)] = 1;
  }
  // Phase 3: the rest, in order.
  size_t next = 0;
  for (int s = 0; s < world; ++s) {
    if (out[static_cast<size_t>(s)] >= 0) continue;
    while (taken[static_cast<size_t>(in_->available[next])]) ++next;
    out[static_cast<size_t>(s)] = in_->available[next];
    taken[static_cast<size_t>(in_->available[next])] = 1;
  }
}

}  // namespace morph
