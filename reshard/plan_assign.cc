// The assignment of participants to new ranks: shard overlap counting, the exact method
// (Hungarian) and the structured greedy for large worlds (docs/reshard-planner.md).
#include <algorithm>
#include <deque>
#include <limits>
#include <tuple>
#include <unordered_map>

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

// Resident bytes of old rank `o` at new rank `c`, in closed form per class. Exact for
// replicated tensors, for ZeRO tensors that are not split (same frame: two ZeroRanges) and for
// ZeRO tensors split on dimension 0 (the TP-local piece is a contiguous run of the global
// row-major order, so both shards are global flat ranges). ZeRO tensors split on another
// dimension are modelled as (TP column overlap) x (overlap of the ZeRO ranges as fractions of
// the rows), exact when the TP slices coincide, else exact up to partial rows. O(classes)
// integer arithmetic, no allocation; deterministic.
Weight ApproxWeight(const Planner::Classes& cl, const ParallelConfig& oc, const ParallelConfig& nc,
                    ParallelConfig::Coords o, ParallelConfig::Coords c) {
  const auto* group = cl.Group(o.p, c.p);
  if (group == nullptr) return 0;
  auto ovl = [](Weight a0, Weight a1, Weight b0, Weight b1) -> Weight {
    const Weight lo = a0 > b0 ? a0 : b0, hi = a1 < b1 ? a1 : b1;
    return hi > lo ? hi - lo : 0;
  };
  Weight w = 0;
  for (const auto& [cls, count] : *group) {
    const Planner::Classes::Class& k = cl.classes[static_cast<size_t>(cls)];
    const TensorSpec& spec = k.rep;
    const int64_t elems = k.elems;
    if (elems == 0) continue;
    const bool split = spec.layout.tp_split(), zero = spec.layout.zero_sharded();
    const int64_t n_o = split ? elems / oc.tp : elems, n_n = split ? elems / nc.tp : elems;
    Weight e;  // elements in common
    if (!zero) {
      e = elems;
      if (split) {
        const int64_t len = spec.shape[static_cast<size_t>(spec.layout.tp_dim())];
        const int64_t so = len / oc.tp, sn = len / nc.tp;
        e = Weight(elems / len) *
            Intersect(Interval{so * o.t, so * (o.t + 1)}, Interval{sn * c.t, sn * (c.t + 1)})
                .size();
      }
    } else {
      const Interval ro = ZeroRange(n_o, oc.dp, o.d), rn = ZeroRange(n_n, nc.dp, c.d);
      if (!split) {
        e = Intersect(ro, rn).size();
      } else if (spec.layout.tp_dim() == 0) {
        e = ovl(Weight(o.t) * n_o + ro.begin, Weight(o.t) * n_o + ro.end,
                Weight(c.t) * n_n + rn.begin, Weight(c.t) * n_n + rn.end);
      } else {
        const int64_t len = spec.shape[static_cast<size_t>(spec.layout.tp_dim())];
        const int64_t so = len / oc.tp, sn = len / nc.tp;
        const int64_t cols =
            Intersect(Interval{so * o.t, so * (o.t + 1)}, Interval{sn * c.t, sn * (c.t + 1)})
                .size();
        // Rows in common (as fractions of all rows) times the common columns x inner size.
        const Weight rows = ovl(Weight(ro.begin) * n_n, Weight(ro.end) * n_n,
                                Weight(rn.begin) * n_o, Weight(rn.end) * n_o);
        e = rows / n_o * (Weight(elems / len) * cols) / n_n;  // no int128 overflow
      }
    }
    w += Weight(count) * k.elem * e;
  }
  return w;
}

// New TP ranks whose slice overlaps old TP rank t's: [first, last].
std::pair<int, int> TpOverlap(int t, int tp_old, int tp_new) {
  const int64_t a = int64_t{t} * tp_new, b = int64_t{t + 1} * tp_new;
  return {static_cast<int>(a / tp_old), static_cast<int>((b + tp_old - 1) / tp_old - 1)};
}

