// ChooseRecovery (runtime/plan/choose_recovery.h): which step a recovery resumes from, who is
// stale, and what happens when no whole step covers every piece.
#include "runtime/plan/choose_recovery.h"

#include <gtest/gtest.h>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

// Hybrid ZeRO in groups of 2 over dp = 4: an optimizer piece is held by the ranks at the same
// position of the groups {0,1} and {2,3} (ranks 0 and 2, or ranks 1 and 3).
JobManifest Hybrid() {
  JobManifest m;
  m.model.num_layers = 1;
  m.model.global_batch = 4;
  m.tensors.push_back({"w", DType::kF32, {8, 4}, Layout::Layer(0)});
  m.tensors.push_back({"adam_m", DType::kF32, {8, 4}, Layout::Layer(0).ZeroShard(2)});
  m.scalars.push_back({"counter", 8});
  return m;
}

ParallelConfig Dp(int dp) {
  return ParallelConfig{.dp = dp, .tp = 1, .pp = 1, .stage_of_layer = {0}};
}

struct Case {
  Generation from{.id = 1, .start_step = 0, .config = Dp(4), .ranks = {1, 2, 3, 4}};
  Generation next{.id = 2, .start_step = 0, .config = Dp(2), .ranks = {1, 2}};
  ChangeParticipants change{.participants = {1, 2, 3}, .leavers = {3}, .lost = {4},
                            .recovery = true};
};

StepReportMsg Report(WorkerId w, int64_t step, bool ok = true, int64_t undo = -1) {
  return StepReportMsg{.worker = w, .generation = 2, .last_free_step = step, .state_step = step,
                       .state_ok = ok, .undo_step = undo};
}

TEST(ChooseRecoveryTest, EverySurvivorAtOneStepResumesThere) {
  Case c;
  std::vector<StepReportMsg> r = {Report(1, 8), Report(2, 8), Report(3, 8)};
  auto choice = ChooseRecovery(Hybrid(), c.from, c.next, c.change, r, std::nullopt);
  MORPH_ASSERT_OK(choice.status());
  EXPECT_EQ(choice->resume_step, 8);
  EXPECT_TRUE(choice->stale.empty());
  EXPECT_EQ(choice->decision.source, RecoveryDecision::Source::kReplicas);
}

// Worker 4 (rank 3) died while its commit vote for step 8 had reached worker 2 (rank 1) only:
// worker 2 applied the update (step 9), workers 1 and 3 did not (step 8). Rank 1's optimizer
// piece at step 8 existed only on rank 3: without an undo copy nothing covers it (seen in the
// failures test: the job stopped with DATA_LOSS); with worker 2's undo copy of step 8 every
// piece is there.
TEST(ChooseRecoveryTest, AVoteThatReachedSomeRanksOnlyNeedsTheUndoCopy) {
  Case c;
  std::vector<StepReportMsg> without = {Report(1, 8), Report(2, 9), Report(3, 8)};
  EXPECT_THAT(ChooseRecovery(Hybrid(), c.from, c.next, c.change, without, std::nullopt).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("no copy of tensor 'adam_m'")));
  std::vector<StepReportMsg> with = {Report(1, 8, true, 7), Report(2, 9, true, 8),
                                     Report(3, 8, true, 7)};
  auto choice = ChooseRecovery(Hybrid(), c.from, c.next, c.change, with, std::nullopt);
  MORPH_ASSERT_OK(choice.status());
  EXPECT_EQ(choice->resume_step, 8);
  EXPECT_TRUE(choice->stale.empty());  // worker 2 puts its undo copy back
  EXPECT_EQ(choice->decision.newest_step, 9);
}

