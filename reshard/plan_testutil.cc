#include "reshard/plan_testutil.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>

#include "reshard/layout.h"
#include "reshard/plan_internal.h"

namespace morph::testutil {

std::vector<int> RandomStageMap(std::mt19937_64& rng, int layers, int pp) {
  std::vector<int> cuts(static_cast<size_t>(layers - 1));
  std::iota(cuts.begin(), cuts.end(), 1);
  std::shuffle(cuts.begin(), cuts.end(), rng);
  cuts.resize(static_cast<size_t>(pp - 1));
  std::sort(cuts.begin(), cuts.end());
  std::vector<int> stages;
  int stage = 0;
  for (int l = 0; l < layers; ++l) {
    if (stage < pp - 1 && l == cuts[static_cast<size_t>(stage)]) ++stage;
    stages.push_back(stage);
  }
  return stages;
}
namespace {

// Calls fn(index) for every element of `box` in row-major order.
template <typename Fn>
void ForEach(const Box& box, Fn fn) {
  if (box.empty()) return;
  std::vector<int64_t> idx = box.origin();
  while (true) {
    fn(idx);
    int d = box.rank() - 1;
    for (; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < box.dim(d).end) break;
      idx[static_cast<size_t>(d)] = box.dim(d).begin;
    }
    if (d < 0) return;
  }
}

int64_t Linear(const Box& frame, const std::vector<int64_t>& idx) {
  int64_t l = 0;
  for (int d = 0; d < frame.rank(); ++d) {
    l = l * frame.dim(d).size() + (idx[static_cast<size_t>(d)] - frame.dim(d).begin);
  }
  return l;
}

bool Holds(const Shard& s, const std::vector<int64_t>& idx) {
  if (s.empty() || !s.frame.Contains(idx)) return false;
  const int64_t l = Linear(s.frame, idx);
  return l >= s.flat_begin && l < s.flat_end;
}

// Local element offset of global index `idx` in shard `s` (which holds it).
int64_t LocalOffset(const Shard& s, const std::vector<int64_t>& idx) {
  return Linear(s.frame, idx) - s.flat_begin;
}

struct Buffers {
  std::vector<std::vector<uint8_t>> data;  // per tensor
  std::vector<std::vector<int>> writes;    // per tensor, per element
  std::vector<Shard> shards;
};

std::string MoveString(const PieceMove& m) {
  return "tensor " + std::to_string(m.tensor) + " peer " + std::to_string(m.peer) + " box " +
         m.box.ToString();
}

}  // namespace

