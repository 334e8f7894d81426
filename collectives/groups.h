// GroupBuilder: the communicators one rank needs for one generation — world, and its DP, TP
// and PP groups for a ParallelConfig (docs/design.md §1: rank = (p*dp + d)*tp + t).
//
//   GroupBuilder builder(GlooFactory(device));
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<GroupSet> groups,
//       builder.Build(store_g3, config, rank, /*world_size=*/config.world(), deadline));
//   groups->dp().Allreduce(grads, n, DType::kF32, ReduceOp::kSum, timeout);
//   ...
//   // Next generation: build the new set, then drop the old one (aborting anything left).
//   MORPH_ASSIGN_OR_RETURN(groups, builder.Build(store_g4, next_config, new_rank, n, deadline));
//
// Group names inside a generation's store: "world", "dp/p<p>t<t>", "tp/p<p>d<d>",
// "pp/d<d>t<t>"; each group is its own communicator (own Gloo context or NCCL comm).
// Standby workers (rank >= config.world()) get the world communicator only.
#ifndef MORPH_COLLECTIVES_GROUPS_H_
#define MORPH_COLLECTIVES_GROUPS_H_

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "morph/parallel_config.h"
#include "collectives/communicator.h"
#include "collectives/store/store.h"

namespace morph {

class GlooDevice;
struct GlooOptions;

// Builds one communicator: collective over the `size` ranks that call it with the same
// store generation and `name`. Statuses as the backend's Create.
using CommunicatorFactory = std::function<StatusOr<std::unique_ptr<Communicator>>(
    Store& store, std::string_view name, int rank, int size, Deadline deadline)>;

// Gloo communicators on `device`. Null: on one device made from the default GlooOptions when
// the first communicator is built, shared by the factory's later ones.
CommunicatorFactory GlooFactory(std::shared_ptr<GlooDevice> device);
// Gloo communicators on one device made from `options` when the first communicator is built
// (its errors are that build's), shared by the later ones. Neither reads the environment.
CommunicatorFactory GlooFactory(const GlooOptions& options);

// The communicators of one rank in one generation. Destroying it aborts whatever still runs
// on them and releases them. A communicator also held elsewhere (Shared: a language binding's
// process group) outlives the set as an aborted object: every later call returns kAborted.
class GroupSet {
 public:
  int64_t generation() const { return generation_; }
  const ParallelConfig& config() const { return config_; }
  int rank() const { return rank_; }
  bool standby() const { return dp_ == nullptr; }
  // True when world() came from Communicator::Shrink of the previous generation's world
  // (GroupBuilder::Rebuild) rather than from a rendezvous.
  bool shrunk() const { return shrunk_; }

  // The groups. dp()/tp()/pp() must not be called on a standby worker.
  Communicator& world() { return *world_; }
  Communicator& dp() { return *dp_; }
  Communicator& tp() { return *tp_; }
  Communicator& pp() { return *pp_; }

  // The shared owner of world(), dp(), tp() or pp() (null for any other communicator).
  std::shared_ptr<Communicator> Shared(const Communicator& c) const;
  // Aborts every communicator (any thread): their operations return kAborted.
  void AbortAll();
  ~GroupSet();

 private:
  friend class GroupBuilder;
  int64_t generation_ = 0;
  ParallelConfig config_;
  int rank_ = 0;
  bool shrunk_ = false;
  std::shared_ptr<Communicator> world_, dp_, tp_, pp_;
};

class GroupBuilder {
 public:
  explicit GroupBuilder(CommunicatorFactory factory) : factory_(std::move(factory)) {}

  // Builds DP/TP/PP by splitting the world communicator (NCCL's ncclCommSplit: no new unique
  // ids) instead of a rendezvous per group. Build then fails with kInvalidArgument if the
  // backend cannot split.
  GroupBuilder& SplitFromWorld(bool split = true) {
    split_ = split;
    return *this;
  }

  // Collective over the `world_size` workers of `store`'s generation: each calls it with its
  // rank. kInvalidArgument for an invalid config, world_size < config.world(), or a rank out
  // of [0, world_size); otherwise the factory's errors with the group's name. Any thread.
  StatusOr<std::unique_ptr<GroupSet>> Build(Store& store, const ParallelConfig& config, int rank,
                                            int world_size, Deadline deadline) const;

  // The next generation when ranks only leave: `leaving` are ranks of previous->world() that
  // are gone (planned leavers: kPlanned; dead: kFailure). Collective over the survivors, who
  // keep their order: this rank's new rank is its old one minus the leavers below it
  // (GroupSet::rank()), in a world of previous size minus the leavers. When the previous
  // world can shrink (capabilities().shrink, NCCL) it is shrunk — no rendezvous, dead ranks
  // do not block it — and DP/TP/PP are split from it (or built through `store` when the
  // backend cannot split); otherwise (Gloo) every group is built through `store` as Build
  // does. `previous` is released first either way (its subgroups aborted first in kFailure
  // mode). kInvalidArgument for a null `previous`, an empty `leaving`, a leaver out of range
  // or repeated, this rank among the leavers, or a config that does not fit; otherwise as
  // Build (and Shrink's errors, naming the world group). Any thread; every survivor calls it
  // with the same arguments apart from `previous`.
  StatusOr<std::unique_ptr<GroupSet>> Rebuild(std::unique_ptr<GroupSet> previous,
                                              std::span<const int> leaving, ShrinkMode mode,
                                              Store& store, const ParallelConfig& config,
                                              Deadline deadline) const;

 private:
  struct Spec;
  // Specs of this rank's groups: world first, then DP/TP/PP unless standby.
  static std::vector<Spec> Specs(GroupSet& set, const ParallelConfig& config, int rank,
                                 int world_size);
  // Builds DP/TP/PP (specs[1..]) once set.world_ exists: by splitting it where `split`, else
  // through the store (concurrently).
  Status BuildSubgroups(GroupSet& set, std::vector<Spec>& specs, Store& store,
                        const ParallelConfig& config, bool split, Deadline deadline) const;

  CommunicatorFactory factory_;
  bool split_ = false;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_GROUPS_H_
