#include "runtime/plan/plan_input.h"

#include <algorithm>
#include <map>
#include <set>
#include <type_traits>

#include "morph/dtype.h"
#include "reshard/plan_digest.h"
#include "runtime/protocol/fields.h"

namespace morph {
namespace {

// Hashes every field of the manifest's field list (runtime/protocol/fields.h): a list as its
// length and items, a dtype by name, a layout as its ToString.
struct ManifestHasher {
  DigestHasher& h;
  template <typename T>
  void operator()(std::string_view, const T& x) {
    if constexpr (std::is_same_v<T, bool>) {
      h.Add(static_cast<int>(x));
    } else if constexpr (std::is_integral_v<T>) {
      h.Add(x);
    } else if constexpr (std::is_same_v<T, std::string>) {
      h.Add(std::string_view(x));
    } else if constexpr (std::is_same_v<T, DType>) {
      h.Add(DTypeName(x));
    } else if constexpr (std::is_same_v<T, Layout>) {
      h.Add(x.ToString());
    } else if constexpr (requires { x.begin(); x.size(); }) {
      h.Add(static_cast<int64_t>(x.size()));
      for (const auto& e : x) (*this)("", e);
    } else {
      fields::Fields(*this, x);
    }
  }
};

bool Contains(std::span<const WorkerId> v, WorkerId w) {
  return std::find(v.begin(), v.end(), w) != v.end();
}

void AddConfig(DigestHasher& h, const ParallelConfig& c) {
  h.Add(c.dp).Add(c.tp).Add(c.pp).Add(c.zero_stage).Add(c.micro_batches);
  h.Add(static_cast<int64_t>(c.stage_of_layer.size()));
  for (int s : c.stage_of_layer) h.Add(s);
}

}  // namespace

std::vector<WorkerId> ParticipantOrder(const Generation& from, std::span<const WorkerId> lost,
                                       std::span<const WorkerId> next_ranks) {
  std::vector<WorkerId> out;
  for (WorkerId w : from.ranks) {
    if (!Contains(lost, w)) out.push_back(w);
  }
  std::vector<WorkerId> fresh;
  for (WorkerId w : next_ranks) {
    if (from.RankOf(w) < 0) fresh.push_back(w);
  }
  std::sort(fresh.begin(), fresh.end());
  out.insert(out.end(), fresh.begin(), fresh.end());
  return out;
}

int32_t ChangePlan::IndexOf(WorkerId w) const {
  auto it = std::find(participants.begin(), participants.end(), w);
  return it == participants.end() ? -1 : static_cast<int32_t>(it - participants.begin());
}

StatusOr<std::vector<WorkerId>> AssignRanks(const JobManifest& manifest, const Generation& from,
                                            std::span<const WorkerId> lost,
                                            std::span<const WorkerId> candidates,
                                            const ParallelConfig& next_config) {
  MORPH_RETURN_IF_ERROR(next_config.Validate());
  const size_t world = static_cast<size_t>(next_config.world());
  if (candidates.size() < world) {
    return FailedPreconditionError("config " + next_config.ToString() + " needs " +
                                   std::to_string(world) + " workers, only " +
                                   std::to_string(candidates.size()) + " candidates");
  }
  std::set<WorkerId> unique(candidates.begin(), candidates.end());
  if (unique.size() != candidates.size()) {
    return InvalidArgumentError("candidates: a worker is listed twice");
  }
  if (from.id == 0) {
    return std::vector<WorkerId>(unique.begin(), std::next(unique.begin(), world));
  }
  // Participants: live old ranks (old-rank order), then candidates that held no old rank.
  std::vector<WorkerId> participants;
  std::vector<int32_t> old_participant_of_rank(from.ranks.size(), -1);
  for (size_t r = 0; r < from.ranks.size(); ++r) {
    if (Contains(lost, from.ranks[r])) continue;
    old_participant_of_rank[r] = static_cast<int32_t>(participants.size());
    participants.push_back(from.ranks[r]);
  }
  for (WorkerId w : unique) {
    if (from.RankOf(w) < 0) participants.push_back(w);
  }
  std::map<WorkerId, int32_t> index;
  for (size_t i = 0; i < participants.size(); ++i) index[participants[i]] = static_cast<int32_t>(i);
  PlanInput in;
  in.tensors = manifest.tensors;
  in.old_config = from.config;
  in.old_participant_of_rank = std::move(old_participant_of_rank);
  in.new_config = next_config;
  for (WorkerId w : unique) in.available.push_back(index.at(w));
  std::sort(in.available.begin(), in.available.end());
  in.num_participants = static_cast<int32_t>(participants.size());
  MORPH_ASSIGN_OR_RETURN(Assignment a, ComputeAssignment(in));
  std::vector<WorkerId> ranks;
  ranks.reserve(world);
  for (int32_t p : a.participant_of_new_rank) ranks.push_back(participants.at(p));
  return ranks;
}

StatusOr<ChangePlan> PlanForChange(const JobManifest& manifest, const Generation& from,
                                   const Generation& next, const ChangeParticipants& change) {
  ChangePlan out;
  out.participants = change.participants;
  out.executor.chunk_bytes = manifest.chunk_bytes;
  out.executor.staging_bytes = manifest.staging_bytes;
  MORPH_RETURN_IF_ERROR(next.config.Validate());
  if (next.ranks.size() != static_cast<size_t>(next.config.world())) {
    return InvalidArgumentError("generation " + std::to_string(next.id) + ": " +
                                std::to_string(next.ranks.size()) + " ranks for config " +
                                next.config.ToString());
  }
  if (from.id == 0) {
    DigestHasher h;
    h.Add(ManifestDigest(manifest));
    AddConfig(h, next.config);
    for (WorkerId w : next.ranks) h.Add(w);
    out.digest = h.value();
    return out;
  }
  std::vector<WorkerId> expected = ParticipantOrder(from, change.lost, next.ranks);
  if (expected != change.participants) {
    return InvalidArgumentError("generation " + std::to_string(next.id) +
                                ": participants are not in the protocol's order (old ranks, "
                                "then joiners by worker id)");
  }
  std::map<WorkerId, int32_t> index;
  for (size_t i = 0; i < out.participants.size(); ++i) {
    index[out.participants[i]] = static_cast<int32_t>(i);
  }
  PlanInput in;
  in.tensors = manifest.tensors;
  in.old_config = from.config;
  in.old_participant_of_rank.assign(from.ranks.size(), -1);
  for (size_t r = 0; r < from.ranks.size(); ++r) {
    auto it = index.find(from.ranks[r]);
    // A stale participant's old state is not used (a recovery): its old rank's pieces come
    // from replicas, as a lost rank's do.
    if (it != index.end() && !Contains(change.stale, from.ranks[r])) {
      in.old_participant_of_rank[r] = it->second;
    }
  }
  for (WorkerId w : change.stale) {
    if (from.RankOf(w) < 0 || !index.count(w)) {
      return InvalidArgumentError("generation " + std::to_string(next.id) + ": stale worker " +
                                  std::to_string(w) + " is no participant holding an old rank");
    }
  }
  in.new_config = next.config;
  Assignment a;
  for (WorkerId w : next.ranks) {
    auto it = index.find(w);
    if (it == index.end()) {
      return InvalidArgumentError("generation " + std::to_string(next.id) + ": worker " +
                                  std::to_string(w) + " holds a rank but is no participant");
    }
    a.participant_of_new_rank.push_back(it->second);
    in.available.push_back(it->second);
  }
  std::sort(in.available.begin(), in.available.end());
  in.num_participants = static_cast<int32_t>(out.participants.size());
  MORPH_ASSIGN_OR_RETURN(Planner planner, Planner::Create(std::move(in), std::move(a)));
  out.digest = WithMessageLayout(planner.digest(), out.executor,
                                 static_cast<int>(out.participants.size())).combined();
  out.planner.emplace(std::move(planner));
  return out;
}

uint64_t ManifestDigest(const JobManifest& m) {
  DigestHasher h;
  ManifestHasher v{h};
  fields::Fields(v, m);
  return h.value();
}

}  // namespace morph
