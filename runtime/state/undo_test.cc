#include "runtime/state/undo.h"

#include <gtest/gtest.h>

#include "base/testing.h"
#include "runtime/state/state_testutil.h"

namespace morph {
namespace {

using state_testutil::Config;
using state_testutil::ExpectFilled;
using state_testutil::Fill;
using state_testutil::MakeState;

// A step that calls BeginUpdate: Begin at BeginStep, Take at BeginUpdate, then the update.
TEST(UndoCopyTest, TheCopyBegunAtTheStepIsTakenAndPutBackBitwise) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto state, MakeState(Config(2, 1, 1), 1, /*hybrid=*/true));
  UndoCopy undo;
  for (int64_t step = 0; step < 3; ++step) {
    Fill(*state, 100 + step);  // the values of `step`
    MORPH_ASSERT_OK(undo.Begin(*state, step, 7));
    MORPH_ASSERT_OK(undo.Take(*state, step, 7));
    EXPECT_EQ(undo.StepFor(*state, 7), step);
    Fill(*state, 100 + step + 1);  // the update
  }
  EXPECT_EQ(undo.StepFor(*state, 8), -1);  // another generation's layout
  state->MarkTorn();
  undo.PutBack(*state);
  ExpectFilled(*state, 102);
  EXPECT_TRUE(state->intact());
}

// A step aborted before its update: the copy in flight is dropped and the previous step's copy
// is still whole, bitwise (it lives in the other buffer).
TEST(UndoCopyTest, ACopyCancelledBeforeTheUpdateKeepsThePreviousOne) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto state, MakeState(Config(1, 1, 1), 0));
  UndoCopy undo;
  Fill(*state, 1);
  MORPH_ASSERT_OK(undo.Take(*state, 4, 0));  // no Begin: copied on this thread
  Fill(*state, 2);                            // step 4's update: the state is at step 5
  MORPH_ASSERT_OK(undo.Begin(*state, 5, 0));
  undo.Cancel();  // AbortStep before BeginUpdate
  EXPECT_EQ(undo.StepFor(*state, 0), 4);
  undo.PutBack(*state);
  ExpectFilled(*state, 1);
  // Begun for one step, taken for another: copied again, now.
  Fill(*state, 3);
  MORPH_ASSERT_OK(undo.Begin(*state, 5, 0));
  Fill(*state, 4);
  MORPH_ASSERT_OK(undo.Take(*state, 6, 0));
  EXPECT_EQ(undo.StepFor(*state, 0), 6);
  Fill(*state, 5);
  undo.PutBack(*state);
  ExpectFilled(*state, 4);
}

}  // namespace
}  // namespace morph
