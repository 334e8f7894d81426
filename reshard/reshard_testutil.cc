#include "reshard/reshard_testutil.h"

#include <glog/logging.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "reshard/strided_copy.h"

namespace morph::testutil {

std::vector<TensorSpec> MatrixModel(int64_t mb, bool zero) {
  std::vector<TensorSpec> t;
  const int64_t n = std::max<int64_t>(4, mb / 16) / 4 * 4;
  for (int64_t i = 0; i < n; ++i) {
    Layout l = Layout::Layer(static_cast<int>(i / 4)).SplitTP(static_cast<int>(i % 2));
    t.push_back({"layers." + std::to_string(i / 4) + ".w" + std::to_string(i % 4),
                 DType::kF32,
                 {2048, 2048},
                 l.ZeroShard(zero)});
  }
  return t;
}
namespace {

int64_t Total(const TensorInfo& t) {
  int64_t n = 1;
  for (int64_t s : t.shape) n *= s;
  return n;
}

// Sorted random cut points splitting [0, len) into `parts` non-empty-where-possible pieces.
std::vector<int64_t> RandomCuts(int64_t len, int parts, std::mt19937_64& rng) {
  std::vector<int64_t> cuts{0, len};
  for (int i = 1; i < parts; ++i)
    cuts.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(len + 1)));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

std::vector<int64_t> EvenCuts(int64_t len, int parts) {
  std::vector<int64_t> cuts;
  const int64_t step = len / parts;
  for (int i = 0; i < parts; ++i) cuts.push_back(step * i);
  cuts.push_back(len);
  return cuts;
}

}  // namespace

RegionLayout TpLayout(const TensorInfo& t, int dim, const std::vector<int>& holders) {
  RegionLayout out;
  const auto cuts = EvenCuts(t.shape[static_cast<size_t>(dim)], static_cast<int>(holders.size()));
  for (size_t i = 0; i < holders.size(); ++i) {
    Box b = Box::FromShape(t.shape);
    b.dim(dim) = {cuts[i], cuts[i + 1]};
    out.push_back({*Shard::Whole(b), {holders[i]}});
  }
  return out;
}

RegionLayout FlatLayout(const TensorInfo& t, const std::vector<int>& holders) {
  RegionLayout out;
  const auto cuts = EvenCuts(Total(t), static_cast<int>(holders.size()));
  for (size_t i = 0; i < holders.size(); ++i) {
    out.push_back({Shard{Box::FromShape(t.shape), cuts[i], cuts[i + 1]}, {holders[i]}});
  }
  return out;
}

RegionLayout ReplicatedLayout(const TensorInfo& t, const std::vector<int>& holders) {
  return {{*Shard::Whole(Box::FromShape(t.shape)), holders}};
}

RegionLayout RandomLayout(const TensorInfo& t, int n, std::mt19937_64& rng) {
  const int rank = static_cast<int>(t.shape.size());
  const int dim = rank == 0 ? -1 : static_cast<int>(rng() % static_cast<uint64_t>(rank));
  int parts = dim < 0 ? 1 : 1 + static_cast<int>(rng() % 3);
  int flat = 1 + static_cast<int>(rng() % 3);
  int replicas = 1 + static_cast<int>(rng() % 2);
  while (parts * flat * replicas > n) {
    if (replicas > 1)
      --replicas;
    else if (flat > 1)
      --flat;
    else
      --parts;
  }
  std::vector<int> who(static_cast<size_t>(n));
  std::iota(who.begin(), who.end(), 0);
  std::shuffle(who.begin(), who.end(), rng);
  size_t next = 0;
  RegionLayout out;
  const auto dim_cuts = dim < 0 ? std::vector<int64_t>{0, 1}
                                : RandomCuts(t.shape[static_cast<size_t>(dim)], parts, rng);
  for (int p = 0; p < parts; ++p) {
    Box frame = Box::FromShape(t.shape);
    if (dim >= 0)
      frame.dim(dim) = {dim_cuts[static_cast<size_t>(p)], dim_cuts[static_cast<size_t>(p) + 1]};
    const int64_t elems = *frame.NumElements();
    const auto flat_cuts = RandomCuts(elems, flat, rng);
    for (int f = 0; f < flat; ++f) {
      Region r{
          Shard{frame, flat_cuts[static_cast<size_t>(f)], flat_cuts[static_cast<size_t>(f) + 1]},
          {}};
      for (int k = 0; k < replicas; ++k) r.holders.push_back(who[next++]);
      out.push_back(std::move(r));
    }
  }
  return out;
}

