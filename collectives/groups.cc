#include "collectives/groups.h"

#include <algorithm>

#include "collectives/gloo_communicator.h"

namespace morph {

CommunicatorFactory GlooFactory(std::shared_ptr<GlooDevice> device) {
  return [device](Store& store, std::string_view name, int rank, int size,
                  Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    MORPH_ASSIGN_OR_RETURN(auto comm,
                           GlooCommunicator::Create(store, name, rank, size, device, deadline));
    return std::unique_ptr<Communicator>(std::move(comm));
  };
}

void GroupSet::AbortAll() {
  for (auto* c : {world_.get(), dp_.get(), tp_.get(), pp_.get()}) {
    if (c != nullptr) c->Abort();
  }
}

GroupSet::~GroupSet() {
  // Subgroups first; each destructor aborts only what is still running.
  pp_.reset();
  tp_.reset();
  dp_.reset();
  world_.reset();
}

StatusOr<std::unique_ptr<GroupSet>> GroupBuilder::Build(Store& store,
                                                        const ParallelConfig& config, int rank,
                                                        int world_size,
                                                        Deadline deadline) const {
  MORPH_RETURN_IF_ERROR(config.Validate());
  if (world_size < config.world()) {
    return InvalidArgumentError("group builder: world size " + std::to_string(world_size) +
                                " is smaller than dp*tp*pp=" + std::to_string(config.world()));
  }
  if (rank < 0 || rank >= world_size) {
    return InvalidArgumentError("group builder: rank " + std::to_string(rank) +
                                " out of range [0, " + std::to_string(world_size) + ")");
  }
  auto set = std::unique_ptr<GroupSet>(new GroupSet());
  set->generation_ = store.generation();
  set->config_ = config;
  set->rank_ = rank;
  MORPH_ASSIGN_OR_RETURN(set->world_, factory_(store, "world", rank, world_size, deadline),
                         "building world group of generation " << store.generation());
  if (rank >= config.world()) return set;  // standby

  auto position = [](const std::vector<int>& group, int r) {
    return static_cast<int>(std::find(group.begin(), group.end(), r) - group.begin());
  };
  ParallelConfig::Coords c = config.CoordsOf(rank);
  struct Spec {
    std::string name;
    std::vector<int> members;
    std::unique_ptr<Communicator>* out;
  };
  Spec specs[] = {
      {"dp/p" + std::to_string(c.p) + "t" + std::to_string(c.t), config.DpGroup(rank),
       &set->dp_},
      {"tp/p" + std::to_string(c.p) + "d" + std::to_string(c.d), config.TpGroup(rank),
       &set->tp_},
      {"pp/d" + std::to_string(c.d) + "t" + std::to_string(c.t), config.PpGroup(rank),
       &set->pp_},
  };
  // Every rank builds in the same order (dp, tp, pp), so no rendezvous waits on a rank that
  // is itself waiting on another group.
  for (Spec& s : specs) {
    MORPH_ASSIGN_OR_RETURN(
        *s.out,
        factory_(store, s.name, position(s.members, rank), static_cast<int>(s.members.size()),
                 deadline),
        "building group " << s.name << " of generation " << store.generation());
  }
  return set;
}

}  // namespace morph
