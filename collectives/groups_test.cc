#include "collectives/groups.h"

#include <gtest/gtest.h>

#include <mutex>
#include <span>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/gloo/shrinkable_gloo.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;
constexpr std::chrono::seconds kTimeout(20);

// Every group's allreduce of the global ranks must sum exactly the ranks the config puts in
// that group.
Status CheckGroups(GroupSet& g, int world_size) {
  auto sum_of = [](const std::vector<int>& v) {
    int64_t s = 0;
    for (int x : v) s += x;
    return s;
  };
  int64_t x = g.rank();
  MORPH_RETURN_IF_ERROR(g.world().Allreduce(&x, 1, DType::kI64, ReduceOp::kSum, kTimeout));
  if (x != int64_t{world_size} * (world_size - 1) / 2) return InternalError("world sum");
  if (g.standby()) return Status::Ok();
  const ParallelConfig& c = g.config();
  struct {
    Communicator* comm;
    std::vector<int> members;
    const char* name;
  } groups[] = {{&g.dp(), c.DpGroup(g.rank()), "dp"},
                {&g.tp(), c.TpGroup(g.rank()), "tp"},
                {&g.pp(), c.PpGroup(g.rank()), "pp"}};
  for (auto& grp : groups) {
    int64_t v = g.rank();
    MORPH_RETURN_IF_ERROR(grp.comm->Allreduce(&v, 1, DType::kI64, ReduceOp::kSum, kTimeout));
    if (v != sum_of(grp.members)) {
      return InternalError(std::string(grp.name) + " group sum " + std::to_string(v) +
                           " != " + std::to_string(sum_of(grp.members)));
    }
    if (grp.comm->size() != static_cast<int>(grp.members.size())) {
      return InternalError(std::string(grp.name) + " size");
    }
  }
  return Status::Ok();
}

TEST(GroupBuilderTest, BuildsDpTpPpGroupsAndRebuildsForTheNextGeneration) {
  auto table = std::make_shared<KvTable>();
  auto device = *GlooDevice::Create(GlooOptions{});
  GroupBuilder builder(GlooFactory(device));
  ParallelConfig c0{.dp = 2, .tp = 2, .pp = 2};
  c0.stage_of_layer = {0, 0, 1, 1};
  std::vector<std::unique_ptr<GroupSet>> sets(9);
  // Generation 0: 8 ranks in the config plus one standby.
  MORPH_ASSERT_OK(FirstError(RunRankThreads(9, [&](int rank) -> Status {
    MemoryStore store(table, 0);
    MORPH_ASSIGN_OR_RETURN(sets[rank],
                           builder.Build(store, c0, rank, 9, Deadline::After(kTimeout)));
    return CheckGroups(*sets[rank], 9);
  })));
  EXPECT_TRUE(sets[8]->standby());
  EXPECT_FALSE(sets[0]->standby());
  // Generation 1: ranks 0..2 survive, dp=3.
  MORPH_ASSERT_OK(MemoryStore(table, 1).AdvanceGeneration(1, Deadline::AfterMs(100)));
  ParallelConfig c1{.dp = 3};
  MORPH_ASSERT_OK(FirstError(RunRankThreads(3, [&](int rank) -> Status {
    MemoryStore store(table, 1);
    MORPH_ASSIGN_OR_RETURN(auto next, builder.Build(store, c1, rank, 3, Deadline::After(kTimeout)));
    sets[rank] = std::move(next);  // releases generation 0's communicators
    if (sets[rank]->generation() != 1) return InternalError("generation");
    return CheckGroups(*sets[rank], 3);
  })));
}

TEST(GroupBuilderTest, SplittingNeedsABackendThatSplits) {
  auto table = std::make_shared<KvTable>();
  MemoryStore store(table, 0);
  GroupBuilder builder(GlooFactory(nullptr));
  builder.SplitFromWorld();
  EXPECT_THAT(builder.Build(store, ParallelConfig{}, 0, 1, Deadline::AfterMs(5000)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("gloo cannot split")));
  MORPH_ASSERT_OK_AND_ASSIGN(auto comm,
                             GlooFactory(nullptr)(store, "solo", 0, 1, Deadline::AfterMs(5000)));
  EXPECT_FALSE(comm->capabilities().split);
  EXPECT_THAT(comm->Split(0, 0, "sub", Deadline::AfterMs(100)),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("gloo cannot split")));
}

