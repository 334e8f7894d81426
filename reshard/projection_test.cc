// The projection's arithmetic against hand-computed cases: hand-built plans on 2 nodes of 2
// GPUs, and a real plan (TP 2 -> 1 across two single-GPU nodes).
#include "reshard/projection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/testing.h"
#include "reshard/plan.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

PieceMove Piece(int peer, int64_t begin, int64_t end) {
  return {0, peer, Box({Interval{begin, end}})};
}

// One f32 tensor of 100 elements; bytes per piece = 4 * elements.
std::vector<LocalPlan> HandPlans() {
  std::vector<LocalPlan> plans(4);
  for (int p = 0; p < 4; ++p) {
    plans[p].participant = p;
    plans[p].num_participants = 4;
    plans[p].tensors = {{"w", DType::kF32, {100}}};
    plans[p].old_shards.resize(1);
    plans[p].new_shards.resize(1);
  }
  plans[0].sends = {Piece(1, 0, 10), Piece(2, 10, 40)};  // 40 B intra, 120 B inter
  plans[0].local_copies = {Piece(0, 40, 60)};            // 80 B
  plans[1].recvs = {Piece(0, 0, 10)};                    // 40 B intra
  plans[1].sends = {Piece(2, 60, 65)};                   // 20 B inter
  plans[2].recvs = {Piece(0, 10, 40), Piece(1, 60, 65)}; // 140 B inter
  plans[2].sends = {Piece(3, 65, 100)};                  // 140 B intra
  plans[3].recvs = {Piece(2, 65, 100)};                  // 140 B intra
  return plans;
}

Topology Slow() {
  Topology t;
  t.gpus_per_node = 2;
  t.nvlink_bytes_per_second = 100;
  t.nic_bytes_per_second = 10;
  t.hbm_bytes_per_second = 1000;
  return t;
}

TEST(ProjectionTest, HandComputedTwoNodes) {
  Topology t = Slow();
  t.comm_build_seconds = 3;
  t.build_in_background = false;
  ProjectionBuilder b(t, 4);
  for (const LocalPlan& p : HandPlans()) MORPH_ASSERT_OK(b.Add(p));
  Projection pr = b.Finish();
  // t0 = max(40/100, 120/10, (40+120+2*80)/1000) = 12   (NIC out)
  // t1 = max(40/100, 20/10, 60/1000)             = 2    (NIC out)
  // t2 = max(140/100, 140/10, 280/1000)          = 14   (NIC in)
  // t3 = 140/100                                  = 1.4  (NVLink in)
  EXPECT_DOUBLE_EQ(pr.participants[0].seconds, 12);
  EXPECT_EQ(pr.participants[0].limit, "NIC out");
  EXPECT_DOUBLE_EQ(pr.participants[1].seconds, 2);
  EXPECT_DOUBLE_EQ(pr.participants[2].seconds, 14);
  EXPECT_EQ(pr.participants[2].limit, "NIC in");
  EXPECT_DOUBLE_EQ(pr.participants[3].seconds, 1.4);
  EXPECT_EQ(pr.participants[3].limit, "NVLink in");
  EXPECT_DOUBLE_EQ(pr.transfer_seconds, 14);
  EXPECT_EQ(pr.bottleneck, 2);
  EXPECT_EQ(pr.intra_bytes, 180);
  EXPECT_EQ(pr.inter_bytes, 140);
  EXPECT_EQ(pr.copied_bytes, 80);
  EXPECT_EQ(pr.max_inter_recv, 140);
  EXPECT_EQ(pr.max_intra_recv, 140);
  EXPECT_DOUBLE_EQ(pr.build_seconds, 3);
  EXPECT_DOUBLE_EQ(pr.stall_seconds, 17);
  EXPECT_EQ(pr.Bottleneck(t), "participant 2 (node 1): NIC in, 0.00 GB at 0 GB/s");

  // All four on one node: everything goes over NVLink; HBM binds participant 0:
  // t0 = max(160/100, 320/1000) = 1.6; t2 = max(140/100, 140/100, 280/1000) = 1.4.
  t.node_of_participant = {0, 0, 0, 0};
  t.build_in_background = true;
  ProjectionBuilder one(t, 4);
  for (const LocalPlan& p : HandPlans()) MORPH_ASSERT_OK(one.Add(p));
  pr = one.Finish();
  EXPECT_DOUBLE_EQ(pr.transfer_seconds, 1.6);
  EXPECT_EQ(pr.bottleneck, 0);
  EXPECT_EQ(pr.inter_bytes, 0);
  EXPECT_DOUBLE_EQ(pr.stall_seconds, 1.6);  // built in the background
  // Half the line rate doubles it.
  t.efficiency = 0.5;
  ProjectionBuilder half(t, 4);
  for (const LocalPlan& p : HandPlans()) MORPH_ASSERT_OK(half.Add(p));
  EXPECT_DOUBLE_EQ(half.Finish().transfer_seconds, 3.2);
}

// A real plan: a [8, 8] f32 tensor split TP 2 over two single-GPU nodes goes to one rank (TP 1).
// The assigned participant keeps its half (128 B copied) and receives the other half over the
// NIC: 128 B at 64 B/s = 2 s; the other sends 128 B: 2 s too.
TEST(ProjectionTest, RealPlanTp2To1) {
  PlanInput in;
  in.tensors = {{"w", DType::kF32, {8, 8}, Layout::Layer(0).SplitTP(0)}};
  in.old_config = ParallelConfig{.dp = 1, .tp = 2, .pp = 1, .stage_of_layer = {0}};
  in.new_config = ParallelConfig{.dp = 1, .tp = 1, .pp = 1, .stage_of_layer = {0}};
  in.old_participant_of_rank = {0, 1};
  in.available = {0, 1};
  in.num_participants = 2;
  MORPH_ASSERT_OK_AND_ASSIGN(Planner planner, Planner::Create(in));
  Topology t;
  t.gpus_per_node = 1;
  t.nic_bytes_per_second = 64;
  t.nvlink_bytes_per_second = 1e9;
  t.hbm_bytes_per_second = 1e9;
  ProjectionBuilder b(t, 2);
  for (int p = 0; p < 2; ++p) {
    MORPH_ASSERT_OK_AND_ASSIGN(LocalPlan lp, planner.PlanFor(p));
    MORPH_ASSERT_OK(b.Add(lp));
  }
  Projection pr = b.Finish();
  EXPECT_DOUBLE_EQ(pr.transfer_seconds, 2.0);
  EXPECT_EQ(pr.inter_bytes, 128);
  EXPECT_EQ(pr.intra_bytes, 0);
  EXPECT_EQ(pr.copied_bytes, 128);
  EXPECT_EQ(pr.max_inter_recv, 128);
}

TEST(ProjectionTest, Errors) {
  Topology t;
  t.nic_bytes_per_second = 0;
  EXPECT_THAT(t.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("nic")));
  t = Topology();
  t.efficiency = 1.5;
  EXPECT_THAT(t.Validate(), StatusIs(StatusCode::kInvalidArgument, HasSubstr("efficiency")));
  ProjectionBuilder b(Topology(), 1);
  LocalPlan p;
  p.participant = 3;
  EXPECT_THAT(b.Add(p), StatusIs(StatusCode::kInvalidArgument, HasSubstr("out of range")));
  p.participant = 0;
  MORPH_EXPECT_OK(b.Add(p));
  EXPECT_THAT(b.Add(p), StatusIs(StatusCode::kInvalidArgument, HasSubstr("twice")));
}

}  // namespace
}  // namespace morph
