// A recovery's communicators when the step backend can shrink (NCCL; here a Gloo double whose
// capabilities say it can, collectives/gloo/shrinkable_gloo.h): ranks that only leave make
// PrepareSwitch build no new groups, and ShrinkGroups derives them from the running ones
// (GroupBuilder::Rebuild, kFailure). Any other change builds its groups in PrepareSwitch.
// Workers are threads of this process over MemoryStores (label multiproc).
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <thread>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/gloo/shrinkable_gloo.h"
#include "runtime/switch/switch.h"
#include "runtime/plan/plan_input.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;
constexpr std::chrono::seconds kTimeout(20);

ParallelConfig Dp(int dp) {
  ParallelConfig c{.dp = dp, .tp = 1, .pp = 1};
  c.stage_of_layer = {0};
  return c;
}

class ShrinkCluster {
 public:
  ShrinkCluster() {
    manifest_.model.num_layers = 1;
    manifest_.tensors = {{"w", DType::kF32, {8, 4}, Layout::Layer(0)}};
    for (WorkerId w : {1, 2, 3, 4}) {
      devices_[w] = *GlooDevice::Create(GlooOptions{});
      factories_[w] =
          ShrinkableGlooFactory(GlooFactory(devices_[w]), shrink_table_, devices_[w], &log_);
    }
    // Generation 1: dp 4 over workers 1..4, every worker's groups built.
    from_ = Generation{.id = 1, .config = Dp(4), .ranks = {1, 2, 3, 4}};
    std::vector<std::thread> threads;
    for (WorkerId w : from_.ranks) {
      threads.emplace_back([this, w] {
        MemoryStore store(table_, 1);
        auto g = GroupBuilder(factories_[w])
                     .Build(store, from_.config, from_.RankOf(w), 4, Deadline::After(kTimeout));
        std::lock_guard<std::mutex> l(mu_);
        if (g.ok()) groups_[w] = std::move(*g);
      });
    }
    for (auto& t : threads) t.join();
  }

  // A change from generation 1 to `next` (ranks given), lost workers `lost`.
  PrepareMsg Change(std::vector<WorkerId> ranks, std::vector<WorkerId> lost, bool recovery) {
    PrepareMsg p{.from_generation = 1, .from = from_};
    p.next = Generation{.id = 2, .config = Dp(static_cast<int>(ranks.size())), .ranks = ranks};
    p.change.lost = std::move(lost);
    p.change.recovery = recovery;
    p.change.participants = ParticipantOrder(from_, p.change.lost, p.next.ranks);
    for (WorkerId w : from_.ranks) {
      const bool lost_w =
          std::find(p.change.lost.begin(), p.change.lost.end(), w) != p.change.lost.end();
      if (!lost_w && p.next.RankOf(w) < 0) p.change.leavers.push_back(w);
    }
    auto plan = PlanForChange(manifest_, p.from, p.next, p.change);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (plan.ok()) p.next.plan_digest = plan->digest;
    return p;
  }

  struct Result {
    Status status;
    bool shrinks = false;
    bool shrunk = false;
    int rank = -1;
    int size = 0;
  };

