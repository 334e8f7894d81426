#include "collectives/groups.h"

#include <gtest/gtest.h>

#include "base/testing.h"
#include "collectives/gloo_communicator.h"
#include "collectives/rank_harness.h"

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
  MORPH_RETURN_IF_ERROR(g.world().Allreduce(&x, 1, DataType::kI64, ReduceOp::kSum, kTimeout));
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
    MORPH_RETURN_IF_ERROR(grp.comm->Allreduce(&v, 1, DataType::kI64, ReduceOp::kSum, kTimeout));
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

}  // namespace
}  // namespace morph
