#include "runtime/plan/snapshot_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "base/testing.h"
#include "reshard/coverage.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

JobManifest Model() {
  JobManifest m;
  m.model.num_layers = 2;
  m.model.global_batch = 8;
  m.tensors.push_back({"l0.w", DType::kF32, {8, 16}, Layout::Layer(0)});
  m.tensors.push_back({"l0.w.m", DType::kF32, {8, 16}, Layout::Layer(0).ZeroShard()});
  m.tensors.push_back({"l1.v", DType::kBF16, {37}, Layout::Layer(1).ZeroShard()});
  m.scalars.push_back({"rng", 16});
  return m;
}

ParallelConfig Dp(int dp) {
  ParallelConfig c{.dp = dp, .tp = 1, .pp = 1, .stage_of_layer = {0, 0}};
  c.zero_stage = 1;
  return c;
}

// dp 4 -> 3, worker 2 (rank 1) lost; rank 1's copy is held by worker 4 (rank 3).
struct Case {
  JobManifest m = Model();
  Generation from{.id = 1, .start_step = 0, .config = Dp(4), .ranks = {1, 2, 3, 4}};
  Generation next{.id = 2, .config = Dp(3)};
  ChangeParticipants change;
  std::vector<WorkerId> holders = {1, 4, 3, 4};
  Case() {
    change.lost = {2};
    change.recovery = true;
    const std::vector<WorkerId> survivors = {1, 3, 4};
    next.ranks = *AssignRanks(m, from, change.lost, survivors, next.config);
    change.participants = ParticipantOrder(from, change.lost, next.ranks);
  }
};

Status Cover(const LocalPlan& p) {
  for (size_t t = 0; t < p.tensors.size(); ++t) {
    if (!p.new_shards[t]) continue;
    std::vector<CoveragePiece> pieces;
    for (const auto* list : {&p.recvs, &p.local_copies, &p.lost}) {
      for (const PieceMove& m : *list) {
        if (m.tensor == static_cast<int32_t>(t)) pieces.push_back({m.box, "piece"});
      }
    }
    MORPH_RETURN_IF_ERROR(ValidateCoverage(p.tensors[t].name, *p.new_shards[t], pieces));
  }
  return Status::Ok();
}

int64_t Elements(const std::vector<PieceMove>& v) {
  int64_t n = 0;
  for (const PieceMove& m : v) n += *m.box.NumElements();
  return n;
}

// Each round covers every new shard exactly once, round B writes exactly what round A left,
// and round B's pairs list the same pieces on both ends.
TEST(SnapshotPlanTest, BothRoundsCoverExactlyAndPairsAgree) {
  Case c;
  MORPH_ASSERT_OK_AND_ASSIGN(SnapshotChangePlan plan,
                             PlanForSnapshot(c.m, c.from, c.next, c.change, c.holders));
  ASSERT_TRUE(plan.held.has_value());
  std::vector<SnapshotRounds> r;
  int64_t lost_a = 0;
  for (size_t p = 0; p < c.change.participants.size(); ++p) {
    MORPH_ASSERT_OK_AND_ASSIGN(SnapshotRounds x, PlanSnapshotRounds(plan, static_cast<int32_t>(p)));
    SCOPED_TRACE("participant " + std::to_string(p));
    MORPH_EXPECT_OK(Cover(x.own));
    MORPH_EXPECT_OK(Cover(x.held));
    EXPECT_EQ(Elements(x.held.recvs) + Elements(x.held.local_copies), Elements(x.own.lost));
    lost_a += Elements(x.own.lost);
    r.push_back(std::move(x));
  }
  EXPECT_GT(lost_a, 0) << "the dead rank's moments are round B's";
  for (size_t a = 0; a < r.size(); ++a) {
    for (size_t b = 0; b < r.size(); ++b) {
      std::vector<std::pair<int32_t, std::string>> sent, got;
      for (const PieceMove& m : r[a].held.sends) {
        if (m.peer == static_cast<int32_t>(b)) sent.push_back({m.tensor, m.box.ToString()});
      }
      for (const PieceMove& m : r[b].held.recvs) {
        if (m.peer == static_cast<int32_t>(a)) got.push_back({m.tensor, m.box.ToString()});
      }
      EXPECT_EQ(sent, got) << "round B, " << a << " -> " << b;
    }
  }
  // Only worker 4 (participant 2) holds an old shard in round B: rank 1's.
  for (size_t p = 0; p < r.size(); ++p) {
    bool any = false;
    for (const auto& s : r[p].held.old_shards) any |= s && !s->empty();
    EXPECT_EQ(any, c.change.participants[p] == 4) << "participant " << p;
  }
  // The digest covers the holders.
  Case d;
  d.holders = {1, 4, 3, 4};
  d.next.ranks = c.next.ranks;
  MORPH_ASSERT_OK_AND_ASSIGN(SnapshotChangePlan same,
                             PlanForSnapshot(d.m, d.from, d.next, d.change, d.holders));
  EXPECT_EQ(same.digest, plan.digest);
  d.change.stale = {3};
  d.holders = {1, 4, 4, 3};  // rank 2 served by worker 4? it serves rank 1 already
  EXPECT_THAT(
      PlanForSnapshot(d.m, d.from, d.next, d.change, d.holders).status(),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("serves the snapshots of two other")));
}

