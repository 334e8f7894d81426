#include "collectives/groups.h"

#include <algorithm>
#include <thread>

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

StatusOr<std::unique_ptr<GroupSet>> GroupBuilder::Build(Store& store, const ParallelConfig& config,
                                                        int rank, int world_size,
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
  struct Spec {
    std::string name;
    int rank;
    int size;
    std::unique_ptr<Communicator>* out;
    Status status;
  };
  std::vector<Spec> specs;
  specs.push_back({"world", rank, world_size, &set->world_, Status::Ok()});
  if (rank < config.world()) {  // standby workers join the world group only
    auto position = [&](const std::vector<int>& group) {
      return static_cast<int>(std::find(group.begin(), group.end(), rank) - group.begin());
    };
    ParallelConfig::Coords c = config.CoordsOf(rank);
    const std::vector<int> dp = config.DpGroup(rank), tp = config.TpGroup(rank),
                           pp = config.PpGroup(rank);
    specs.push_back({"dp/p" + std::to_string(c.p) + "t" + std::to_string(c.t), position(dp),
                     static_cast<int>(dp.size()), &set->dp_, Status::Ok()});
    specs.push_back({"tp/p" + std::to_string(c.p) + "d" + std::to_string(c.d), position(tp),
                     static_cast<int>(tp.size()), &set->tp_, Status::Ok()});
    specs.push_back({"pp/d" + std::to_string(c.d) + "t" + std::to_string(c.t), position(pp),
                     static_cast<int>(pp.size()), &set->pp_, Status::Ok()});
  }
  // Backends that split (NCCL) derive the subgroups from the world communicator, collectively
  // and in the same order on every rank; standby workers opt out of all three.
  if (split_) {
    MORPH_ASSIGN_OR_RETURN(set->world_, factory_(store, "world", rank, world_size, deadline),
                           "building world group of generation " << store.generation());
    if (!set->world_->capabilities().split) {
      return InvalidArgumentError("group builder: " + set->world_->capabilities().backend +
                                  " cannot split; build without GroupBuilder::SplitFromWorld");
    }
    const bool member = rank < config.world();
    ParallelConfig::Coords c = member ? config.CoordsOf(rank) : ParallelConfig::Coords{};
    struct SplitSpec {
      int color;
      int key;
      size_t spec;
    } splits[] = {{c.p * config.tp + c.t, c.d, 1},
                  {c.p * config.dp + c.d, c.t, 2},
                  {c.d * config.tp + c.t, c.p, 3}};
    for (const SplitSpec& sp : splits) {
      const std::string name = member ? specs[sp.spec].name : "standby";
      MORPH_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub,
                             set->world_->Split(member ? sp.color : -1, sp.key, name, deadline),
                             "splitting group " << name << " of generation " << store.generation());
      if (member) *specs[sp.spec].out = std::move(sub);
    }
    return set;
  }
  // The groups rendezvous concurrently: each under its own name, so they cannot deadlock on
  // each other, and a generation costs about one rendezvous instead of four.
  auto build = [&](Spec& s) {
    StatusOr<std::unique_ptr<Communicator>> c = factory_(store, s.name, s.rank, s.size, deadline);
    if (c.ok()) {
      *s.out = *std::move(c);
    } else {
      s.status = c.status();
    }
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < specs.size(); ++i) threads.emplace_back(build, std::ref(specs[i]));
  build(specs[0]);
  for (auto& t : threads) t.join();
  for (const Spec& s : specs) {
    MORPH_RETURN_IF_ERROR(s.status)
        << "building " << (s.name == "world" ? "world group" : "group " + s.name)
        << " of generation " << store.generation();
  }
  return set;
}

}  // namespace morph
