#include "collectives/groups.h"

#include <algorithm>
#include <mutex>
#include <thread>

#include "collectives/gloo/gloo_communicator.h"

namespace morph {

namespace {

// The device of a factory that makes it on first use; copies of the factory share it.
struct LazyGlooDevice {
  explicit LazyGlooDevice(GlooOptions o) : options(std::move(o)) {}
  StatusOr<std::shared_ptr<GlooDevice>> Get() {
    std::lock_guard<std::mutex> lock(mu);
    if (device == nullptr) {
      MORPH_ASSIGN_OR_RETURN(device, GlooDevice::Create(options));
    }
    return device;
  }
  const GlooOptions options;
  std::mutex mu;
  std::shared_ptr<GlooDevice> device;
};

}  // namespace

CommunicatorFactory GlooFactory(std::shared_ptr<GlooDevice> device) {
  if (device == nullptr) return GlooFactory(GlooOptions{});
  return [device](Store& store, std::string_view name, int rank, int size,
                  Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    MORPH_ASSIGN_OR_RETURN(auto comm,
                           GlooCommunicator::Create(store, name, rank, size, device, deadline));
    return std::unique_ptr<Communicator>(std::move(comm));
  };
}

CommunicatorFactory GlooFactory(const GlooOptions& options) {
  auto lazy = std::make_shared<LazyGlooDevice>(options);
  return [lazy](Store& store, std::string_view name, int rank, int size,
                Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    MORPH_ASSIGN_OR_RETURN(std::shared_ptr<GlooDevice> device, lazy->Get());
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

namespace {

// Drops the set's reference to `c`. A communicator held elsewhere too (GroupSet::Shared) is
// aborted first, so that its other owner gets kAborted instead of a generation that is over;
// one held only here is destroyed, which aborts only what still runs on it.
void Release(std::shared_ptr<Communicator>& c) {
  if (c != nullptr && c.use_count() > 1) c->Abort();
  c.reset();
}

}  // namespace

std::shared_ptr<Communicator> GroupSet::Shared(const Communicator& c) const {
  for (const std::shared_ptr<Communicator>* s : {&world_, &dp_, &tp_, &pp_}) {
    if (s->get() == &c) return *s;
  }
  return nullptr;
}

GroupSet::~GroupSet() {
  // Subgroups first.
  Release(pp_);
  Release(tp_);
  Release(dp_);
  Release(world_);
}

struct GroupBuilder::Spec {
  std::string name;
  int rank;
  int size;
  std::shared_ptr<Communicator>* out;
  Status status;
};

std::vector<GroupBuilder::Spec> GroupBuilder::Specs(GroupSet& set, const ParallelConfig& config,
                                                    int rank, int world_size) {
  std::vector<Spec> specs;
  specs.push_back({"world", rank, world_size, &set.world_, Status::Ok()});
  if (rank < config.world()) {  // standby workers join the world group only
    auto position = [&](const std::vector<int>& group) {
      return static_cast<int>(std::find(group.begin(), group.end(), rank) - group.begin());
    };
    ParallelConfig::Coords c = config.CoordsOf(rank);
    const std::vector<int> dp = config.DpGroup(rank), tp = config.TpGroup(rank),
                           pp = config.PpGroup(rank);
    specs.push_back({"dp/p" + std::to_string(c.p) + "t" + std::to_string(c.t), position(dp),
                     static_cast<int>(dp.size()), &set.dp_, Status::Ok()});
    specs.push_back({"tp/p" + std::to_string(c.p) + "d" + std::to_string(c.d), position(tp),
                     static_cast<int>(tp.size()), &set.tp_, Status::Ok()});
    specs.push_back({"pp/d" + std::to_string(c.d) + "t" + std::to_string(c.t), position(pp),
                     static_cast<int>(pp.size()), &set.pp_, Status::Ok()});
  }
  return specs;
}

Status GroupBuilder::BuildSubgroups(GroupSet& set, std::vector<Spec>& specs, Store& store,
                                    const ParallelConfig& config, bool split,
                                    Deadline deadline) const {
  const int rank = set.rank_;
  // Backends that split (NCCL) derive the subgroups from the world communicator, collectively
  // and in the same order on every rank; standby workers opt out of all three.
  if (split) {
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
                             set.world_->Split(member ? sp.color : -1, sp.key, name, deadline),
                             "splitting group " << name << " of generation " << store.generation());
      if (member) *specs[sp.spec].out = std::move(sub);
    }
    return Status::Ok();
  }
  auto build = [&](Spec& s) {
    StatusOr<std::unique_ptr<Communicator>> c = factory_(store, s.name, s.rank, s.size, deadline);
    if (c.ok()) {
      *s.out = *std::move(c);
    } else {
      s.status = c.status();
    }
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i + 1 < specs.size(); ++i) threads.emplace_back(build, std::ref(specs[i]));
  if (specs.size() > 1) build(specs.back());
  for (auto& t : threads) t.join();
  for (size_t i = 1; i < specs.size(); ++i) {
    MORPH_RETURN_IF_ERROR(specs[i].status)
        << "building group " << specs[i].name << " of generation " << store.generation();
  }
  return Status::Ok();
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
  std::vector<Spec> specs = Specs(*set, config, rank, world_size);
  if (split_) {
    MORPH_ASSIGN_OR_RETURN(set->world_, factory_(store, "world", rank, world_size, deadline),
                           "building world group of generation " << store.generation());
    if (!set->world_->capabilities().split) {
      return InvalidArgumentError("group builder: " + set->world_->capabilities().backend +
                                  " cannot split; build without GroupBuilder::SplitFromWorld");
    }
    MORPH_RETURN_IF_ERROR(BuildSubgroups(*set, specs, store, config, true, deadline));
    return set;
  }
  // The groups rendezvous concurrently: each under its own name, so they cannot deadlock on
  // each other, and a generation costs about one rendezvous instead of four.
  Status world_status;
  std::thread world_thread([&] {
    StatusOr<std::unique_ptr<Communicator>> c =
        factory_(store, "world", rank, world_size, deadline);
    if (c.ok()) {
      set->world_ = *std::move(c);
    } else {
      world_status = c.status();
    }
  });
  Status sub_status = BuildSubgroups(*set, specs, store, config, false, deadline);
  world_thread.join();
  MORPH_RETURN_IF_ERROR(world_status)
      << "building world group of generation " << store.generation();
  MORPH_RETURN_IF_ERROR(sub_status);
  return set;
}

StatusOr<std::unique_ptr<GroupSet>> GroupBuilder::Rebuild(std::unique_ptr<GroupSet> previous,
                                                          std::span<const int> leaving,
                                                          ShrinkMode mode, Store& store,
                                                          const ParallelConfig& config,
                                                          Deadline deadline) const {
  if (previous == nullptr || previous->world_ == nullptr) {
    return InvalidArgumentError("group builder: rebuild without a previous group set");
  }
  if (leaving.empty()) {
    return InvalidArgumentError("group builder: rebuild with no rank leaving; use Build");
  }
  const int old_world = previous->world_->size(), old_rank = previous->rank_;
  std::vector<int> gone(leaving.begin(), leaving.end());
  std::sort(gone.begin(), gone.end());
  for (size_t i = 0; i < gone.size(); ++i) {
    if (gone[i] < 0 || gone[i] >= old_world) {
      return InvalidArgumentError("group builder: leaving rank " + std::to_string(gone[i]) +
                                  " out of range [0, " + std::to_string(old_world) + ")");
    }
    if (i > 0 && gone[i] == gone[i - 1]) {
      return InvalidArgumentError("group builder: leaving rank " + std::to_string(gone[i]) +
                                  " listed twice");
    }
    if (gone[i] == old_rank) {
      return InvalidArgumentError("group builder: rank " + std::to_string(old_rank) +
                                  " is leaving; only survivors rebuild");
    }
  }
  const int new_world = old_world - static_cast<int>(gone.size());
  const int new_rank =
      old_rank -
      static_cast<int>(std::lower_bound(gone.begin(), gone.end(), old_rank) - gone.begin());
  MORPH_RETURN_IF_ERROR(config.Validate());
  if (new_world < config.world()) {
    return InvalidArgumentError(
        "group builder: " + std::to_string(new_world) +
        " survivors are fewer than dp*tp*pp=" + std::to_string(config.world()));
  }
  // The subgroups of the old generation go first: after a failure they are aborted so that
  // their release does not wait for peers that are gone.
  if (mode == ShrinkMode::kFailure) {
    for (auto* c : {previous->dp_.get(), previous->tp_.get(), previous->pp_.get()}) {
      if (c != nullptr) c->Abort();
    }
  }
  Release(previous->pp_);
  Release(previous->tp_);
  Release(previous->dp_);
  if (!previous->world_->capabilities().shrink) {
    if (mode == ShrinkMode::kFailure) previous->world_->Abort();
    previous.reset();
    return Build(store, config, new_rank, new_world, deadline);
  }
  auto set = std::unique_ptr<GroupSet>(new GroupSet());
  set->generation_ = store.generation();
  set->config_ = config;
  set->rank_ = new_rank;
  set->shrunk_ = true;
  MORPH_ASSIGN_OR_RETURN(set->world_,
                         previous->world_->Shrink(gone, mode, store.generation(), deadline),
                         "shrinking world group to generation " << store.generation());
  previous.reset();
  if (set->world_->rank() != new_rank || set->world_->size() != new_world) {
    return InternalError("group builder: shrunk world is rank " +
                         std::to_string(set->world_->rank()) + "/" +
                         std::to_string(set->world_->size()) + ", expected " +
                         std::to_string(new_rank) + "/" + std::to_string(new_world));
  }
  std::vector<Spec> specs = Specs(*set, config, new_rank, new_world);
  MORPH_RETURN_IF_ERROR(
      BuildSubgroups(*set, specs, store, config, set->world_->capabilities().split, deadline));
  return set;
}

}  // namespace morph