// A held copy holds only its ward's pieces with no other copy (runtime/recovery/snapshot.h):
// the replicated l0.w of the dead rank comes from a survivor's own copy in round A, so round B
// reads only the moments; a held copy without a tensor round B needs is no copy of its pieces.
TEST(SnapshotPlanTest, HeldCopiesNeedOnlyThePiecesWithoutAnotherCopy) {
  Case c;
  const std::vector<std::vector<int64_t>> moments = {{}, {1, 2}, {}, {}};  // what worker 4 holds
  MORPH_ASSERT_OK_AND_ASSIGN(SnapshotChangePlan plan,
                             PlanForSnapshot(c.m, c.from, c.next, c.change, c.holders, moments));
  for (size_t p = 0; p < c.change.participants.size(); ++p) {
    SCOPED_TRACE("participant " + std::to_string(p));
    MORPH_ASSERT_OK_AND_ASSIGN(SnapshotRounds x, PlanSnapshotRounds(plan, static_cast<int32_t>(p)));
    MORPH_EXPECT_OK(Cover(x.own));
    MORPH_EXPECT_OK(Cover(x.held));
    // Round B reads no l0.w: not even its holder lists an old shard of it.
    EXPECT_FALSE(x.held.old_shards[0].has_value());
    for (const auto* list : {&x.held.recvs, &x.held.sends, &x.held.local_copies}) {
      for (const PieceMove& m : *list) EXPECT_NE(m.tensor, 0);
    }
  }
  auto first_error = [&](std::vector<std::vector<int64_t>> held) -> Status {
    MORPH_ASSIGN_OR_RETURN(SnapshotChangePlan q,
                           PlanForSnapshot(c.m, c.from, c.next, c.change, c.holders, held));
    for (size_t p = 0; p < c.change.participants.size(); ++p) {
      MORPH_RETURN_IF_ERROR(PlanSnapshotRounds(q, static_cast<int32_t>(p)).status());
    }
    return Status::Ok();
  };
  MORPH_EXPECT_OK(first_error({{}, {0, 1, 2}, {}, {}}));  // more than needed
  EXPECT_THAT(first_error({{}, {1}, {}, {}}),
              StatusIs(StatusCode::kDataLoss, HasSubstr("no snapshot copy of tensor 'l1.v' box [")));
  EXPECT_THAT(first_error({{}, {0}, {}, {}}),
              StatusIs(StatusCode::kDataLoss, HasSubstr("no snapshot copy of tensor 'l0.w.m' box")));
  EXPECT_THAT(first_error({{}, {1, 2}}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("held tensor lists for 2 of 4")));
}

// A lost rank no copy serves (holder -1): fine when every piece it held has a copy elsewhere,
// kDataLoss naming the first piece that has none otherwise.
TEST(SnapshotPlanTest, ALostRankWithoutHolderNeedsEveryPieceElsewhere) {
  Case c;
  c.holders = {1, -1, 3, 4};
  MORPH_ASSERT_OK_AND_ASSIGN(SnapshotChangePlan plan,
                             PlanForSnapshot(c.m, c.from, c.next, c.change, c.holders));
  EXPECT_FALSE(plan.held.has_value());
  Status first;
  for (size_t p = 0; p < c.change.participants.size() && first.ok(); ++p) {
    first = PlanSnapshotRounds(plan, static_cast<int32_t>(p)).status();
  }
  EXPECT_THAT(first, StatusIs(StatusCode::kDataLoss,
                              HasSubstr("no snapshot copy of tensor 'l0.w.m' box [")));
  Case r;  // only replicated tensors: the survivors' own copies hold everything
  r.m.tensors.resize(1);
  r.holders = {1, -1, 3, 4};
  const std::vector<WorkerId> survivors = {1, 3, 4};
  r.next.ranks = *AssignRanks(r.m, r.from, r.change.lost, survivors, r.next.config);
  r.change.participants = ParticipantOrder(r.from, r.change.lost, r.next.ranks);
  MORPH_ASSERT_OK_AND_ASSIGN(SnapshotChangePlan only,
                             PlanForSnapshot(r.m, r.from, r.next, r.change, r.holders));
  for (size_t p = 0; p < r.change.participants.size(); ++p) {
    MORPH_ASSERT_OK_AND_ASSIGN(SnapshotRounds x,
                               PlanSnapshotRounds(only, static_cast<int32_t>(p)));
    MORPH_EXPECT_OK(Cover(x.own));
    EXPECT_TRUE(x.own.lost.empty());
  }
  // A live rank without a copy of its own or its buddy's is stale, served by nobody.
  Case s;
  s.holders = {1, 4, -1, 4};
  s.change.stale = {3};
  MORPH_EXPECT_OK(PlanForSnapshot(s.m, s.from, s.next, s.change, s.holders).status());
}

TEST(SnapshotPlanTest, InconsistentHoldersAreRefusedNamingWhy) {
  Case c;
  auto plan = [&](std::vector<WorkerId> holders, std::vector<WorkerId> stale = {}) {
    ChangeParticipants ch = c.change;
    ch.stale = std::move(stale);
    return PlanForSnapshot(c.m, c.from, c.next, ch, holders).status();
  };
  EXPECT_THAT(plan({1, 4, 3}), StatusIs(StatusCode::kInvalidArgument,
                                        HasSubstr("3 snapshot holders for 4 old ranks")));
  EXPECT_THAT(
      plan({1, 2, 3, 4}),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("old rank 1 (worker 2) is served by worker 2, which is no surviving")));
  EXPECT_THAT(plan({1, 4, 3, 4}, {3}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("stale workers must be exactly")));
  // Worker 3's own copy is gone, its buddy (worker 1) serves it: then it must be stale.
  EXPECT_THAT(plan({1, 4, 1, 4}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("stale workers must be exactly")));
  MORPH_EXPECT_OK(plan({1, 4, 1, 4}, {3}));
  Case first;
  first.from.id = 0;
  EXPECT_THAT(
      PlanForSnapshot(first.m, first.from, first.next, first.change, first.holders).status(),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("the first generation has no snapshot")));
}

}  // namespace
}  // namespace morph
