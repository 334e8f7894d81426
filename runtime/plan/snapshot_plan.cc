#include "runtime/plan/snapshot_plan.h"

#include <algorithm>
#include <map>
#include <set>

#include "reshard/executor.h"
#include "reshard/plan_digest.h"

namespace morph {
namespace {

bool Contains(std::span<const WorkerId> v, WorkerId w) {
  return std::find(v.begin(), v.end(), w) != v.end();
}

using BoxesByTensor = std::map<int32_t, std::vector<Box>>;

BoxesByTensor ByTensor(const std::vector<PieceMove>& pieces) {
  BoxesByTensor out;
  for (const PieceMove& m : pieces) out[m.tensor].push_back(m.box);
  return out;
}

// The parts of `pieces` inside `keep` (per tensor), each piece cut by each box in turn.
std::vector<PieceMove> Cut(const std::vector<PieceMove>& pieces, const BoxesByTensor& keep) {
  std::vector<PieceMove> out;
  for (const PieceMove& m : pieces) {
    auto it = keep.find(m.tensor);
    if (it == keep.end()) continue;
    for (const Box& k : it->second) {
      Box b = Intersect(m.box, k);
      if (!b.empty()) out.push_back({m.tensor, m.peer, std::move(b)});
    }
  }
  return out;
}

// The planner's list order (tensor, then box origin; the peer last): both ends of a pair sort
// the same pieces alike.
void Sort(std::vector<PieceMove>& v) {
  std::sort(v.begin(), v.end(), [](const PieceMove& a, const PieceMove& b) {
    if (a.tensor != b.tensor) return a.tensor < b.tensor;
    const std::vector<int64_t> oa = a.box.origin(), ob = b.box.origin();
    if (oa != ob) return oa < ob;
    return a.peer < b.peer;
  });
}

}  // namespace

StatusOr<SnapshotChangePlan> PlanForSnapshot(const JobManifest& manifest, const Generation& from,
                                             const Generation& next,
                                             const ChangeParticipants& change,
                                             std::span<const WorkerId> holders,
                                             std::span<const std::vector<int64_t>> held_tensors) {
  const std::string gen = "snapshot recovery into generation " + std::to_string(next.id);
  if (from.id == 0) return InvalidArgumentError(gen + ": the first generation has no snapshot");
  if (holders.size() != from.ranks.size()) {
    return InvalidArgumentError(gen + ": " + std::to_string(holders.size()) +
                                " snapshot holders for " + std::to_string(from.ranks.size()) +
                                " old ranks");
  }
  if (!held_tensors.empty() && held_tensors.size() != from.ranks.size()) {
    return InvalidArgumentError(gen + ": held tensor lists for " +
                                std::to_string(held_tensors.size()) + " of " +
                                std::to_string(from.ranks.size()) + " old ranks");
  }
  std::set<WorkerId> serves_other;
  std::set<WorkerId> expected_stale;
  bool any_other = false;
  for (size_t r = 0; r < holders.size(); ++r) {
    const WorkerId h = holders[r];
    const WorkerId w = from.ranks[r];
    const std::string who = "old rank " + std::to_string(r) + " (worker " + std::to_string(w) +
                            ") is served by worker " + std::to_string(h);
    if (h >= 0 &&
        (from.RankOf(h) < 0 || Contains(change.lost, h) || !Contains(change.participants, h))) {
      return InvalidArgumentError(gen + ": " + who +
                                  ", which is no surviving participant holding an old rank");
    }
    if (h == w) continue;
    if (!Contains(change.lost, w)) expected_stale.insert(w);
    if (h < 0) continue;  // no copy: every piece of it must come from another rank's own copy
    any_other = true;
    if (!serves_other.insert(h).second) {
      return InvalidArgumentError(gen + ": worker " + std::to_string(h) +
                                  " serves the snapshots of two other old ranks");
    }
  }
  const std::set<WorkerId> stale(change.stale.begin(), change.stale.end());
  if (stale != expected_stale || stale.size() != change.stale.size()) {
    return InvalidArgumentError(gen +
                                ": stale workers must be exactly the live old ranks "
                                "served by their buddy's copy");
  }
  SnapshotChangePlan out;
  out.held_tensors.assign(held_tensors.begin(), held_tensors.end());
  MORPH_ASSIGN_OR_RETURN(out.own, PlanForChange(manifest, from, next, change), gen);
  if (!out.own.planner) return InvalidArgumentError(gen + ": nothing to plan");
  if (!any_other) {
    out.digest = DigestHasher().Add("snapshot").Add(out.own.digest).value();
    return out;
  }
  PlanInput in = out.own.planner->input();
  std::fill(in.old_participant_of_rank.begin(), in.old_participant_of_rank.end(), -1);
  for (size_t r = 0; r < holders.size(); ++r) {
    if (holders[r] >= 0 && holders[r] != from.ranks[r]) {
      in.old_participant_of_rank[r] = out.own.IndexOf(holders[r]);
      out.ward_of.emplace(in.old_participant_of_rank[r], static_cast<int>(r));
    }
  }
  Assignment a;
  a.participant_of_new_rank = out.own.planner->assignment().participant_of_new_rank;
  MORPH_ASSIGN_OR_RETURN(Planner held, Planner::Create(std::move(in), std::move(a)),
                         gen << ": the held copies' round");
  const uint64_t held_digest = WithMessageLayout(held.digest(), out.own.executor,
                                                 static_cast<int>(out.own.participants.size()))
                                   .combined();
  out.held.emplace(std::move(held));
  out.digest = DigestHasher().Add("snapshot").Add(out.own.digest).Add(held_digest).value();
  return out;
}

StatusOr<SnapshotRounds> PlanSnapshotRounds(const SnapshotChangePlan& plan, int32_t participant) {
  if (!plan.own.planner) return InvalidArgumentError("snapshot recovery: no plan");
  SnapshotRounds out;
  std::vector<PieceMove> lost_own;
  MORPH_ASSIGN_OR_RETURN(out.own, plan.own.planner->PlanFor(participant, &lost_own),
                         "snapshot recovery, own copies");
  auto data_loss = [&](const PieceMove& m, const Box& box) {
    const std::string name = out.own.tensors.at(static_cast<size_t>(m.tensor)).name;
    return DataLossError(
        "no snapshot copy of tensor '" + name + "' box " + box.ToString() +
        " (needed by participant " + std::to_string(participant) + ", worker " +
        std::to_string(plan.own.participants.at(static_cast<size_t>(participant))) + ")");
  };
  if (!plan.held) {
    if (!lost_own.empty()) return data_loss(lost_own.front(), lost_own.front().box);
    return out;
  }
  std::vector<PieceMove> lost_held;
  MORPH_ASSIGN_OR_RETURN(LocalPlan b, plan.held->PlanFor(participant, &lost_held),
                         "snapshot recovery, held copies");
  // An element lost in both rounds has no copy at all.
  const BoxesByTensor lost_own_by_tensor = ByTensor(lost_own);
  for (const PieceMove& m : Cut(lost_held, lost_own_by_tensor)) return data_loss(m, m.box);

  b.recvs = Cut(b.recvs, lost_own_by_tensor);
  b.local_copies = Cut(b.local_copies, lost_own_by_tensor);
  // A held copy holds only its ward's pieces with no other copy (runtime/recovery/snapshot.h):
  // what this participant needs from one must be among them, as its holder reported.
  if (!plan.held_tensors.empty()) {
    for (const auto* list : {&b.recvs, &b.local_copies}) {
      for (const PieceMove& m : *list) {
        const int32_t sender = list == &b.recvs ? m.peer : participant;
        const auto ward = plan.ward_of.find(sender);
        if (ward == plan.ward_of.end()) return InternalError("round B piece from a non-holder");
        const std::vector<int64_t>& held = plan.held_tensors.at(static_cast<size_t>(ward->second));
        if (!std::binary_search(held.begin(), held.end(), int64_t{m.tensor})) {
          return data_loss(m, m.box);
        }
      }
    }
  }
  // Sends: cut to each receiver's round-A lost pieces.
  std::map<int32_t, std::vector<PieceMove>> sends_to;
  for (const PieceMove& m : b.sends) sends_to[m.peer].push_back(m);
  b.sends.clear();
  for (auto& [peer, pieces] : sends_to) {
    std::vector<PieceMove> peer_lost;
    MORPH_ASSIGN_OR_RETURN(LocalPlan peer_own, plan.own.planner->PlanFor(peer, &peer_lost),
                           "snapshot recovery, participant " << peer << "'s own copies");
    (void)peer_own;
    std::vector<PieceMove> cut = Cut(pieces, ByTensor(peer_lost));
    b.sends.insert(b.sends.end(), cut.begin(), cut.end());
  }
  // Round B reads only the tensors its pieces come from: a held copy need hold no other.
  std::vector<bool> read(b.tensors.size(), false);
  for (const auto* list : {&b.sends, &b.local_copies}) {
    for (const PieceMove& m : *list) read[static_cast<size_t>(m.tensor)] = true;
  }
  for (size_t t = 0; t < read.size(); ++t) {
    if (!read[t]) b.old_shards[t].reset();
  }
  // What round A writes is this round's lost part.
  b.lost.clear();
  for (const auto* list : {&out.own.recvs, &out.own.local_copies}) {
    for (const PieceMove& m : *list) b.lost.push_back({m.tensor, -1, m.box});
  }
  Sort(b.sends);
  Sort(b.recvs);
  Sort(b.local_copies);
  Sort(b.lost);
  out.held = std::move(b);
  return out;
}

}  // namespace morph