// A torn state (the failure came after BeginUpdate) is usable through its undo copy of the
// same step.
TEST(ChooseRecoveryTest, ATornStateIsReplacedByItsUndoCopy) {
  Case c;
  std::vector<StepReportMsg> r = {Report(1, 8), Report(2, 8, /*ok=*/false, 8), Report(3, 8)};
  auto choice = ChooseRecovery(Hybrid(), c.from, c.next, c.change, r, std::nullopt);
  MORPH_ASSERT_OK(choice.status());
  EXPECT_EQ(choice->resume_step, 8);
  EXPECT_TRUE(choice->stale.empty());
  // Without it, worker 2 is stale, and rank 1's piece (held by rank 3, lost) is gone.
  r[1].undo_step = -1;
  EXPECT_THAT(ChooseRecovery(Hybrid(), c.from, c.next, c.change, r, std::nullopt).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("no copy of tensor")));
}

// The same death with the commit vote in the runtime (Runtime::CommitUpdate): workers 1 and 3
// voted for step 8 but their vote did not complete (vote_step 8, state whole at 8); worker 2's
// did (committed_step 8) and it applied the update. Every rank voted, so 1 and 3 hold what their
// update needs: they apply it, and the recovery resumes at 9 with nothing lost, no undo copy.
TEST(ChooseRecoveryTest, AnUndecidedVoteRollsForwardWhenItPassedOnASurvivor) {
  Case c;
  std::vector<StepReportMsg> r = {Report(1, 8), Report(2, 9), Report(3, 8)};
  r[0].vote_step = r[2].vote_step = 8;
  r[1].committed_step = 8;
  auto choice = ChooseRecovery(Hybrid(), c.from, c.next, c.change, r, std::nullopt);
  MORPH_ASSERT_OK(choice.status());
  EXPECT_EQ(choice->resume_step, 9);
  EXPECT_TRUE(choice->stale.empty());
  EXPECT_EQ(choice->decision.source, RecoveryDecision::Source::kReplicas);
  EXPECT_EQ(choice->decision.newest_step, 9);  // nothing lost
  // A survivor whose state is past the step is the same evidence (it began step 9 only after
  // its vote of 8 completed).
  r[1].committed_step = -1;
  choice = ChooseRecovery(Hybrid(), c.from, c.next, c.change, r, std::nullopt);
  MORPH_ASSERT_OK(choice.status());
  EXPECT_EQ(choice->resume_step, 9);
  EXPECT_TRUE(choice->stale.empty());
}

// Nobody's vote of step 8 completed (the dying rank never voted): nobody applied anything of
// step 8, and every survivor resumes there with its own state.
TEST(ChooseRecoveryTest, AnUndecidedVoteThatPassedNowhereResumesAtItsStep) {
  Case c;
  std::vector<StepReportMsg> r = {Report(1, 8), Report(2, 8), Report(3, 8)};
  for (StepReportMsg& m : r) m.vote_step = 8;
  r[1].committed_step = 7;
  auto choice = ChooseRecovery(Hybrid(), c.from, c.next, c.change, r, std::nullopt);
  MORPH_ASSERT_OK(choice.status());
  EXPECT_EQ(choice->resume_step, 8);
  EXPECT_TRUE(choice->stale.empty());
  EXPECT_EQ(choice->decision.newest_step, 8);
  // An undecided vote is never taken as passed by a torn survivor at the same step without its
  // committed_step: torn says nothing about the vote.
  r[1] = Report(2, 8, /*ok=*/false);
  r[1].vote_step = -1;
  EXPECT_THAT(ChooseRecovery(Hybrid(), c.from, c.next, c.change, r, std::nullopt).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("no copy of tensor 'adam_m'")));
}

TEST(ChooseRecoveryTest, NoCopyFallsBackToTheCheckpoint) {
  Case c;
  std::vector<StepReportMsg> r = {Report(1, 8), Report(2, 9), Report(3, 8)};
  auto choice = ChooseRecovery(Hybrid(), c.from, c.next, c.change, r,
                               RecoveryCheckpoint{.step = 4, .path = "/ckpt/step-4-g1"});
  MORPH_ASSERT_OK(choice.status());
  EXPECT_EQ(choice->resume_step, 4);
  EXPECT_EQ(choice->decision.source, RecoveryDecision::Source::kCheckpoint);
  EXPECT_EQ(choice->stale, (std::vector<WorkerId>{1, 2, 3}));
}

}  // namespace
}  // namespace morph
