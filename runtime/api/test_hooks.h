// Fault injection for the runtime's own tests (not installed): programs linked with
// morph::runtime that make a failure happen at a chosen point instead of waiting for a timing
// that a kill produces only now and then.
#ifndef MORPH_RUNTIME_API_TEST_HOOKS_H_
#define MORPH_RUNTIME_API_TEST_HOOKS_H_

#include <cstdint>

namespace morph::testing_hooks {

// This process's Runtime::CommitUpdate treats its commit vote of step `step` as not completed
// here although it completed (the result lost on its way, as when a rank dies while relaying
// it): the vote returns kAborted, the worker reports its vote undecided and waits for the
// recovery, as it would after such a death. Once; -1 clears it. Any thread.
void DropCommitVoteResult(int64_t step);

}  // namespace morph::testing_hooks

#endif  // MORPH_RUNTIME_API_TEST_HOOKS_H_
