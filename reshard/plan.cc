#include "reshard/plan.h"

#include <algorithm>
#include <limits>
#include <set>
#include <tuple>

#include "reshard/plan_internal.h"

namespace morph {

using plan_internal::NumEl;
using plan_internal::OverlapCount;
using plan_internal::ShardAt;

int64_t PieceBytes(const LocalPlan& plan, const PieceMove& piece) {
  return NumEl(piece.box) * DTypeSize(plan.tensors[static_cast<size_t>(piece.tensor)].dtype);
}

namespace {

Status BadInput(const std::string& m) { return InvalidArgumentError(m); }

// Where a region of a new shard lives in the old generation: old ranks (p, d, t) on the
// tensor's old stages with t in [t0, t1] and d in {d0, d0 + dstep, ...} up to d1 hold all of
// `box` (replicated: every d; ZeRO: one range index and its hybrid replicas).
struct Region {
  Box box;
  int t0 = 0, t1 = 0, d0 = 0, d1 = 0, dstep = 1;
  bool HeldBy(int d, int t) const {
    return t >= t0 && t <= t1 && d >= d0 && d <= d1 && (d - d0) % dstep == 0;
  }
};

using plan_internal::LinearIn;

// StagesOfUnchecked into a reused vector (PlanFor's per-tensor hot path: no allocation for the
// common single-layer tensor once `out` has capacity).
void StagesInto(const TensorSpec& spec, const ParallelConfig& config, std::vector<int>& out) {
  out.clear();
  if (spec.layout.extra_layers().empty()) {
    out.push_back(StageOfUnchecked(spec, config));
    return;
  }
  const std::vector<int> s = StagesOfUnchecked(spec, config);
  out.assign(s.begin(), s.end());
}

// Boxes clipped to the state (padded tensors: frames reach past the logical size).
void ClipToState(const TensorSpec& spec, std::vector<Box>& boxes) {
  if (spec.layout.pad_multiple() <= 0) return;
  const Box state = StateBox(spec);
  size_t w = 0;
  for (Box& b : boxes) {
    Box c = Intersect(b, state);
    if (!c.empty()) boxes[w++] = std::move(c);
  }
  boxes.resize(w);
}

// Splits `need` (a new shard of `spec`, a planning spec) into regions of constant old holder
// set, in storage order of the old TP slices, then of the need's boxes, then of ZeRO ranges.
// Closed form: only the old TP slices and ZeRO ranges that intersect `need` are visited.
// Padding is in no region.
void RegionsOf(const TensorSpec& spec, const ParallelConfig& old, const Shard& need,
               std::vector<Region>& out) {
  out.clear();
  if (need.empty()) return;
  const bool split = spec.layout.tp_split();
  const bool zero = spec.layout.zero_sharded();
  int t_first = 0, t_last = 0;
  if (split) {
    const int k = spec.layout.tp_dim();
    const int64_t slice = TpSliceWidth(spec, old);
    const Interval i =
        Intersect(need.frame.dim(k), Interval{0, spec.shape[static_cast<size_t>(k)]});
    if (i.empty()) return;  // all padding
    t_first = static_cast<int>(i.begin / slice);
    t_last = static_cast<int>((i.end - 1) / slice);
  }
  for (int t = t_first; t <= t_last; ++t) {
    const Box frame = TpBoxOf(spec, old, t);
    std::vector<Box> boxes = split ? IntersectShard(need, frame) : ShardBoxes(need);
    ClipToState(spec, boxes);
    const int tc0 = split ? t : 0, tc1 = split ? t : old.tp - 1;
    if (!zero) {
      for (const Box& b : boxes) out.push_back({b, tc0, tc1, 0, old.dp - 1, 1});
      continue;
    }
    const DpCut cut = DpCutOf(spec.layout, old, frame);
    const int groups = cut.groups;
    for (const Box& b : boxes) {
      const DpSpan span = cut.RanksOf({LinearIn(frame, b, false), LinearIn(frame, b, true) + 1});
      for (int g = span.first; g <= span.last; ++g) {
        const Interval r = cut.Range(g);
        for (Box& x : IntersectShard(Shard{frame, r.begin, r.end}, b)) {
          out.push_back({std::move(x), tc0, tc1, g, g + (old.dp / groups - 1) * groups, groups});
        }
      }
    }
  }
}

bool OriginLess(const Box& a, const Box& b) {
  for (int d = 0; d < a.rank() && d < b.rank(); ++d) {
    if (a.dim(d).begin != b.dim(d).begin) return a.dim(d).begin < b.dim(d).begin;
  }
  return false;
}

void SortMoves(std::vector<PieceMove>& moves) {
  std::sort(moves.begin(), moves.end(), [](const PieceMove& a, const PieceMove& b) {
    if (a.peer != b.peer) return a.peer < b.peer;
    if (a.tensor != b.tensor) return a.tensor < b.tensor;
    return OriginLess(a.box, b.box);
  });
}

// Box `b` cut into k near-equal parts along its first dimension of extent >= 2 (fewer parts
// if that dimension is shorter): part c.
Box Chunk(const Box& b, int k, int c) {
  if (k == 1) return b;
  Box out = b;
  for (int d = 0; d < b.rank(); ++d) {
    const Interval i = b.dim(d);
    if (i.size() < 2) continue;
    // The first size % k parts get one more row; no product can overflow.
    const int64_t q = i.size() / k, r = i.size() % k;
    const int64_t lo = i.begin + q * c + std::min<int64_t>(c, r);
    out.dim(d) = {lo, lo + q + (c < r ? 1 : 0)};
    return out;
  }
  return out;
}

int ChunkCount(const Box& b, int receivers, int holders) {
  if (receivers >= holders) return 1;
  int k = (holders + receivers - 1) / receivers;
  for (int d = 0; d < b.rank(); ++d) {
    if (b.dim(d).size() >= 2) return static_cast<int>(std::min<int64_t>(k, b.dim(d).size()));
  }
  return 1;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Create: validation and per-class aggregates.

StatusOr<Planner> Planner::Prepare(PlanInput input, const PlanOptions& options) {
  const int32_t n = input.num_participants;
  if (n < 0) return BadInput("num_participants=" + std::to_string(n) + " must be >= 0");
  MORPH_RETURN_IF_ERROR(input.old_config.Validate()) << "old config";
  MORPH_RETURN_IF_ERROR(input.new_config.Validate()) << "new config";
  // Limits first, so that a huge input is refused before anything grows with it.
  for (const auto& [what, world] :
       {std::pair<const char*, int64_t>{"old", input.old_config.world()},
        {"new", input.new_config.world()}}) {
    if (world > options.max_world) {
      return BadInput(std::string(what) + " config has world " + std::to_string(world) +
                      ", above the planner's limit of " + std::to_string(options.max_world) +
                      " ranks");
    }
  }
  if (int64_t{n} > 2 * int64_t{options.max_world}) {
    return BadInput("num_participants=" + std::to_string(n) + " is above the planner's limit of " +
                    std::to_string(2 * int64_t{options.max_world}) + " (2 x max_world)");
  }
  if (input.tensors.size() > static_cast<size_t>(options.max_tensors)) {
    return BadInput(std::to_string(input.tensors.size()) +
                    " tensors are above the planner's limit of " +
                    std::to_string(options.max_tensors));
  }
  std::set<std::string_view> names;
  int64_t model_bytes = 0;
  for (const TensorSpec& t : input.tensors) {
    MORPH_RETURN_IF_ERROR(ValidateTensorSpec(t));
    if (!names.insert(t.name).second) {
      return BadInput("tensor '" + t.name + "' is listed twice");
    }
    MORPH_RETURN_IF_ERROR(ValidateTensorForConfig(t, input.old_config)) << "old config";
    MORPH_RETURN_IF_ERROR(ValidateTensorForConfig(t, input.new_config)) << "new config";
    model_bytes += TensorBytes(t);  // each < 2^63 (validated), the running sum < 2^61 below
    if (model_bytes > (int64_t{1} << 60)) {
      return BadInput("the tensors' total size exceeds the planner's limit of 2^60 bytes (at '" +
                      t.name + "')");
    }
  }
  const ParallelConfig& oc = input.old_config;
  const ParallelConfig& nc = input.new_config;
  if (static_cast<int>(input.old_participant_of_rank.size()) != oc.world()) {
    return BadInput("old_participant_of_rank has " +
                    std::to_string(input.old_participant_of_rank.size()) +
                    " entries, the old config has world " + std::to_string(oc.world()));
  }
  Planner p;
  Assignment& a = p.assignment_;
  a.old_rank_of_participant.assign(static_cast<size_t>(n), -1);
  a.new_rank_of_participant.assign(static_cast<size_t>(n), -1);
  for (int r = 0; r < oc.world(); ++r) {
    const int32_t q = input.old_participant_of_rank[static_cast<size_t>(r)];
    if (q == -1) continue;
    if (q < -1 || q >= n) {
      return BadInput("old_participant_of_rank[" + std::to_string(r) + "]=" + std::to_string(q) +
                      " is not -1 or in [0, num_participants=" + std::to_string(n) + ")");
    }
    if (a.old_rank_of_participant[static_cast<size_t>(q)] != -1) {
      return BadInput("participant " + std::to_string(q) + " holds old ranks " +
                      std::to_string(a.old_rank_of_participant[static_cast<size_t>(q)]) + " and " +
                      std::to_string(r));
    }
    a.old_rank_of_participant[static_cast<size_t>(q)] = r;
  }
  std::sort(input.available.begin(), input.available.end());
  for (size_t i = 0; i < input.available.size(); ++i) {
    const int32_t q = input.available[i];
    if (q < 0 || q >= n) {
      return BadInput("available participant " + std::to_string(q) +
                      " is not in [0, num_participants=" + std::to_string(n) + ")");
    }
    if (i > 0 && input.available[i - 1] == q) {
      return BadInput("available participant " + std::to_string(q) + " is listed twice");
    }
  }
  if (static_cast<int64_t>(input.available.size()) < nc.world()) {
    return BadInput("the new config needs " + std::to_string(nc.world()) + " ranks but only " +
                    std::to_string(input.available.size()) + " participants are available");
  }

  auto classes = std::make_shared<Classes>();
  // Plan in the planning view (block-interleaved splits become plain splits of the block view);
  // the input as given stays for input() and the digest.
  const bool any_blocks = std::any_of(input.tensors.begin(), input.tensors.end(),
                                      [](const TensorSpec& t) { return t.layout.tp_blocks() > 1; });
  if (any_blocks) {
    p.orig_ = std::make_shared<const PlanInput>(input);
    for (TensorSpec& t : input.tensors) {
      if (t.layout.tp_blocks() > 1) t = PlanningSpec(t);
    }
  }
  std::map<std::tuple<DType, std::vector<int64_t>, int, bool, int, int, bool, bool>, int> class_of;
  classes->new_stages_of_old.resize(static_cast<size_t>(oc.pp));
  classes->on_new_stage.resize(static_cast<size_t>(nc.pp));
  for (const TensorSpec& t : input.tensors) {
    auto key = std::make_tuple(t.dtype, t.shape, t.layout.tp_dim(), t.layout.zero_sharded(),
                               t.layout.pad_multiple(), t.layout.zero_group(),
                               t.layout.tp_chunked(), t.layout.dp_chunked());
    auto [it, fresh] = class_of.emplace(key, static_cast<int>(classes->classes.size()));
    if (fresh) {
      int64_t elems = 1;
      for (int64_t d : t.shape) elems *= d;
      classes->classes.push_back({t, DTypeSize(t.dtype), elems, StateBox(t)});
      classes->any_unsplit |= !t.layout.tp_split();
    }
    // A tensor on several stages counts towards every (old stage, new stage) pair holding it:
    // each of those stages has a full replica.
    for (const int pn : StagesOfUnchecked(t, nc)) {
      auto& g = classes->on_new_stage[static_cast<size_t>(pn)];
      auto gi = std::find_if(g.begin(), g.end(), [&](auto& e) { return e.first == it->second; });
      if (gi == g.end()) {
        g.push_back({it->second, 1});
      } else {
        ++gi->second;
      }
    }
    for (const int po : StagesOfUnchecked(t, oc)) {
      for (const int pn : StagesOfUnchecked(t, nc)) {
        auto& g = classes->groups[{po, pn}];
        auto gi = std::find_if(g.begin(), g.end(), [&](auto& e) { return e.first == it->second; });
        if (gi == g.end()) {
          g.push_back({it->second, 1});
        } else {
          ++gi->second;
        }
        auto& ns = classes->new_stages_of_old[static_cast<size_t>(po)];
        if (std::find(ns.begin(), ns.end(), pn) == ns.end()) ns.push_back(pn);
      }
    }
  }
  for (auto& ns : classes->new_stages_of_old) std::sort(ns.begin(), ns.end());
  classes->new_pp = nc.pp;
  classes->group_of.assign(static_cast<size_t>(oc.pp) * static_cast<size_t>(nc.pp), nullptr);
  classes->group_id.assign(classes->group_of.size(), -1);
  std::map<std::vector<std::pair<int, int64_t>>, int> ids;
  for (const auto& [stages, group] : classes->groups) {
    const size_t i = static_cast<size_t>(stages.first) * static_cast<size_t>(nc.pp) +
                     static_cast<size_t>(stages.second);
    classes->group_of[i] = &group;
    classes->group_id[i] = ids.emplace(group, static_cast<int>(ids.size())).first->second;
  }
  p.classes_ = std::move(classes);
  p.in_ = std::make_shared<const PlanInput>(std::move(input));
  if (!p.orig_) p.orig_ = p.in_;
  return p;
}

void Planner::DeriveNewRanks() {
  Assignment& a = assignment_;
  a.new_rank_of_participant.assign(static_cast<size_t>(in_->num_participants), -1);
  for (size_t s = 0; s < a.participant_of_new_rank.size(); ++s) {
    a.new_rank_of_participant[static_cast<size_t>(a.participant_of_new_rank[s])] =
        static_cast<int32_t>(s);
  }
}

StatusOr<Planner> Planner::Create(PlanInput input, const PlanOptions& options) {
  MORPH_ASSIGN_OR_RETURN(Planner p, Prepare(std::move(input), options));
  p.assignment_.participant_of_new_rank.assign(static_cast<size_t>(p.in_->new_config.world()), -1);
  MORPH_RETURN_IF_ERROR(p.SolveAssignment(p.assignment_.participant_of_new_rank));
  p.DeriveNewRanks();
  p.assignment_.exact = true;
  p.digest_ = DigestPlanInput(*p.orig_, options, p.assignment_.participant_of_new_rank);
  return p;
}

StatusOr<Planner> Planner::Create(PlanInput input, Assignment assignment,
                                  const PlanOptions& options) {
  MORPH_ASSIGN_OR_RETURN(Planner p, Prepare(std::move(input), options));
  const PlanInput& in = *p.in_;
  const std::vector<int32_t>& of = assignment.participant_of_new_rank;
  if (static_cast<int64_t>(of.size()) != in.new_config.world()) {
    return BadInput("assignment has " + std::to_string(of.size()) +
                    " entries in participant_of_new_rank, the new config has world " +
                    std::to_string(in.new_config.world()));
  }
  std::vector<int32_t> rank_of(static_cast<size_t>(in.num_participants), -1);
  for (size_t s = 0; s < of.size(); ++s) {
    const int32_t q = of[s];
    if (!std::binary_search(in.available.begin(), in.available.end(), q)) {
      return BadInput("assignment gives new rank " + std::to_string(s) + " to participant " +
                      std::to_string(q) + ", which is not available");
    }
    if (rank_of[static_cast<size_t>(q)] >= 0) {
      return BadInput("assignment gives participant " + std::to_string(q) + " new ranks " +
                      std::to_string(rank_of[static_cast<size_t>(q)]) + " and " +
                      std::to_string(s));
    }
    rank_of[static_cast<size_t>(q)] = static_cast<int32_t>(s);
  }
  if (!assignment.new_rank_of_participant.empty() &&
      assignment.new_rank_of_participant != rank_of) {
    return BadInput("assignment's new_rank_of_participant disagrees with participant_of_new_rank");
  }
  if (!assignment.old_rank_of_participant.empty() &&
      assignment.old_rank_of_participant != p.assignment_.old_rank_of_participant) {
    return BadInput(
        "assignment's old_rank_of_participant disagrees with the input's old_participant_of_rank");
  }
  p.assignment_.participant_of_new_rank = of;
  p.DeriveNewRanks();
  p.assignment_.exact = assignment.exact;
  p.digest_ = DigestPlanInput(*p.orig_, options, p.assignment_.participant_of_new_rank);
  return p;
}

StatusOr<Assignment> ComputeAssignment(const PlanInput& input, const PlanOptions& options) {
  MORPH_ASSIGN_OR_RETURN(Planner p, Planner::Create(input, options));
  return p.assignment();
}

// ---------------------------------------------------------------------------------------------
// Assignment.

int64_t Planner::ResidentBytes(int32_t participant, int32_t new_rank) const {
  const int32_t r = assignment_.old_rank_of_participant[static_cast<size_t>(participant)];
  if (r < 0) return 0;
  const auto o = in_->old_config.CoordsOf(r);
  const auto c = in_->new_config.CoordsOf(new_rank);
  const auto* group = classes_->Group(o.p, c.p);
  if (group == nullptr) return 0;
  int64_t bytes = 0;
  for (const auto& [cls, count] : *group) {
    const auto& k = classes_->classes[static_cast<size_t>(cls)];
    bytes += count * k.elem *
             OverlapCount(ShardAt(k.rep, in_->old_config, o.d, o.t),
                          ShardAt(k.rep, in_->new_config, c.d, c.t), k.state());
  }
  return bytes;
}

Planner::Totals Planner::ComputeTotals() const {
  Totals t;
  const ParallelConfig& nc = in_->new_config;
  for (int s = 0; s < nc.world(); ++s) {
    const auto c = nc.CoordsOf(s);
    {
      for (const auto& [cls, count] : classes_->on_new_stage[static_cast<size_t>(c.p)]) {
        const auto& k = classes_->classes[static_cast<size_t>(cls)];
        // Checked: per-tensor sizes fit int64, their sum need not. resident <= needed, so a
        // needed total that fits means every resident sum fits too.
        int64_t b = 0;
        t.overflow |=
            __builtin_mul_overflow(count, k.elem, &b) ||
            __builtin_mul_overflow(b, StateElements(k.rep, ShardAt(k.rep, nc, c.d, c.t)), &b) ||
            __builtin_add_overflow(t.needed, b, &t.needed);
      }
    }
    if (t.overflow) return t;
    t.resident += ResidentBytes(assignment_.participant_of_new_rank[static_cast<size_t>(s)], s);
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Local plans.

namespace {

struct Ctx {
  const PlanInput& in;
  const Assignment& a;
  // Does participant q's old rank hold `region` of a tensor on old stages `olds`?
  bool Resident(int32_t q, const Region& rg, const std::vector<int>& olds) const {
    if (q < 0) return false;
    const int32_t r = a.old_rank_of_participant[static_cast<size_t>(q)];
    if (r < 0) return false;
    const auto c = in.old_config.CoordsOf(r);
    return std::binary_search(olds.begin(), olds.end(), c.p) && rg.HeldBy(c.d, c.t);
  }
  // New ranks, ascending, with the same new shard as (d, t) on any of the new stages `news`
  // (its DP replicas, TP replicas and stage replicas) whose participant lacks `region`.
  void Receivers(const TensorSpec& spec, const std::vector<int>& news, int d, int t,
                 const Region& rg, const std::vector<int>& olds, std::vector<int>& out) const {
    out.clear();
    const ParallelConfig& nc = in.new_config;
    const bool zero = spec.layout.zero_sharded(), all_t = !spec.layout.tp_split();
    const int step = zero ? ZeroGroupSize(spec.layout, nc) : 1;
    const int d0 = zero ? d % step : 0;
    for (int p : news) {
      for (int dd = d0; dd < nc.dp; dd += step) {
        for (int tt = all_t ? 0 : t; tt <= (all_t ? nc.tp - 1 : t); ++tt) {
          const int s = nc.RankOf({p, dd, tt});
          if (!Resident(a.participant_of_new_rank[static_cast<size_t>(s)], rg, olds)) {
            out.push_back(s);
          }
        }
      }
    }
  }
  // Old ranks holding `region` whose data survives, in rank order.
  void Holders(const Region& rg, const std::vector<int>& olds, std::vector<int>& out) const {
    out.clear();
    for (int p : olds) {
      for (int d = rg.d0; d <= rg.d1; d += rg.dstep) {
        for (int t = rg.t0; t <= rg.t1; ++t) {
          const int r = in.old_config.RankOf({p, d, t});
          if (in.old_participant_of_rank[static_cast<size_t>(r)] >= 0) out.push_back(r);
        }
      }
    }
  }
};

// Every region of a new shard that old rank `r` holds (the pieces `r` could serve, whether or not
// anyone needs them): for each tensor `r` holds a shard of, on_shard(tensor, shard), then
// on_region(tensor, d, t, region index, region, old stages, new stages) for each region of new
// shard (d, t) held by `r`, in tensor, t, d, region order.
template <class OnShard, class OnRegion>
void ForEachServedRegion(const PlanInput& in, int32_t r, OnShard&& on_shard, OnRegion&& on_region) {
  const ParallelConfig& oc = in.old_config;
  const ParallelConfig& nc = in.new_config;
  std::vector<Region> regions;
  std::vector<int> olds, news;
  const auto c = oc.CoordsOf(r);
  for (size_t ti = 0; ti < in.tensors.size(); ++ti) {
    const TensorSpec& spec = in.tensors[ti];
    if (!OnStageUnchecked(spec, oc, c.p)) continue;
    const Shard have = ShardOfUnchecked(spec, oc, r);
    if (have.empty()) continue;
    on_shard(ti, have);
    StagesInto(spec, oc, olds);
    StagesInto(spec, nc, news);
    const bool split = spec.layout.tp_split(), zero = spec.layout.zero_sharded();
    int t_first = 0, t_last = 0;
    if (split) {
      const int kd = spec.layout.tp_dim();
      const int64_t slice = TpSliceWidth(spec, nc);
      const Interval i =
          Intersect(have.frame.dim(kd), Interval{0, spec.shape[static_cast<size_t>(kd)]});
      if (i.empty()) continue;  // all padding
      t_first = static_cast<int>(i.begin / slice);
      t_last = static_cast<int>((i.end - 1) / slice);
    }
    // New shards are indexed by (ZeRO range, TP rank); their replicas hold the same.
    const int groups = zero ? ZeroGroupSize(spec.layout, nc) : 1;
    for (int t = t_first; t <= t_last; ++t) {
      int d_first = 0, d_last = 0;
      if (zero) {
        const Box frame = TpBoxOf(spec, nc, t);
        const DpCut cut = DpCutOf(spec.layout, nc, frame);
        d_first = groups;
        d_last = -1;
        std::vector<Box> bs = split ? IntersectShard(have, frame) : ShardBoxes(have);
        ClipToState(spec, bs);
        for (const Box& b : bs) {
          const DpSpan sp = cut.RanksOf({LinearIn(frame, b, false), LinearIn(frame, b, true) + 1});
          if (sp.first > sp.last) continue;
          d_first = std::min(d_first, sp.first);
          d_last = std::max(d_last, sp.last);
        }
      }
      for (int d = d_first; d <= d_last; ++d) {
        const Shard need = ShardAt(spec, nc, d, t);
        RegionsOf(spec, oc, need, regions);
        for (size_t ri = 0; ri < regions.size(); ++ri) {
          if (regions[ri].HeldBy(c.d, c.t)) on_region(ti, d, t, ri, regions[ri], olds, news);
        }
      }
    }
  }
}

}  // namespace

std::optional<Planner::LostPiece> Planner::FirstLostPiece() const {
  const PlanInput& in = *in_;
  const Ctx ctx{in, assignment_};
  std::vector<int> holders;
  std::optional<LostPiece> found;
  // A piece nobody alive holds was held by gone old ranks only: looking at theirs finds it.
  for (int32_t r = 0; r < in.old_config.world() && !found; ++r) {
    if (in.old_participant_of_rank[static_cast<size_t>(r)] >= 0) continue;
    ForEachServedRegion(
        in, r, [](size_t, const Shard&) {},
        [&](size_t ti, int d, int t, size_t, const Region& rg, const std::vector<int>& olds,
            const std::vector<int>& news) {
          if (found || news.empty()) return;
          ctx.Holders(rg, olds, holders);
          if (!holders.empty()) return;
          const int s = in.new_config.RankOf({news.front(), d, t});
          found =
              LostPiece{.tensor = static_cast<int32_t>(ti),
                        .box = rg.box,
                        .new_rank = s,
                        .participant = assignment_.participant_of_new_rank[static_cast<size_t>(s)]};
        });
  }
  return found;
}

StatusOr<LocalPlan> Planner::PlanFor(int32_t q, std::vector<PieceMove>* lost) const {
  const PlanInput& in = *in_;
  if (q < 0 || q >= in.num_participants) {
    return BadInput("participant " + std::to_string(q) +
                    " is not in [0, num_participants=" + std::to_string(in.num_participants) + ")");
  }
  const ParallelConfig& oc = in.old_config;
  const ParallelConfig& nc = in.new_config;
  const Ctx ctx{in, assignment_};
  LocalPlan lp;
  lp.participant = q;
  lp.num_participants = in.num_participants;
  lp.digest = digest_;
  const size_t nt = in.tensors.size();
  lp.tensors.reserve(nt);
  for (const TensorSpec& t : in.tensors) {
    TensorInfo info{t.name, t.dtype, t.shape, {}};
    if (t.layout.pad_multiple() > 0) {  // frames of both generations lie in padded_shape
      info.padded_shape = t.shape;
      const size_t k = static_cast<size_t>(t.layout.tp_dim());
      info.padded_shape[k] = std::max(SplitLength(t, oc), SplitLength(t, nc));
    }
    lp.tensors.push_back(std::move(info));
  }
  lp.old_shards.resize(nt);
  lp.new_shards.resize(nt);
  const int32_t r = assignment_.old_rank_of_participant[static_cast<size_t>(q)];
  const int32_t s = assignment_.new_rank_of_participant[static_cast<size_t>(q)];
  std::vector<Region> regions;
  std::vector<int> recv_ranks, holders, olds, news;
  std::vector<PieceMove> lost_here;

  if (s >= 0) {  // what q needs, and from whom
    const auto c = nc.CoordsOf(s);
    for (size_t ti = 0; ti < nt; ++ti) {
      const TensorSpec& spec = in.tensors[ti];
      if (!OnStageUnchecked(spec, nc, c.p)) continue;
      const Shard need = ShardOfUnchecked(spec, nc, s);
      if (need.empty()) continue;
      lp.new_shards[ti] = need;
      StagesInto(spec, oc, olds);
      StagesInto(spec, nc, news);
      RegionsOf(spec, oc, need, regions);
      for (size_t ri = 0; ri < regions.size(); ++ri) {
        const Region& rg = regions[ri];
        if (ctx.Resident(q, rg, olds)) {
          lp.local_copies.push_back({static_cast<int32_t>(ti), q, rg.box});
          continue;
        }
        ctx.Holders(rg, olds, holders);
        if (holders.empty() && lost != nullptr) {
          lost_here.push_back({static_cast<int32_t>(ti), -1, rg.box});
          continue;
        }
        if (holders.empty()) {
          return DataLossError("tensor '" + spec.name + "': box " + rg.box.ToString() +
                               " needed by new rank " + std::to_string(s) +
                               " has no surviving holder in the old generation");
        }
        ctx.Receivers(spec, news, c.d, c.t, rg, olds, recv_ranks);
        const int j = static_cast<int>(std::lower_bound(recv_ranks.begin(), recv_ranks.end(), s) -
                                       recv_ranks.begin());
        const int h = static_cast<int>(holders.size());
        const int k = ChunkCount(rg.box, static_cast<int>(recv_ranks.size()), h);
        const size_t rot = (ti + ri) % static_cast<size_t>(h);
        for (int ch = 0; ch < k; ++ch) {
          const int from = holders[(static_cast<size_t>(j) * k + ch + rot) % h];
          lp.recvs.push_back({static_cast<int32_t>(ti),
                              in.old_participant_of_rank[static_cast<size_t>(from)],
                              Chunk(rg.box, k, ch)});
        }
      }
    }
  }

  if (r >= 0) {  // what q serves, to whom
    ForEachServedRegion(
        in, r, [&](size_t ti, const Shard& have) { lp.old_shards[ti] = have; },
        [&](size_t ti, int d, int t, size_t ri, const Region& rg, const std::vector<int>& olds,
            const std::vector<int>& news) {
          ctx.Receivers(in.tensors[ti], news, d, t, rg, olds, recv_ranks);
          if (recv_ranks.empty()) return;
          ctx.Holders(rg, olds, holders);
          const int h = static_cast<int>(holders.size());
          const int me = static_cast<int>(std::lower_bound(holders.begin(), holders.end(), r) -
                                          holders.begin());
          const int k = ChunkCount(rg.box, static_cast<int>(recv_ranks.size()), h);
          const size_t rot = (ti + ri) % static_cast<size_t>(h);
          for (size_t j = 0; j < recv_ranks.size(); ++j) {
            for (int ch = 0; ch < k; ++ch) {
              if (static_cast<int>((j * k + ch + rot) % h) != me) continue;
              lp.sends.push_back(
                  {static_cast<int32_t>(ti),
                   assignment_.participant_of_new_rank[static_cast<size_t>(recv_ranks[j])],
                   Chunk(rg.box, k, ch)});
            }
          }
        });
  }

  SortMoves(lp.sends);
  SortMoves(lp.recvs);
  SortMoves(lp.local_copies);
  if (lost != nullptr) {
    SortMoves(lost_here);
    lost->insert(lost->end(), lost_here.begin(), lost_here.end());
    lp.lost = std::move(lost_here);  // the executor checks recvs + local_copies + lost cover
  }
  return lp;
}

StatusOr<std::vector<LocalPlan>> Planner::PlanAll(std::vector<std::vector<PieceMove>>* lost) const {
  std::vector<LocalPlan> plans;
  plans.reserve(static_cast<size_t>(in_->num_participants));
  if (lost != nullptr) lost->assign(static_cast<size_t>(in_->num_participants), {});
  for (int32_t q = 0; q < in_->num_participants; ++q) {
    MORPH_ASSIGN_OR_RETURN(LocalPlan lp,
                           PlanFor(q, lost ? &(*lost)[static_cast<size_t>(q)] : nullptr),
                           "participant " << q);
    plans.push_back(std::move(lp));
  }
  return plans;
}

StatusOr<PlanSummary> Planner::Summarize(const std::vector<LocalPlan>& plans,
                                         const std::vector<std::vector<PieceMove>>* lost) const {
  PlanSummary sum;
  const size_t n = static_cast<size_t>(in_->num_participants);
  if (plans.size() != n) {
    return BadInput("Summarize got " + std::to_string(plans.size()) + " plans for " +
                    std::to_string(n) + " participants");
  }
  if (lost != nullptr && lost->size() != n) {
    return BadInput("Summarize got " + std::to_string(lost->size()) + " lost lists for " +
                    std::to_string(n) + " participants");
  }
  const Totals t = ComputeTotals();
  if (t.overflow) {
    return BadInput(
        "bytes needed: the new shards of all ranks hold more than 2^63-1 bytes in "
        "total (int64 overflow); no plan can move that");
  }
  // Every other sum is bounded by bytes needed for consistent plans; checked anyway, since the
  // plans are an argument.
  bool overflow = false;
  auto add = [&overflow](int64_t& acc, int64_t b) {
    overflow |= __builtin_add_overflow(acc, b, &acc);
  };
  for (size_t q = 0; lost != nullptr && q < n; ++q) {
    for (const PieceMove& m : (*lost)[q]) add(sum.bytes_lost, PieceBytes(plans[q], m));
  }
  sum.bytes_needed = t.needed;
  sum.bytes_resident = t.resident;
  sum.bytes_lower_bound = t.needed - t.resident;
  sum.bytes_sent.assign(n, 0);
  sum.bytes_received.assign(n, 0);
  std::map<std::pair<int32_t, int32_t>, int64_t> links;
  int64_t sent_total = 0;
  for (const LocalPlan& lp : plans) {
    for (const PieceMove& m : lp.sends) {
      const int64_t b = PieceBytes(lp, m);
      add(sum.bytes_sent[static_cast<size_t>(lp.participant)], b);
      add(links[{lp.participant, m.peer}], b);
      add(sent_total, b);
      ++sum.num_sends;
    }
    for (const PieceMove& m : lp.recvs) {
      const int64_t b = PieceBytes(lp, m);
      add(sum.bytes_received[static_cast<size_t>(lp.participant)], b);
      add(sum.bytes_moved, b);
    }
  }
  if (overflow) return BadInput("the plans' byte totals overflow int64");
  if (sent_total != sum.bytes_moved) {
    return InternalError("plans disagree: " + std::to_string(sent_total) + " bytes sent, " +
                         std::to_string(sum.bytes_moved) + " received");
  }
  for (const auto& [link, bytes] : links) {
    if (bytes > sum.busiest_link.bytes) sum.busiest_link = {link.first, link.second, bytes};
  }
  int64_t best_s = 0, best_r = 0;
  for (size_t q = 0; q < n; ++q) {
    if (sum.bytes_sent[q] > best_s) best_s = sum.bytes_sent[q], sum.busiest_sender = int32_t(q);
    if (sum.bytes_received[q] > best_r) {
      best_r = sum.bytes_received[q];
      sum.busiest_receiver = static_cast<int32_t>(q);
    }
  }
  return sum;
}

}  // namespace morph