// ApproxWeight memoized on (equal stage group, TP and DP coordinates): stages holding the same
// tensor classes share their weights. Lookup only (never iterated), so deterministic.
class WeightCache {
 public:
  WeightCache(const Planner::Classes& cl, const ParallelConfig& oc, const ParallelConfig& nc)
      : cl_(cl), oc_(oc), nc_(nc) {}
  Weight operator()(ParallelConfig::Coords o, ParallelConfig::Coords c) {
    const int g = cl_.group_id[static_cast<size_t>(o.p) * static_cast<size_t>(cl_.new_pp) +
                               static_cast<size_t>(c.p)];
    if (g < 0) return 0;
    const Key key{(uint64_t(uint32_t(g)) << 32) | uint32_t(o.d),
                  (uint64_t(uint32_t(c.d)) << 32) | uint32_t(o.t), uint32_t(c.t)};
    auto [it, fresh] = cache_.try_emplace(key, 0);
    if (fresh) it->second = ApproxWeight(cl_, oc_, nc_, o, c);
    return it->second;
  }

 private:
  struct Key {
    uint64_t a, b, c;
    bool operator==(const Key&) const = default;
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<uint64_t>()((k.a * 0x9E3779B97F4A7C15ULL ^ k.b) * 0xBF58476D1CE4E5B9ULL ^
                                   k.c);
    }
  };
  const Planner::Classes& cl_;
  const ParallelConfig& oc_;
  const ParallelConfig& nc_;
  std::unordered_map<Key, Weight, Hash> cache_;
};

}  // namespace

void Planner::StructuredAssign(std::vector<int32_t>& out) const {
  const ParallelConfig& oc = in_->old_config;
  const ParallelConfig& nc = in_->new_config;
  const Classes& cl = *classes_;
  const int world = nc.world();
  std::vector<char> taken(static_cast<size_t>(in_->num_participants), 0);
  WeightCache weight_of(cl, oc, nc);
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
          const Weight w = weight_of(o, {p, d, t});
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
        const Weight w = weight_of(o, nc.CoordsOf(cq.front()));
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
  // Phase 4: local improvement. Neighbouring DP ranks of a new (stage, TP rank) cell swap
  // participants when that keeps more bytes resident (greedy ties and phase 2 can leave ZeRO
  // ranges crossed; interval overlaps favour the order-preserving matching). A few passes,
  // O(world * classes) each.
  auto weight = [&](int32_t q, int s) -> Weight {
    const int32_t r = assignment_.old_rank_of_participant[static_cast<size_t>(q)];
    if (r < 0) return 0;
    return weight_of(oc.CoordsOf(r), nc.CoordsOf(s));
  };
  std::vector<Weight> cur(static_cast<size_t>(world));
  for (int s = 0; s < world; ++s)
    cur[static_cast<size_t>(s)] = weight(out[static_cast<size_t>(s)], s);
  for (int pass = 0; pass < 4; ++pass) {
    bool changed = false;
    for (int p = 0; p < nc.pp; ++p) {
      for (int t = 0; t < nc.tp; ++t) {
        for (int d = 0; d + 1 < nc.dp; ++d) {
          const int s1 = nc.RankOf({p, d, t}), s2 = nc.RankOf({p, d + 1, t});
          int32_t& q1 = out[static_cast<size_t>(s1)];
          int32_t& q2 = out[static_cast<size_t>(s2)];
          const Weight a = weight(q1, s2), b = weight(q2, s1);
          if (a + b > cur[static_cast<size_t>(s1)] + cur[static_cast<size_t>(s2)]) {
            std::swap(q1, q2);
            cur[static_cast<size_t>(s1)] = b;
            cur[static_cast<size_t>(s2)] = a;
            changed = true;
          }
        }
      }
    }
    if (!changed) break;
  }
}

}  // namespace morph
