// Where a change's union communicator comes from (pure), and building it over fake NCCL
// communicators: reusing a world with its ranks mapped, shrinking without the dead, a fresh one.
#include "collectives/union_comm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/testing.h"
#include "collectives/fake_nccl.h"
#include "collectives/testing/rank_harness.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Source = UnionCommPlan::Source;
constexpr std::chrono::milliseconds kTimeout(10000);

TEST(PlanUnionCommTest, PlannedShrinkReusesTheOldWorld) {
  // Workers 10..13 hold old ranks 0..3; participants in plan order 13, 10, 11, 12 (say).
  UnionCommInput in{.participants = {13, 10, 11, 12},
                    .old_world = {10, 11, 12, 13},
                    .new_world = {10, 11}};
  MORPH_ASSERT_OK_AND_ASSIGN(UnionCommPlan p, PlanUnionComm(in));
  EXPECT_EQ(p.source, Source::kOldWorld);
  EXPECT_THAT(p.comm_rank_of_participant, ElementsAre(3, 0, 1, 2));
  EXPECT_EQ(p.comm_size, 4);
  // Old-world members that are not participants (a spare) change nothing.
  in.participants = {11, 13};
  MORPH_ASSERT_OK_AND_ASSIGN(p, PlanUnionComm(in));
  EXPECT_EQ(p.source, Source::kOldWorld);
  EXPECT_THAT(p.comm_rank_of_participant, ElementsAre(1, 3));
}

TEST(PlanUnionCommTest, DeadMembersShrinkTheOldWorldWhereItCan) {
  UnionCommInput in{.participants = {10, 12, 13},
                    .old_world = {10, 11, 12, 13},
                    .new_world = {10, 12, 13},
                    .dead = {11},
                    .old_world_shrinks = true};
  MORPH_ASSERT_OK_AND_ASSIGN(UnionCommPlan p, PlanUnionComm(in));
  EXPECT_EQ(p.source, Source::kShrunk);
  EXPECT_THAT(p.exclude, ElementsAre(1));
  EXPECT_THAT(p.comm_rank_of_participant, ElementsAre(0, 1, 2));
  EXPECT_EQ(p.comm_size, 3);
  // Gloo step groups cannot shrink: the new world covers them.
  in.old_world_shrinks = false;
  MORPH_ASSERT_OK_AND_ASSIGN(p, PlanUnionComm(in));
  EXPECT_EQ(p.source, Source::kNewWorld);
  EXPECT_THAT(p.comm_rank_of_participant, ElementsAre(0, 1, 2));
}

TEST(PlanUnionCommTest, GrowUsesTheNewWorldAndMixedChangesAFreshOne) {
  // Grow: 2 old members, 2 joiners; everybody is in the next world.
  UnionCommInput grow{.participants = {10, 11, 20, 21},
                      .old_world = {10, 11},
                      .new_world = {20, 10, 21, 11}};
  MORPH_ASSERT_OK_AND_ASSIGN(UnionCommPlan p, PlanUnionComm(grow));
  EXPECT_EQ(p.source, Source::kNewWorld);
  EXPECT_THAT(p.comm_rank_of_participant, ElementsAre(1, 3, 0, 2));
  // One leaves while one joins: no world holds all of them.
  UnionCommInput mixed{.participants = {10, 11, 20},
                       .old_world = {10, 11},
                       .new_world = {10, 20}};
  MORPH_ASSERT_OK_AND_ASSIGN(p, PlanUnionComm(mixed));
  EXPECT_EQ(p.source, Source::kFresh);
  EXPECT_THAT(p.comm_rank_of_participant, ElementsAre(0, 1, 2));
  // Step groups that cannot carry device state (empty lists): always fresh.
  MORPH_ASSERT_OK_AND_ASSIGN(p, PlanUnionComm({.participants = {10, 11}}));
  EXPECT_EQ(p.source, Source::kFresh);
}

TEST(PlanUnionCommTest, RejectsDuplicates) {
  EXPECT_THAT(PlanUnionComm({.participants = {1, 1}}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("twice in the participants")));
  EXPECT_THAT(PlanUnionComm({.participants = {1}, .old_world = {2, 2}}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("old world")));
  EXPECT_THAT(PlanUnionComm({}).status(), StatusIs(StatusCode::kInvalidArgument, ::testing::_));
}

struct Fixture {
  explicit Fixture(int n)
      : device(std::make_shared<FakeDevice>()), hub(std::make_shared<FakeNcclHub>(n, device)) {}
  std::shared_ptr<KvTable> table = std::make_shared<KvTable>();
  std::shared_ptr<FakeDevice> device;
  std::shared_ptr<FakeNcclHub> hub;
};

TEST(BuildUnionCommTest, ReuseShrinkAndFresh) {
  Fixture f(4);
  std::vector<std::unique_ptr<Communicator>> world(4);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(4, [&](int r) -> Status {
    MemoryStore store(f.table, 1);
    MORPH_ASSIGN_OR_RETURN(world[static_cast<size_t>(r)],
                           f.hub->Factory(r)(store, "world", r, 4, Deadline::After(kTimeout)));
    return Status::Ok();
  })));
  MemoryStore g2(f.table, 2);
  // Reuse: nothing is built, the world itself is the union.
  UnionCommPlan reuse = *PlanUnionComm({.participants = {3, 0}, .old_world = {0, 1, 2, 3}});
  MORPH_ASSERT_OK_AND_ASSIGN(UnionComm u, BuildUnionComm(reuse, 0, world[3].get(), nullptr, {},
                                                         g2, 2, Deadline::After(kTimeout)));
  EXPECT_EQ(u.comm, world[3].get());
  EXPECT_EQ(u.owned, nullptr);
  // The wrong world for the plan is refused.
  EXPECT_THAT(BuildUnionComm(reuse, 1, nullptr, nullptr, {}, g2, 2, Deadline::AfterMs(10))
                  .status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("missing")));
  // Process 1 dies: the survivors shrink; the union's ranks are the survivors' in order.
  f.hub->Kill(1);
  UnionCommPlan shrink = *PlanUnionComm({.participants = {0, 2, 3},
                                         .old_world = {0, 1, 2, 3},
                                         .dead = {1},
                                         .old_world_shrinks = true});
  ASSERT_EQ(shrink.source, Source::kShrunk);
  std::vector<UnionComm> shrunk(3);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(3, [&](int p) -> Status {
    const int process = p == 0 ? 0 : p + 1;
    MORPH_ASSIGN_OR_RETURN(shrunk[static_cast<size_t>(p)],
                           BuildUnionComm(shrink, p, world[static_cast<size_t>(process)].get(),
                                          nullptr, {}, g2, 2, Deadline::After(kTimeout)));
    return Status::Ok();
  })));
  EXPECT_EQ(shrunk[2].comm->rank(), 2);
  EXPECT_EQ(shrunk[2].comm->size(), 3);
  // Fresh: a new communicator over the participants through the generation's store.
  UnionCommPlan fresh = *PlanUnionComm({.participants = {0, 2}});
  std::vector<UnionComm> made(2);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(2, [&](int p) -> Status {
    MemoryStore g3(f.table, 3);
    MORPH_ASSIGN_OR_RETURN(made[static_cast<size_t>(p)],
                           BuildUnionComm(fresh, p, nullptr, nullptr, f.hub->Factory(p * 2), g3,
                                          3, Deadline::After(kTimeout)));
    return Status::Ok();
  })));
  EXPECT_EQ(made[1].comm->rank(), 1);
  EXPECT_EQ(made[1].comm->generation(), 3);
}

}  // namespace
}  // namespace morph