std::vector<LocalPlan> BuildPlans(const std::vector<TensorInfo>& tensors,
                                  const std::vector<RegionLayout>& old_layout,
                                  const std::vector<RegionLayout>& new_layout, int n) {
  std::vector<LocalPlan> plans(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    LocalPlan& lp = plans[static_cast<size_t>(p)];
    lp.participant = p;
    lp.num_participants = n;
    lp.tensors = tensors;
    lp.old_shards.assign(tensors.size(), std::nullopt);
    lp.new_shards.assign(tensors.size(), std::nullopt);
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (const Region& r : old_layout[t]) {
      for (int h : r.holders) plans[static_cast<size_t>(h)].old_shards[t] = r.shard;
    }
    for (const Region& r : new_layout[t]) {
      for (int h : r.holders) plans[static_cast<size_t>(h)].new_shards[t] = r.shard;
    }
    for (int q = 0; q < n; ++q) {
      const auto& dst = plans[static_cast<size_t>(q)].new_shards[t];
      if (!dst) continue;
      for (const Box& b : ShardBoxes(*dst)) {
        for (const Region& r : old_layout[t]) {
          int src = r.holders[(static_cast<size_t>(q) + t) % r.holders.size()];
          if (std::find(r.holders.begin(), r.holders.end(), q) != r.holders.end()) src = q;
          for (Box& piece : IntersectShard(r.shard, b)) {
            PieceMove m{static_cast<int32_t>(t), 0, std::move(piece)};
            if (src == q) {
              m.peer = q;
              plans[static_cast<size_t>(q)].local_copies.push_back(m);
            } else {
              m.peer = q;
              plans[static_cast<size_t>(src)].sends.push_back(m);
              m.peer = src;
              plans[static_cast<size_t>(q)].recvs.push_back(std::move(m));
            }
          }
        }
      }
    }
  }
  return plans;
}

std::vector<char> ReferenceTensor(const TensorInfo& t, int index) {
  std::vector<char> out(static_cast<size_t>(Total(t) * DTypeSize(t.dtype)));
  uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(index + 1);
  for (char& c : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c = static_cast<char>(x);
  }
  return out;
}

std::vector<char> ExtractShard(const TensorInfo& t, const Shard& s,
                               const std::vector<char>& global) {
  const int es = DTypeSize(t.dtype);
  std::vector<char> out(static_cast<size_t>(s.NumElements() * es));
  const Shard whole = *Shard::Whole(Box::FromShape(t.shape));
  for (const Box& b : ShardBoxes(s)) {
    auto g = MakeCopyGeometry(*ViewOf(s, b), *ViewOf(whole, b));
    CHECK(g.ok()) << g.status();
    HostStridedCopy(*g, out.data(), global.data(), es, 0, g->num_elements);
  }
  return out;
}

ParticipantData MakeParticipantData(const LocalPlan& plan,
                                    const std::vector<std::vector<char>>& reference) {
  ParticipantData d;
  const size_t nt = plan.tensors.size();
  d.old_data.resize(nt);
  d.new_data.resize(nt);
  for (size_t t = 0; t < nt; ++t) {
    const TensorInfo& info = plan.tensors[t];
    if (plan.old_shards[t]) {
      d.old_data[t] = ExtractShard(info, *plan.old_shards[t], reference[t]);
    }
    if (plan.new_shards[t]) {
      d.new_data[t].assign(
          static_cast<size_t>(plan.new_shards[t]->NumElements() * DTypeSize(info.dtype)), 0);
    }
  }
  for (size_t t = 0; t < nt; ++t) {
    const TensorInfo& info = plan.tensors[t];
    if (plan.old_shards[t]) {
      d.olds.push_back(
          {info.name, info.dtype,
           ConstBufferView(d.old_data[t].data(), d.old_data[t].size(), MemoryKind::kHost)});
    }
    if (plan.new_shards[t]) {
      d.news.push_back({info.name, info.dtype,
                        BufferView{d.new_data[t].data(), d.new_data[t].size(), MemoryKind::kHost}});
    }
  }
  return d;
}

}  // namespace morph::testutil