TEST(GroupBuilderTest, BadArguments) {
  auto table = std::make_shared<KvTable>();
  MemoryStore store(table, 0);
  GroupBuilder builder(GlooFactory(nullptr));
  ParallelConfig c{.dp = 2, .tp = 2};
  EXPECT_THAT(builder.Build(store, c, 0, 3, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("world size 3 is smaller")));
  EXPECT_THAT(builder.Build(store, c, 4, 4, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 4 out of range")));
  ParallelConfig bad{.dp = 0};
  EXPECT_THAT(builder.Build(store, bad, 0, 4, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("dp=0")));
  // A missing member: the error names the group.
  EXPECT_THAT(builder.Build(store, ParallelConfig{.dp = 2}, 0, 2, Deadline::AfterMs(200)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("world group of generation 0")));
}

// Generation 0: 6 ranks, dp=3 tp=2; ranks 4 and 1 leave (listed unsorted).
// Generation 1: 4 survivors, dp=2 tp=2, renumbered in order (0,2,3,5 -> 0,1,2,3).
void RunLeaveScenario(const CommunicatorFactory& factory, ShrinkMode mode, bool expect_shrunk) {
  auto table = std::make_shared<KvTable>();
  GroupBuilder builder(factory);
  ParallelConfig c0{.dp = 3, .tp = 2};
  std::vector<std::unique_ptr<GroupSet>> sets(6);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(6, [&](int rank) -> Status {
    MemoryStore store(table, 0);
    MORPH_ASSIGN_OR_RETURN(sets[rank],
                           builder.Build(store, c0, rank, 6, Deadline::After(kTimeout)));
    return CheckGroups(*sets[rank], 6);
  })));
  const std::vector<int> leaving = {4, 1};
  sets[1].reset();  // the leavers are gone
  sets[4].reset();
  MORPH_ASSERT_OK(MemoryStore(table, 1).AdvanceGeneration(1, Deadline::AfterMs(100)));
  const std::vector<int> survivors = {0, 2, 3, 5};
  ParallelConfig c1{.dp = 2, .tp = 2};
  std::vector<std::unique_ptr<GroupSet>> next(4);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(4, [&](int i) -> Status {
    MemoryStore store(table, 1);
    MORPH_ASSIGN_OR_RETURN(next[i], builder.Rebuild(std::move(sets[survivors[i]]), leaving, mode,
                                                    store, c1, Deadline::After(kTimeout)));
    if (next[i]->rank() != i) return InternalError("new rank " + std::to_string(next[i]->rank()));
    if (next[i]->generation() != 1) return InternalError("generation");
    return CheckGroups(*next[i], 4);
  })));
  for (auto& g : next) EXPECT_EQ(g->shrunk(), expect_shrunk);
}

TEST(GroupBuilderTest, RebuildShrinksTheWorldWhenTheBackendCanShrink) {
  auto table = std::make_shared<KvTable>();  // the double's own rendezvous space
  auto device = *GlooDevice::Create(GlooOptions{});
  for (ShrinkMode mode : {ShrinkMode::kPlanned, ShrinkMode::kFailure}) {
    ShrinkLog log;
    CommunicatorFactory factory = ShrinkableGlooFactory(GlooFactory(device), table, device, &log);
    RunLeaveScenario(factory, mode, /*expect_shrunk=*/true);
    // Every survivor shrank its world once, with the caller's mode and the leavers sorted;
    // DP/TP/PP were built through the store (the double cannot split).
    ASSERT_EQ(log.modes.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(log.modes[i], mode);
      EXPECT_EQ(log.excluded[i], (std::vector<int>{1, 4}));
    }
    table = std::make_shared<KvTable>();
  }
}

TEST(GroupBuilderTest, RebuildRendezvousesWhenTheBackendCannotShrink) {
  auto device = *GlooDevice::Create(GlooOptions{});
  RunLeaveScenario(GlooFactory(device), ShrinkMode::kFailure, /*expect_shrunk=*/false);
}

TEST(GroupBuilderTest, RebuildBadArguments) {
  auto table = std::make_shared<KvTable>();
  MemoryStore store(table, 0);
  GroupBuilder builder(GlooFactory(nullptr));
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto set, builder.Build(store, ParallelConfig{}, 0, 1, Deadline::After(kTimeout)));
  const std::vector<int> none, self = {0}, out = {3};
  ParallelConfig one{};
  auto again = [&]() -> std::unique_ptr<GroupSet> {
    return *builder.Build(store, one, 0, 1, Deadline::After(kTimeout));
  };
  EXPECT_THAT(
      builder.Rebuild(nullptr, self, ShrinkMode::kPlanned, store, one, Deadline::AfterMs(100)),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("without a previous group set")));
  EXPECT_THAT(
      builder.Rebuild(again(), none, ShrinkMode::kPlanned, store, one, Deadline::AfterMs(100)),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("no rank leaving")));
  EXPECT_THAT(
      builder.Rebuild(again(), self, ShrinkMode::kPlanned, store, one, Deadline::AfterMs(100)),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 0 is leaving")));
  EXPECT_THAT(builder.Rebuild(std::move(set), out, ShrinkMode::kPlanned, store, one,
                              Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("leaving rank 3 out of range")));
}

}  // namespace
}  // namespace morph
