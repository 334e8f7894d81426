#include "runtime/state/step_core.h"

#include <gtest/gtest.h>

namespace morph {
namespace {

TEST(StepCoreTest, AStepIsBegunUpdatedAndEnded) {
  StepCore c;
  EXPECT_EQ(c.state(), StepCore::State::kBetween);
  ASSERT_TRUE(c.CheckBegin(3).ok());
  c.Begin(3);
  EXPECT_TRUE(c.in_step());
  EXPECT_EQ(c.CheckBegin(3).message(), "BeginStep: step 3 is still open (call EndStep first)");
  c.BeginUpdate();
  EXPECT_TRUE(c.updating());
  EXPECT_EQ(c.CanVote(3).message(),
            "CommitUpdate: the update of step 3 already began (BeginUpdate or CommitUpdate was "
            "called)");
  ASSERT_TRUE(c.End().ok());
  EXPECT_EQ(c.state(), StepCore::State::kBetween);
  EXPECT_EQ(c.End().message(), "EndStep: no step is open");
  EXPECT_EQ(c.CanVote(4).message(), "CommitUpdate: no step is open");
  EXPECT_EQ(c.Abort().status().message(), "AbortStep: no step is open");
}

// Until a program declares its updates, a failed step leaves the state torn; once it does, a
// step that fails before its update leaves it whole, one that fails during it torn.
TEST(StepCoreTest, AFailedStepIsTornUnlessItFailedBeforeADeclaredUpdate) {
  StepCore c;
  c.Begin(0);
  ASSERT_EQ(*c.Abort(), true);
  EXPECT_TRUE(c.failed());
  EXPECT_TRUE(c.torn());  // never declared where its updates begin
  c.Recovered();
  EXPECT_FALSE(c.failed());
  EXPECT_FALSE(c.torn());

  c.Begin(1);
  ASSERT_TRUE(c.CanVote(1).ok());  // declares: the vote comes before the update
  c.BeginUpdate();
  ASSERT_TRUE(c.End().ok());
  c.Begin(2);
  ASSERT_EQ(*c.Abort(), true);  // before its update
  EXPECT_FALSE(c.torn());
  c.Recovered();
  c.Begin(2);
  c.BeginUpdate();
  ASSERT_EQ(*c.Abort(), true);  // during it
  EXPECT_TRUE(c.torn());
  c.UndoPutBack();
  EXPECT_FALSE(c.torn());
  EXPECT_TRUE(c.failed());
}

// CommitUpdate's vote did not complete here: AbortStep ends the step; the vote passed elsewhere
// (apply) -> the step goes on in its update, the recovery still pending; or not -> the step is
// over and a later AbortStep does nothing.
TEST(StepCoreTest, AVoteSettledElsewhereResumesOrEndsTheStep) {
  StepCore c;
  c.Begin(5);
  ASSERT_TRUE(c.CanVote(5).ok());
  ASSERT_EQ(*c.Abort(), true);
  c.VoteSettled(/*apply=*/true);
  EXPECT_TRUE(c.updating());
  EXPECT_TRUE(c.failed());  // the recovery's switch comes at the next BeginStep
  ASSERT_TRUE(c.End().ok());
  c.Recovered();

  c.Begin(6);
  ASSERT_TRUE(c.CanVote(6).ok());
  ASSERT_EQ(*c.Abort(), true);
  c.VoteSettled(/*apply=*/false);
  EXPECT_TRUE(c.ended_by_vote());
  StatusOr<bool> again = c.Abort();  // the program ends the failed step as usual
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again);
  c.Recovered();
  ASSERT_TRUE(c.CheckBegin(6).ok());  // the next BeginStep forgets it
  EXPECT_FALSE(c.ended_by_vote());
}

TEST(StepCoreTest, AFailedSwitchLeavesTheGenerationFailedAndFinishedIsFinal) {
  StepCore c;
  c.SwitchFailed(/*torn=*/false);
  EXPECT_TRUE(c.failed());
  EXPECT_FALSE(c.torn());
  c.SwitchFailed(/*torn=*/true);
  EXPECT_TRUE(c.torn());
  c.Recovered();
  c.Finished();
  EXPECT_TRUE(c.finished());
  c.Begin(9);
  EXPECT_TRUE(c.finished());
  EXPECT_EQ(StepCoreStateName(c.state()), "done");
}

}  // namespace
}  // namespace morph