uint8_t ReferenceByte(int tensor, int64_t linear, int b) {
  uint64_t x = (static_cast<uint64_t>(tensor) * 0x9E3779B97F4A7C15ULL) ^
               (static_cast<uint64_t>(linear) * 0xBF58476D1CE4E5B9ULL) ^ static_cast<uint64_t>(b);
  x ^= x >> 31;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

std::vector<int64_t> ReferenceSlots(const TensorSpec& spec, const ParallelConfig& config,
                                    int rank) {
  const ParallelConfig::Coords c = config.CoordsOf(rank);
  bool on = false;
  for (int l : spec.layout.layers()) {
    const int p = config.stage_of_layer.empty() ? 0 : config.stage_of_layer[size_t(l)];
    on |= p == c.p;
  }
  if (!on) return {};
  const int rank_n = static_cast<int>(spec.shape.size());
  const int k = spec.layout.tp_dim();
  // Real index along the split dimension of local index i (-1: padding), and the local length.
  std::vector<int64_t> local_shape = spec.shape;
  std::vector<int64_t> map_k;
  if (k >= 0) {
    const int64_t len = spec.shape[size_t(k)];
    const int blocks = spec.layout.tp_blocks(), m = spec.layout.pad_multiple();
    if (blocks > 1) {
      const int64_t block = len / blocks, w = block / config.tp;
      for (int64_t i = 0; i < blocks * w; ++i) map_k.push_back((i / w) * block + c.t * w + i % w);
    } else if (m > 0) {
      const int64_t unit = int64_t{m} * config.tp;
      const int64_t w = (len + unit - 1) / unit * unit / config.tp;
      for (int64_t i = 0; i < w; ++i) map_k.push_back(c.t * w + i < len ? c.t * w + i : -1);
    } else if (spec.layout.tp_chunked()) {  // torch.chunk: chunks of ceil(len/tp), then empty
      const int64_t w = (len + config.tp - 1) / config.tp;
      for (int64_t i = c.t * w; i < (c.t + 1) * w && i < len; ++i) map_k.push_back(i);
    } else {
      const int64_t w = len / config.tp;
      for (int64_t i = 0; i < w; ++i) map_k.push_back(c.t * w + i);
    }
    local_shape[size_t(k)] = static_cast<int64_t>(map_k.size());
  }
  std::vector<int64_t> piece;
  int64_t n = 1;
  for (int64_t x : local_shape) n *= x;
  std::vector<int64_t> idx(size_t(rank_n), 0);
  for (int64_t e = 0; e < n; ++e) {
    int64_t rem = e;
    for (int d = rank_n - 1; d >= 0; --d) {
      idx[size_t(d)] = rem % local_shape[size_t(d)];
      rem /= local_shape[size_t(d)];
    }
    int64_t real = 0;
    bool pad = false;
    for (int d = 0; d < rank_n; ++d) {
      int64_t i = idx[size_t(d)];
      if (d == k) i = map_k[size_t(i)];
      if (i < 0) pad = true;
      real = real * spec.shape[size_t(d)] + i;
    }
    piece.push_back(pad ? -1 : real);
  }
  if (!spec.layout.zero_sharded()) return piece;
  const int g = spec.layout.zero_group() > 0 ? spec.layout.zero_group() : config.dp;
  // ZeRO cuts the flattened piece into elements; ChunkDP cuts its dimension 0 into rows.
  const int64_t rows = spec.layout.dp_chunked() ? local_shape[0] : n;
  const int64_t row = rows > 0 ? n / rows : 0;
  const int64_t chunk = (rows + g - 1) / g, i = c.d % g;
  const int64_t a = std::min(rows, chunk * i) * row, b = std::min(rows, chunk * (i + 1)) * row;
  return std::vector<int64_t>(piece.begin() + a, piece.begin() + b);
}

Status CheckPairsMatch(const std::vector<LocalPlan>& plans) {
  std::map<std::pair<int, int>, std::vector<const PieceMove*>> sent, received;
  for (const LocalPlan& lp : plans) {
    for (const PieceMove& m : lp.sends) sent[{lp.participant, m.peer}].push_back(&m);
    for (const PieceMove& m : lp.recvs) received[{m.peer, lp.participant}].push_back(&m);
  }
  for (const auto& [pair, moves] : sent) {
    if (pair.first == pair.second) {
      return InternalError("participant " + std::to_string(pair.first) + " sends to itself");
    }
    auto it = received.find(pair);
    const size_t n = it == received.end() ? 0 : it->second.size();
    if (n != moves.size()) {
      return InternalError(std::to_string(pair.first) + "->" + std::to_string(pair.second) + ": " +
                           std::to_string(moves.size()) + " sends, " + std::to_string(n) +
                           " recvs");
    }
    for (size_t i = 0; i < n; ++i) {
      const PieceMove& a = *moves[i];
      const PieceMove& b = *it->second[i];
      if (a.tensor != b.tensor || !(a.box == b.box)) {
        return InternalError(std::to_string(pair.first) + "->" + std::to_string(pair.second) +
                             " piece " + std::to_string(i) + ": send " + MoveString(a) + ", recv " +
                             MoveString(b));
      }
    }
  }
  for (const auto& [pair, moves] : received) {
    if (!sent.count(pair)) {
      return InternalError(std::to_string(pair.first) + "->" + std::to_string(pair.second) +
                           ": recvs without sends");
    }
  }
  return Status();
}

Status ApplyAndCheck(const PlanInput& in, const Assignment& assignment,
                     const std::vector<LocalPlan>& plans,
                     const std::vector<std::vector<PieceMove>>* lost) {
  MORPH_RETURN_IF_ERROR(CheckPairsMatch(plans));
  const size_t nt = in.tensors.size();
  const size_t np = static_cast<size_t>(in.num_participants);
  if (plans.size() != np) return InternalError("wrong number of plans");
  std::vector<Buffers> old_buf(np), new_buf(np);
  for (size_t q = 0; q < np; ++q) {
    old_buf[q].data.resize(nt);
    old_buf[q].shards.resize(nt);
    new_buf[q].data.resize(nt);
    new_buf[q].writes.resize(nt);
    new_buf[q].shards.resize(nt);
    const int32_t r = assignment.old_rank_of_participant[q];
    const int32_t s = assignment.new_rank_of_participant[q];
    for (size_t t = 0; t < nt; ++t) {
      const TensorSpec& spec = in.tensors[t];
      const int64_t es = DTypeSize(spec.dtype);
      const std::optional<Shard>& po = plans[q].old_shards[t];
      const std::optional<Shard>& pn = plans[q].new_shards[t];
      if (r >= 0 && in.old_participant_of_rank[static_cast<size_t>(r)] == static_cast<int>(q)) {
        MORPH_ASSIGN_OR_RETURN(Shard sh, ShardOf(spec, in.old_config, r));
        if (!sh.empty() && !(po && *po == sh)) {
          return InternalError("participant " + std::to_string(q) + " tensor " + spec.name +
                               ": plan's old shard differs from ShardOf " + sh.ToString());
        }
        old_buf[q].shards[t] = sh;
        const std::vector<int64_t> slots = ReferenceSlots(spec, in.old_config, r);
        if (static_cast<int64_t>(slots.size()) != sh.NumElements()) {
          return InternalError("participant " + std::to_string(q) + " tensor " + spec.name +
                               ": old shard " + sh.ToString() + " has " +
                               std::to_string(sh.NumElements()) + " elements, the reference " +
                               std::to_string(slots.size()));
        }
        old_buf[q].data[t].resize(static_cast<size_t>(sh.NumElements() * es));
        for (size_t off = 0; off < slots.size(); ++off) {
          for (int k = 0; k < es; ++k) {
            old_buf[q].data[t][off * size_t(es) + size_t(k)] =
                slots[off] < 0 ? uint8_t{0x5A} : ReferenceByte(static_cast<int>(t), slots[off], k);
          }
        }
      } else if (po && !po->empty()) {
        return InternalError("participant " + std::to_string(q) + " has an old shard of " +
                             spec.name + " but no old rank");
      }
      if (s >= 0) {
        MORPH_ASSIGN_OR_RETURN(Shard sh, ShardOf(spec, in.new_config, s));
        if (!sh.empty() && !(pn && *pn == sh)) {
          return InternalError("participant " + std::to_string(q) + " tensor " + spec.name +
                               ": plan's new shard differs from ShardOf " + sh.ToString());
        }
        new_buf[q].shards[t] = sh;
        if (static_cast<int64_t>(ReferenceSlots(spec, in.new_config, s).size()) !=
            sh.NumElements()) {
          return InternalError("participant " + std::to_string(q) + " tensor " + spec.name +
                               ": new shard " + sh.ToString() +
                               " differs in size from the "
                               "reference");
        }
        new_buf[q].data[t].assign(static_cast<size_t>(sh.NumElements() * es), 0);
        new_buf[q].writes[t].assign(static_cast<size_t>(sh.NumElements()), 0);
      } else if (pn && !pn->empty()) {
        return InternalError("participant " + std::to_string(q) + " has a new shard of " +
                             spec.name + " but no new rank");
      }
    }
  }
  auto copy = [&](size_t from, size_t to, const PieceMove& m) -> Status {
    const size_t t = static_cast<size_t>(m.tensor);
    const int64_t es = DTypeSize(in.tensors[t].dtype);
    const Shard& src = old_buf[from].shards[t];
    const Shard& dst = new_buf[to].shards[t];
    MORPH_ASSIGN_OR_RETURN(StridedView sv, ViewOf(src, m.box), "source of " << MoveString(m));
    MORPH_ASSIGN_OR_RETURN(StridedView dv, ViewOf(dst, m.box), "target of " << MoveString(m));
    ForEach(m.box, [&](const std::vector<int64_t>& idx) {
      int64_t so = sv.offset, d_o = dv.offset;
      for (int d = 0; d < m.box.rank(); ++d) {
        const int64_t rel = idx[static_cast<size_t>(d)] - m.box.dim(d).begin;
        so += rel * sv.strides[static_cast<size_t>(d)];
        d_o += rel * dv.strides[static_cast<size_t>(d)];
      }
      std::memcpy(&new_buf[to].data[t][static_cast<size_t>(d_o * es)],
                  &old_buf[from].data[t][static_cast<size_t>(so * es)], static_cast<size_t>(es));
      ++new_buf[to].writes[t][static_cast<size_t>(d_o)];
    });
    return Status();
  };
  for (size_t q = 0; lost != nullptr && q < np; ++q) {
    for (const PieceMove& m : (*lost)[q]) {
      const size_t t = static_cast<size_t>(m.tensor);
      const TensorSpec& spec = in.tensors[t];
      for (int r = 0; r < in.old_config.world(); ++r) {
        if (in.old_participant_of_rank[static_cast<size_t>(r)] < 0) continue;
        MORPH_ASSIGN_OR_RETURN(Shard held, ShardOf(spec, in.old_config, r));
        if (!IntersectShard(held, m.box).empty()) {
          return InternalError("lost piece " + MoveString(m) + " of participant " +
                               std::to_string(q) + " is held by live old rank " +
                               std::to_string(r));
        }
      }
      const Shard& dst = new_buf[q].shards[t];
      const int64_t es = DTypeSize(spec.dtype);
      const Box whole = StateBox(spec);  // planning coordinates: same linear order as real
      if (!whole.Contains(m.box)) {
        return InternalError("lost piece " + MoveString(m) + " reaches into padding");
      }
      MORPH_RETURN_IF_ERROR(ViewOf(dst, m.box).status()) << "lost piece " << MoveString(m);
      ForEach(m.box, [&](const std::vector<int64_t>& idx) {
        if (!Holds(dst, idx)) return;
        const int64_t off = LocalOffset(dst, idx);
        for (int k = 0; k < es; ++k) {
          new_buf[q].data[t][static_cast<size_t>(off * es + k)] =
              ReferenceByte(static_cast<int>(t), Linear(whole, idx), k);
        }
        ++new_buf[q].writes[t][static_cast<size_t>(off)];
      });
    }
  }
  for (size_t q = 0; q < np; ++q) {
    for (const PieceMove& m : plans[q].local_copies) {
      if (m.peer != static_cast<int>(q)) return InternalError("local copy with a peer");
      MORPH_RETURN_IF_ERROR(copy(q, q, m)) << "participant " << q;
    }
    for (const PieceMove& m : plans[q].recvs) {
      MORPH_RETURN_IF_ERROR(copy(static_cast<size_t>(m.peer), q, m)) << "participant " << q;
    }
  }
  // Slot by slot against the independent reference.
  for (size_t q = 0; q < np; ++q) {
    const int32_t s = assignment.new_rank_of_participant[q];
    if (s < 0) continue;
    for (size_t t = 0; t < nt; ++t) {
      const std::vector<int64_t> slots = ReferenceSlots(in.tensors[t], in.new_config, s);
      const int64_t es = DTypeSize(in.tensors[t].dtype);
      for (size_t off = 0; off < slots.size(); ++off) {
        const int w = new_buf[q].writes[t][off];
        const std::string where = "participant " + std::to_string(q) + " tensor " +
                                  in.tensors[t].name + " slot " + std::to_string(off);
        if (slots[off] < 0) {
          if (w != 0) return InternalError(where + " (padding) written " + std::to_string(w));
          continue;
        }
        if (w != 1) {
          return InternalError(where + " (element " + std::to_string(slots[off]) + ") written " +
                               std::to_string(w) + " times");
        }
        for (int k = 0; k < es; ++k) {
          if (new_buf[q].data[t][off * size_t(es) + size_t(k)] !=
              ReferenceByte(static_cast<int>(t), slots[off], k)) {
            return InternalError(where + " (element " + std::to_string(slots[off]) +
                                 ") differs from the reference");
          }
        }
      }
    }
  }
  return Status();
}

std::vector<std::vector<int64_t>> BruteResidentMatrix(const PlanInput& in) {
  std::vector<int32_t> avail = in.available;
  std::sort(avail.begin(), avail.end());
  std::vector<int32_t> column(static_cast<size_t>(in.num_participants), -1);
  for (size_t j = 0; j < avail.size(); ++j) column[static_cast<size_t>(avail[j])] = int32_t(j);
  const int world = in.new_config.world();
  std::vector<std::vector<int64_t>> m(avail.size(), std::vector<int64_t>(world, 0));
  // Element by element: the available participants whose old rank holds it, times the new
  // ranks that hold it (both from the reference slot maps).
  for (const TensorSpec& spec : in.tensors) {
    int64_t n = 1;
    for (int64_t x : spec.shape) n *= x;
    std::vector<std::vector<int32_t>> olds(static_cast<size_t>(n));
    std::vector<std::vector<int>> news(static_cast<size_t>(n));
    for (int r = 0; r < in.old_config.world(); ++r) {
      const int32_t q = in.old_participant_of_rank[static_cast<size_t>(r)];
      if (q < 0 || column[static_cast<size_t>(q)] < 0) continue;
      for (int64_t e : ReferenceSlots(spec, in.old_config, r)) {
        if (e >= 0) olds[size_t(e)].push_back(column[static_cast<size_t>(q)]);
      }
    }
    for (int s = 0; s < world; ++s) {
      for (int64_t e : ReferenceSlots(spec, in.new_config, s)) {
        if (e >= 0) news[size_t(e)].push_back(s);
      }
    }
    for (int64_t e = 0; e < n; ++e) {
      for (int32_t j : olds[size_t(e)]) {
        for (int s : news[size_t(e)]) {
          m[static_cast<size_t>(j)][static_cast<size_t>(s)] += DTypeSize(spec.dtype);
        }
      }
    }
  }
  return m;
}

int64_t DenseBestResident(const std::vector<std::vector<int64_t>>& resident) {
  if (resident.empty()) return 0;
  const size_t world = resident[0].size();
  std::vector<std::vector<int64_t>> cost(world, std::vector<int64_t>(resident.size()));
  for (size_t j = 0; j < resident.size(); ++j) {
    for (size_t s = 0; s < world; ++s) cost[s][j] = -resident[j][s];
  }
  const std::vector<int> col = plan_internal::Hungarian(cost);
  int64_t best = 0;
  for (size_t s = 0; s < world; ++s) best += resident[static_cast<size_t>(col[s])][s];
  return best;
}

int64_t BruteBestResident(const std::vector<std::vector<int64_t>>& resident) {
  if (resident.empty()) return 0;
  const size_t world = resident[0].size();
  std::vector<char> used(resident.size(), 0);
  int64_t best = -1;
  std::function<void(size_t, int64_t)> go = [&](size_t s, int64_t acc) {
    if (s == world) {
      best = std::max(best, acc);
      return;
    }
    for (size_t j = 0; j < resident.size(); ++j) {
      if (used[j]) continue;
      used[j] = 1;
      go(s + 1, acc + resident[j][s]);
      used[j] = 0;
    }
  };
  go(0, 0);
  return best;
}

std::string PlanToString(const LocalPlan& plan) {
  std::ostringstream os;
  for (const PieceMove& m : plan.sends) os << "send " << MoveString(m) << "\n";
  for (const PieceMove& m : plan.recvs) os << "recv " << MoveString(m) << "\n";
  for (const PieceMove& m : plan.local_copies) os << "copy " << MoveString(m) << "\n";
  return os.str();
}

}  // namespace morph::testutil
