#include "collectives/union_comm.h"

#include <algorithm>
#include <map>
#include <set>

namespace morph {
namespace {

// Worker -> position, or kInvalidArgument naming the list for a duplicate.
StatusOr<std::map<int64_t, int>> Index(const std::vector<int64_t>& list, const char* what) {
  std::map<int64_t, int> at;
  for (size_t i = 0; i < list.size(); ++i) {
    if (!at.emplace(list[i], static_cast<int>(i)).second) {
      return InvalidArgumentError(std::string("union communicator: worker ") +
                                  std::to_string(list[i]) + " is listed twice in " + what);
    }
  }
  return at;
}

// Comm ranks of the participants in `world`, or empty if one is not a member.
std::vector<int> RanksIn(const std::vector<int64_t>& participants,
                         const std::map<int64_t, int>& world) {
  std::vector<int> ranks;
  for (int64_t w : participants) {
    auto it = world.find(w);
    if (it == world.end()) return {};
    ranks.push_back(it->second);
  }
  return ranks;
}

}  // namespace

const char* UnionSourceName(UnionCommPlan::Source s) {
  switch (s) {
    case UnionCommPlan::Source::kOldWorld:
      return "old world";
    case UnionCommPlan::Source::kShrunk:
      return "old world shrunk";
    case UnionCommPlan::Source::kNewWorld:
      return "new world";
    case UnionCommPlan::Source::kFresh:
      return "fresh";
  }
  return "?";
}

StatusOr<UnionCommPlan> PlanUnionComm(const UnionCommInput& in) {
  if (in.participants.empty()) return InvalidArgumentError("union communicator: no participant");
  MORPH_ASSIGN_OR_RETURN(auto parts, Index(in.participants, "the participants"));
  MORPH_ASSIGN_OR_RETURN(auto old_at, Index(in.old_world, "the old world"));
  MORPH_ASSIGN_OR_RETURN(auto new_at, Index(in.new_world, "the new world"));
  const std::set<int64_t> dead(in.dead.begin(), in.dead.end());
  UnionCommPlan plan;

  std::vector<int> old_ranks = RanksIn(in.participants, old_at);
  bool participant_dead = false;
  for (int64_t w : in.participants) participant_dead |= dead.count(w) > 0;
  if (!old_ranks.empty() && !participant_dead) {
    std::vector<int> exclude;
    for (size_t r = 0; r < in.old_world.size(); ++r) {
      if (dead.count(in.old_world[r])) exclude.push_back(static_cast<int>(r));
    }
    if (exclude.empty()) {
      plan.source = UnionCommPlan::Source::kOldWorld;
      plan.comm_rank_of_participant = std::move(old_ranks);
      plan.comm_size = static_cast<int>(in.old_world.size());
      return plan;
    }
    if (in.old_world_shrinks) {
      // Survivors keep their order: new rank = old rank minus the excluded ranks below it.
      plan.source = UnionCommPlan::Source::kShrunk;
      for (int r : old_ranks) {
        plan.comm_rank_of_participant.push_back(
            r - static_cast<int>(std::lower_bound(exclude.begin(), exclude.end(), r) -
                                 exclude.begin()));
      }
      plan.comm_size = static_cast<int>(in.old_world.size() - exclude.size());
      plan.exclude = std::move(exclude);
      return plan;
    }
  }
  std::vector<int> new_ranks = RanksIn(in.participants, new_at);
  if (!new_ranks.empty()) {
    plan.source = UnionCommPlan::Source::kNewWorld;
    plan.comm_rank_of_participant = std::move(new_ranks);
    plan.comm_size = static_cast<int>(in.new_world.size());
    return plan;
  }
  plan.source = UnionCommPlan::Source::kFresh;
  for (size_t p = 0; p < in.participants.size(); ++p) {
    plan.comm_rank_of_participant.push_back(static_cast<int>(p));
  }
  plan.comm_size = static_cast<int>(in.participants.size());
  return plan;
}

StatusOr<UnionComm> BuildUnionComm(const UnionCommPlan& plan, int participant,
                                   Communicator* old_world, Communicator* new_world,
                                   const CommunicatorFactory& fresh, Store& store,
                                   int64_t generation, Deadline deadline) {
  const std::string what = std::string("union communicator (") + UnionSourceName(plan.source) +
                           ") of generation " + std::to_string(generation);
  if (participant < 0 || participant >= static_cast<int>(plan.comm_rank_of_participant.size())) {
    return InvalidArgumentError(what + ": participant " + std::to_string(participant) +
                                " out of range");
  }
  UnionComm u;
  u.plan = plan;
  auto reuse = [&](Communicator* c, const char* which, int size) -> Status {
    if (c == nullptr || c->size() != size) {
      return InvalidArgumentError(what + ": the " + which + " communicator is " +
                                  (c == nullptr ? std::string("missing")
                                                : "of size " + std::to_string(c->size())) +
                                  ", the plan needs " + std::to_string(size));
    }
    return Status::Ok();
  };
  switch (plan.source) {
    case UnionCommPlan::Source::kOldWorld:
      MORPH_RETURN_IF_ERROR(reuse(old_world, "old world", plan.comm_size));
      u.comm = old_world;
      break;
    case UnionCommPlan::Source::kNewWorld:
      MORPH_RETURN_IF_ERROR(reuse(new_world, "new world", plan.comm_size));
      u.comm = new_world;
      break;
    case UnionCommPlan::Source::kShrunk: {
      MORPH_RETURN_IF_ERROR(reuse(old_world, "old world",
                                  plan.comm_size + static_cast<int>(plan.exclude.size())));
      MORPH_ASSIGN_OR_RETURN(
          u.owned, old_world->Shrink(plan.exclude, ShrinkMode::kFailure, generation, deadline),
          what);
      u.comm = u.owned.get();
      break;
    }
    case UnionCommPlan::Source::kFresh:
      if (!fresh) return InvalidArgumentError(what + ": no factory for a fresh communicator");
      MORPH_ASSIGN_OR_RETURN(u.owned,
                             fresh(store, "change/device", participant, plan.comm_size, deadline),
                             what);
      u.comm = u.owned.get();
      break;
  }
  const int expected = plan.comm_rank_of_participant[static_cast<size_t>(participant)];
  if (u.comm->rank() != expected) {
    return InternalError(what + ": participant " + std::to_string(participant) +
                         " is communicator rank " + std::to_string(u.comm->rank()) +
                         ", the plan says " + std::to_string(expected));
  }
  return u;
}

}  // namespace morph
