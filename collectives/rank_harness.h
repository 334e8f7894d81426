// Test harnesses in the style of Gloo's own tests: N ranks as threads of this process, or as
// forked processes (which a test may SIGKILL). Not installed; for tests and benchmarks.
//
//   std::vector<Status> r = RunRankThreads(4, [&](int rank) -> Status { ... });
//   ForkedRanks ranks = ForkedRanks::Start(4, [&](int rank) -> int { ... return 0; });
//   ranks.Kill(2);
//   std::vector<int> codes = ranks.Wait(Deadline::AfterMs(60000));   // kills stragglers
#ifndef MORPH_COLLECTIVES_RANK_HARNESS_H_
#define MORPH_COLLECTIVES_RANK_HARNESS_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "base/deadline.h"
#include "base/status.h"

namespace morph {

// Runs fn(rank) for rank in [0, n) on n threads and returns their statuses.
std::vector<Status> RunRankThreads(int n, const std::function<Status(int)>& fn);

// The first non-OK status of `statuses` with its rank, or OK.
Status FirstError(const std::vector<Status>& statuses);

class ForkedRanks {
 public:
  // Forks n children; child `rank` runs fn(rank) and _exits with its result (never returns
  // into the test). The child's stderr stays the test's stderr.
  static ForkedRanks Start(int n, const std::function<int(int)>& fn);
  ForkedRanks(ForkedRanks&&) = default;
  // Kills (SIGKILL) and reaps every child still running.
  ~ForkedRanks();

  pid_t pid(int rank) const { return pids_[rank]; }
  // SIGKILLs one child.
  void Kill(int rank);
  // Reaps every child, SIGKILLing those still running at the deadline. Exit codes; a child
  // killed by a signal reports 128 + signal.
  std::vector<int> Wait(Deadline deadline);

 private:
  ForkedRanks() = default;
  std::vector<pid_t> pids_;
  std::vector<int> codes_;
};

// Exit code for children: 0 if OK, else prints "rank R: <status>" to stderr and returns 1.
int ExitCode(int rank, const Status& s);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_RANK_HARNESS_H_