  // Every participant prepares, shrinks (when its prepared switch says so) and takes its groups,
  // then the new world allreduces its ranks.
  std::map<WorkerId, Result> Run(const PrepareMsg& p) {
    std::map<WorkerId, Result> out;
    std::vector<std::thread> threads;
    for (WorkerId w : p.change.participants) {
      threads.emplace_back([&, w] {
        Result r;
        r.status = [&]() -> Status {
          MemoryStore store(table_, 2);
          SwitchOptions o;
          o.previous_groups_can_shrink = true;
          const Deadline d = Deadline::After(kTimeout);
          MORPH_ASSIGN_OR_RETURN(auto sw,
                                 PrepareSwitch(manifest_, w, p, store, factories_[w], o, d));
          r.shrinks = sw->shrinks_groups();
          if (r.shrinks) {
            std::unique_ptr<GroupSet> old;
            {
              std::lock_guard<std::mutex> l(mu_);
              old = std::move(groups_[w]);
            }
            MORPH_RETURN_IF_ERROR(ShrinkGroups(*sw, std::move(old), d));
          }
          std::unique_ptr<GroupSet> g = TakeGroups(*sw);
          if (!g) return Status::Ok();
          r.shrunk = g->shrunk();
          r.rank = g->rank();
          r.size = g->world().size();
          int64_t x = g->rank();
          MORPH_RETURN_IF_ERROR(g->world().Allreduce(&x, 1, DType::kI64, ReduceOp::kSum, kTimeout));
          if (x != int64_t{r.size} * (r.size - 1) / 2) return InternalError("world sum");
          return Status::Ok();
        }();
        std::lock_guard<std::mutex> l(mu_);
        out[w] = std::move(r);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  JobManifest manifest_;
  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
  std::shared_ptr<KvTable> shrink_table_ = std::make_shared<KvTable>();
  ShrinkLog log_;
  std::map<WorkerId, std::shared_ptr<GlooDevice>> devices_;
  std::map<WorkerId, CommunicatorFactory> factories_;
  Generation from_;
  std::mutex mu_;
  std::map<WorkerId, std::unique_ptr<GroupSet>> groups_;
};

TEST(SwitchShrinkTest, ARecoveryWhereRanksOnlyLeaveShrinksTheRunningGroups) {
  ShrinkCluster c;
  ASSERT_EQ(c.groups_.size(), 4u);
  // Worker 2 (rank 1) died: 1, 3, 4 keep their order as ranks 0, 1, 2.
  auto r = c.Run(c.Change({1, 3, 4}, {2}, /*recovery=*/true));
  ASSERT_EQ(r.size(), 3u);
  for (auto& [w, res] : r) {
    SCOPED_TRACE("worker " + std::to_string(w));
    MORPH_EXPECT_OK(res.status);
    EXPECT_TRUE(res.shrinks);
    EXPECT_TRUE(res.shrunk);
    EXPECT_EQ(res.size, 3);
  }
  EXPECT_EQ(r[1].rank, 0);
  EXPECT_EQ(r[3].rank, 1);
  EXPECT_EQ(r[4].rank, 2);
  ASSERT_EQ(c.log_.modes.size(), 3u);  // one Shrink per survivor, in failure mode, rank 1 out
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(c.log_.modes[i], ShrinkMode::kFailure);
    EXPECT_EQ(c.log_.excluded[i], std::vector<int>{1});
  }
}

// The same loss, but the survivors' order changes (the assignment put worker 4 first): a shrink
// keeps the order, so the groups are built in the prepare.
TEST(SwitchShrinkTest, ARecoveryThatReordersRanksBuildsNewGroups) {
  ShrinkCluster c;
  auto r = c.Run(c.Change({4, 1, 3}, {2}, /*recovery=*/true));
  ASSERT_EQ(r.size(), 3u);
  for (auto& [w, res] : r) {
    MORPH_EXPECT_OK(res.status);
    EXPECT_FALSE(res.shrinks);
    EXPECT_FALSE(res.shrunk);
  }
  EXPECT_EQ(r[4].rank, 0);
  EXPECT_TRUE(c.log_.modes.empty());
}

// A planned shrink builds its groups beside the running generation, which the training thread
// still uses until the switch step.
TEST(SwitchShrinkTest, APlannedShrinkBuildsNewGroupsInThePrepare) {
  ShrinkCluster c;
  auto r = c.Run(c.Change({1, 3, 4}, {}, /*recovery=*/false));
  ASSERT_EQ(r.size(), 4u);  // worker 2 takes part as a leaver
  for (auto& [w, res] : r) {
    MORPH_EXPECT_OK(res.status);
    EXPECT_FALSE(res.shrinks);
  }
  EXPECT_EQ(r[2].size, 0);  // no rank, no groups
  EXPECT_TRUE(c.log_.modes.empty());
}

TEST(SwitchShrinkTest, ShrinkGroupsRefusesWhatItCannotShrink) {
  ShrinkCluster c;
  // A prepared switch that builds its own groups (reordered ranks): a single-worker look at it.
  PrepareMsg p = c.Change({1, 3, 4}, {2}, /*recovery=*/true);
  std::map<WorkerId, Status> got;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (WorkerId w : p.change.participants) {
    threads.emplace_back([&, w] {
      MemoryStore store(c.table_, 2);
      SwitchOptions o;
      o.previous_groups_can_shrink = true;
      const Deadline d = Deadline::After(kTimeout);
      auto sw = PrepareSwitch(c.manifest_, w, p, store, c.factories_[w], o, d);
      Status s = sw.status();
      if (sw.ok()) {
        // Generation 1's groups are wanted; a set of another generation is refused.
        std::unique_ptr<GroupSet> other =
            *GroupBuilder(GlooFactory(nullptr)).Build(store, Dp(1), 0, 1, d);
        s = ShrinkGroups(**sw, std::move(other), d);
      }
      std::lock_guard<std::mutex> l(mu);
      got[w] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (auto& [w, s] : got) {
    EXPECT_THAT(s, StatusIs(StatusCode::kFailedPrecondition,
                            HasSubstr("generation 2: shrinking needs generation 1's groups, got "
                                      "generation 2")));
  }
  // Without the capability the prepare builds the groups, and ShrinkGroups says so.
  PrepareMsg q = c.Change({1, 3, 4}, {2}, /*recovery=*/true);
  q.next.id = 3;
  threads.clear();
  got.clear();
  for (WorkerId w : q.change.participants) {
    threads.emplace_back([&, w] {
      MemoryStore store(c.table_, 3);
      const Deadline d = Deadline::After(kTimeout);
      auto sw = PrepareSwitch(c.manifest_, w, q, store, c.factories_[w], SwitchOptions{}, d);
      Status s = sw.status();
      if (sw.ok()) s = ShrinkGroups(**sw, nullptr, d);
      std::lock_guard<std::mutex> l(mu);
      got[w] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (auto& [w, s] : got) {
    EXPECT_THAT(s, StatusIs(StatusCode::kFailedPrecondition,
                            "generation 3: the prepared switch builds its own groups"));
  }
}

}  // namespace
}  // namespace morph
