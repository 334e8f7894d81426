#include "bench/plan_reference.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <tuple>
#include <unordered_map>

namespace morph::benchref {
namespace {

int StageOfLayer(const ParallelConfig& c, int layer) {
  return c.stage_of_layer.empty() ? 0 : c.stage_of_layer[static_cast<size_t>(layer)];
}

// Every stage holding a tensor of `layout` (a full replica on each), ascending.
std::vector<int> StagesOf(const ParallelConfig& c, const Layout& layout) {
  std::vector<int> v;
  for (int l : layout.layers()) v.push_back(StageOfLayer(c, l));
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// A shard of one class as seen in the [rows, columns x inner] view: rows [ra, rb], where row r
// holds in-row positions [lo(r), hi(r)) (position = column * inner + inner index).
struct View {
  int64_t ra = 0, rb = -1, row = 1, base = 0, first_lo = 0, last_hi = 0;
  int64_t Lo(int64_t r) const { return r == ra ? first_lo : base; }
  int64_t Hi(int64_t r) const { return r == rb ? last_hi : base + row; }
};

View MakeView(int64_t rows, int64_t width, int64_t col0, int64_t inner, int dp, int d, bool zero) {
  View v;
  v.row = width * inner;
  v.base = col0 * inner;
  const int64_t n = rows * v.row;
  int64_t a = 0, b = n;
  if (zero) {
    const int64_t chunk = (n + dp - 1) / dp;
    a = std::min(n, chunk * d);
    b = std::min(n, chunk * (d + 1));
  }
  if (a >= b) return v;  // empty: rb < ra
  v.ra = a / v.row;
  v.rb = (b - 1) / v.row;
  v.first_lo = v.base + (a - v.ra * v.row);
  v.last_hi = v.base + (b - v.rb * v.row);
  return v;
}

int64_t Common(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
}

// Elements common to two views, counting in-row positions below `limit` only.
int64_t ViewOverlap(const View& a, const View& b, int64_t limit) {
  const int64_t r0 = std::max(a.ra, b.ra), r1 = std::min(a.rb, b.rb);
  if (r0 > r1) return 0;
  // Rows other than the four boundary rows are full in both shards.
  int64_t special[4] = {a.ra, a.rb, b.ra, b.rb};
  std::sort(special, special + 4);
  int64_t n = 0, special_rows = 0;
  for (int i = 0; i < 4; ++i) {
    const int64_t r = special[i];
    if (r < r0 || r > r1 || (i > 0 && special[i - 1] == r)) continue;
    ++special_rows;
    n += Common(a.Lo(r), std::min(a.Hi(r), limit), b.Lo(r), std::min(b.Hi(r), limit));
  }
  n += (r1 - r0 + 1 - special_rows) *
       Common(a.base, std::min(a.base + a.row, limit), b.base, std::min(b.base + b.row, limit));
  return n;
}

// Dense Hungarian (potentials), maximizing: rows <= columns.
int64_t DenseMax(const std::vector<std::vector<int64_t>>& w) {
  const int n = static_cast<int>(w.size());
  if (n == 0) return 0;
  const int m = static_cast<int>(w[0].size());
  const int64_t inf = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> u(n + 1, 0), v(m + 1, 0), minv(m + 1);
  std::vector<int> match(m + 1, 0), way(m + 1, 0);
  std::vector<char> used(m + 1);
  for (int i = 1; i <= n; ++i) {
    match[0] = i;
    int j0 = 0;
    std::fill(minv.begin(), minv.end(), inf);
    std::fill(used.begin(), used.end(), 0);
    while (true) {
      used[j0] = 1;
      const int i0 = match[j0];
      int64_t delta = inf;
      int j1 = 0;
      for (int j = 1; j <= m; ++j) {
        if (used[j]) continue;
        const int64_t cur = -w[i0 - 1][j - 1] - u[i0] - v[j];
        if (cur < minv[j]) minv[j] = cur, way[j] = j0;
        if (minv[j] < delta) delta = minv[j], j1 = j;
      }
      for (int j = 0; j <= m; ++j) {
        if (used[j]) {
          u[match[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      }
      j0 = j1;
      if (match[j0] == 0) break;
    }
    while (j0) {
      const int j1 = way[j0];
      match[j0] = match[j1];
      j0 = j1;
    }
  }
  int64_t total = 0;
  for (int j = 1; j <= m; ++j) {
    if (match[j]) total += w[match[j] - 1][j - 1];
  }
  return total;
}

}  // namespace

Reference::Reference(const PlanInput& in) : in_(in) {
  std::map<std::tuple<DType, std::vector<int64_t>, int, bool, int, int, int>, int> ids;
  for (const TensorSpec& t : in.tensors) {
    const Layout& l = t.layout;
    auto key = std::make_tuple(t.dtype, t.shape, l.tp_dim(), l.zero_sharded(), l.tp_blocks(),
                               l.pad_multiple(), l.zero_group());
    auto [it, fresh] = ids.emplace(key, static_cast<int>(classes_.size()));
    if (fresh) {
      classes_.push_back({DTypeSize(t.dtype), t.shape, l.tp_dim(), l.zero_sharded(), l.tp_blocks(),
                          l.pad_multiple(), l.zero_group()});
    }
    for (int po : StagesOf(in.old_config, l)) {
      for (int pn : StagesOf(in.new_config, l)) {
        auto& v = pairs_[{po, pn}];
        auto e = std::find_if(v.begin(), v.end(), [&](auto& x) { return x.first == it->second; });
        if (e == v.end()) {
          v.push_back({it->second, 1});
        } else {
          ++e->second;
        }
      }
    }
  }
  old_of_new_.resize(static_cast<size_t>(in.new_config.pp));
  new_of_old_.resize(static_cast<size_t>(in.old_config.pp));
  for (const auto& [st, v] : pairs_) {
    old_of_new_[static_cast<size_t>(st.second)].push_back(st.first);
    new_of_old_[static_cast<size_t>(st.first)].push_back(st.second);
  }
  old_rank_of_.assign(static_cast<size_t>(in.num_participants), -1);
  for (size_t r = 0; r < in.old_participant_of_rank.size(); ++r) {
    if (in.old_participant_of_rank[r] >= 0) {
      old_rank_of_[static_cast<size_t>(in.old_participant_of_rank[r])] = static_cast<int32_t>(r);
    }
  }
  available_.assign(static_cast<size_t>(in.num_participants), 0);
  for (int32_t q : in.available) available_[static_cast<size_t>(q)] = 1;
}

namespace {

// The [rows, split dim x inner] view of a class in one config: rows, the split dim's logical
// length (per block when block-interleaved: the blocks become rows), its padded slice width,
// inner size, and the rank's view.
struct ClassView {
  View v;
  int64_t limit = 0;  // in-row positions at or past it are padding
};

template <typename K>
ClassView MakeClassView(const K& k, const ParallelConfig& c, int d, int t) {
  int64_t rows = 1, len = 1, inner = 1;
  if (k.tp_dim >= 0) {
    for (int i = 0; i < k.tp_dim; ++i) rows *= k.shape[static_cast<size_t>(i)];
    len = k.shape[static_cast<size_t>(k.tp_dim)];
    for (size_t i = static_cast<size_t>(k.tp_dim) + 1; i < k.shape.size(); ++i) inner *= k.shape[i];
    rows *= k.blocks;  // block j of row r is row r * blocks + j, of length len / blocks
    len /= k.blocks;
  } else {
    for (int64_t x : k.shape) len *= x;  // one row of every element
  }
  int64_t padded = len;
  if (k.pad > 0) {
    const int64_t unit = int64_t{k.pad} * c.tp;
    padded = (len + unit - 1) / unit * unit;
  }
  const int64_t w = k.tp_dim >= 0 ? padded / c.tp : len;
  const int64_t col0 = k.tp_dim >= 0 ? w * t : 0;
  const int g = k.group > 0 ? k.group : c.dp;
  return {MakeView(rows, w, col0, inner, g, d % g, k.zero), len * inner};
}

}  // namespace

int64_t Reference::Overlap(const Class& k, int d, int t, int dn, int tn) const {
  const ClassView a = MakeClassView(k, in_.old_config, d, t);
  const ClassView b = MakeClassView(k, in_.new_config, dn, tn);
  return ViewOverlap(a.v, b.v, a.limit);
}

int64_t Reference::Count(const Class& k, const ParallelConfig& c, int d, int t) const {
  const ClassView a = MakeClassView(k, c, d, t);
  return ViewOverlap(a.v, a.v, a.limit);
}

int64_t Reference::PairBytes(int p, int d, int t, int pn, int dn, int tn) const {
  auto it = pairs_.find({p, pn});
  if (it == pairs_.end()) return 0;
  int64_t bytes = 0;
  for (const auto& [cls, count] : it->second) {
    const Class& k = classes_[static_cast<size_t>(cls)];
    bytes += count * k.elem * Overlap(k, d, t, dn, tn);
  }
  return bytes;
}

int64_t Reference::Resident(int32_t q, int s) const {
  const int32_t r = old_rank_of_[static_cast<size_t>(q)];
  if (r < 0) return 0;
  const auto o = in_.old_config.CoordsOf(r);
  const auto c = in_.new_config.CoordsOf(s);
  return PairBytes(o.p, o.d, o.t, c.p, c.d, c.t);
}

int64_t Reference::Needed(int s) const {
  const ParallelConfig& nc = in_.new_config;
  const auto c = nc.CoordsOf(s);
  int64_t bytes = 0;
  for (const TensorSpec& t : in_.tensors) {
    const std::vector<int> st = StagesOf(nc, t.layout);
    if (!std::binary_search(st.begin(), st.end(), c.p)) continue;
    const Class k{DTypeSize(t.dtype),   t.shape,
                  t.layout.tp_dim(),    t.layout.zero_sharded(),
                  t.layout.tp_blocks(), t.layout.pad_multiple(),
                  t.layout.zero_group()};
    bytes += Count(k, nc, c.d, c.t) * k.elem;
  }
  return bytes;
}

Reference::Bound Reference::UpperBound() const {
  const ParallelConfig& oc = in_.old_config;
  const ParallelConfig& nc = in_.new_config;
  // An old stage whose ranks are all held by available participants: the max over its ranks
  // depends only on (stage pair's classes, coordinates), so equal pairs share it.
  std::vector<char> whole(static_cast<size_t>(oc.pp), 1);
  for (int r = 0; r < oc.world(); ++r) {
    const int32_t q = in_.old_participant_of_rank[static_cast<size_t>(r)];
    if (q < 0 || !available_[static_cast<size_t>(q)])
      whole[static_cast<size_t>(oc.CoordsOf(r).p)] = 0;
  }
  std::map<std::vector<std::pair<int, int64_t>>, int> sig;
  auto sig_of = [&](int p, int pn) {
    return sig.emplace(pairs_.at({p, pn}), static_cast<int>(sig.size())).first->second;
  };
  Bound b;
  std::unordered_map<uint64_t, int64_t> memo;
  for (int s = 0; s < nc.world(); ++s) {
    const auto c = nc.CoordsOf(s);
    int64_t best = 0;
    for (int p : old_of_new_[static_cast<size_t>(c.p)]) {
      const uint64_t key = (uint64_t(sig_of(p, c.p)) << 40) | (uint64_t(c.d) << 20) | uint64_t(c.t);
      if (whole[static_cast<size_t>(p)]) {
        auto [it, fresh] = memo.try_emplace(key, 0);
        if (fresh) {
          for (int d = 0; d < oc.dp; ++d) {
            for (int t = 0; t < oc.tp; ++t) {
              it->second = std::max(it->second, PairBytes(p, d, t, c.p, c.d, c.t));
            }
          }
        }
        best = std::max(best, it->second);
        continue;
      }
      for (int d = 0; d < oc.dp; ++d) {
        for (int t = 0; t < oc.tp; ++t) {
          const int32_t q = in_.old_participant_of_rank[static_cast<size_t>(oc.RankOf({p, d, t}))];
          if (q >= 0 && available_[static_cast<size_t>(q)]) {
            best = std::max(best, PairBytes(p, d, t, c.p, c.d, c.t));
          }
        }
      }
    }
    b.by_rank += best;
  }
  memo.clear();
  for (int32_t q : in_.available) {
    const int32_t r = old_rank_of_[static_cast<size_t>(q)];
    if (r < 0) continue;
    const auto o = oc.CoordsOf(r);
    int64_t best = 0;
    for (int pn : new_of_old_[static_cast<size_t>(o.p)]) {
      const uint64_t key =
          (uint64_t(sig_of(o.p, pn)) << 40) | (uint64_t(o.d) << 20) | uint64_t(o.t);
      auto [it, fresh] = memo.try_emplace(key, 0);
      if (fresh) {
        for (int dn = 0; dn < nc.dp; ++dn) {
          for (int tn = 0; tn < nc.tp; ++tn) {
            it->second = std::max(it->second, PairBytes(o.p, o.d, o.t, pn, dn, tn));
          }
        }
      }
      best = std::max(best, it->second);
    }
    b.by_participant += best;
  }
  b.bound = std::min(b.by_rank, b.by_participant);
  return b;
}

int64_t Reference::Optimum() const {
  const ParallelConfig& oc = in_.old_config;
  const ParallelConfig& nc = in_.new_config;
  const int po = oc.pp, pn = nc.pp;
  std::vector<int> parent(static_cast<size_t>(po + pn));
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](int x) {
    while (parent[static_cast<size_t>(x)] != x) x = parent[static_cast<size_t>(x)];
    return x;
  };
  for (const auto& [st, v] : pairs_)
    parent[static_cast<size_t>(find(st.first))] = find(po + st.second);
  int64_t total = 0;
  for (int root = 0; root < po + pn; ++root) {
    std::vector<int> rows;
    std::vector<int32_t> cols;
    for (int s = 0; s < nc.world(); ++s) {
      if (find(po + nc.CoordsOf(s).p) == root) rows.push_back(s);
    }
    for (int32_t q : in_.available) {
      const int32_t r = old_rank_of_[static_cast<size_t>(q)];
      if (r >= 0 && find(oc.CoordsOf(r).p) == root) cols.push_back(q);
    }
    if (rows.empty() || cols.empty()) continue;
    // Zero columns stand for participants outside the component (weight 0).
    std::vector<std::vector<int64_t>> w(rows.size(),
                                        std::vector<int64_t>(cols.size() + rows.size(), 0));
    for (size_t i = 0; i < rows.size(); ++i) {
      for (size_t j = 0; j < cols.size(); ++j) w[i][j] = Resident(cols[j], rows[i]);
    }
    total += DenseMax(w);
  }
  return total;
}

}  // namespace morph::benchref
