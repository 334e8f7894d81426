// GroupBuilder: the communicators one rank needs for one generation — world, and its DP, TP
// and PP groups for a ParallelConfig (docs/design.md §1: rank = (p*dp + d)*tp + t).
//
//   GroupBuilder builder(GlooFactory(device));
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<GroupSet> groups,
//       builder.Build(store_g3, config, rank, /*world_size=*/config.world(), deadline));
//   groups->dp().Allreduce(grads, n, DataType::kF32, ReduceOp::kSum, timeout);
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
#include <string>
#include <string_view>

#include "base/parallel_config.h"
#include "collectives/communicator.h"
#include "collectives/store.h"

namespace morph {

class GlooDevice;

// Builds one communicator: collective over the `size` ranks that call it with the same
// store generation and `name`. Statuses as the backend's Create.
using CommunicatorFactory = std::function<StatusOr<std::unique_ptr<Communicator>>(
    Store& store, std::string_view name, int rank, int size, Deadline deadline)>;

// Gloo communicators on `device` (null: one from GlooOptions::FromEnv per communicator).
CommunicatorFactory GlooFactory(std::shared_ptr<GlooDevice> device);

// The communicators of one rank in one generation. Destroying it aborts whatever still runs
// on them and releases them.
class GroupSet {
 public:
  int64_t generation() const { return generation_; }
  const ParallelConfig& config() const { return config_; }
  int rank() const { return rank_; }
  bool standby() const { return dp_ == nullptr; }

  // The groups. dp()/tp()/pp() must not be called on a standby worker.
  Communicator& world() { return *world_; }
  Communicator& dp() { return *dp_; }
  Communicator& tp() { return *tp_; }
  Communicator& pp() { return *pp_; }

  // Aborts every communicator (any thread): their operations return kAborted.
  void AbortAll();
  ~GroupSet();

 private:
  friend class GroupBuilder;
  int64_t generation_ = 0;
  ParallelConfig config_;
  int rank_ = 0;
  std::unique_ptr<Communicator> world_, dp_, tp_, pp_;
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

 private:
  CommunicatorFactory factory_;
  bool split_ = false;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_GROUPS_H_
