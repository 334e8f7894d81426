// Test harnesses in the style of Gloo's own tests: N ranks as threads of this process, or as
// forked processes (which a test may SIGKILL). Not installed; for tests and benchmarks.
//
//   std::vector<Status> r = RunRankThreads(4, [&](int rank) -> Status { ... });
//   ForkedRanks ranks = ForkedRanks::Fork(4, [&](int rank, const std::string& address) {...});
//   auto server = TcpStoreServer::Start(...);      // threads only after every fork
//   ranks.Release(server->address());             // children start with the address
//   ranks.Kill(2);
//   std::vector<int> codes = ranks.Wait(Deadline::AfterMs(60000));   // kills stragglers
#ifndef MORPH_COLLECTIVES_RANK_HARNESS_H_
#define MORPH_COLLECTIVES_RANK_HARNESS_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"

namespace morph {

// Runs fn(rank) for rank in [0, n) on n threads and returns their statuses.
std::vector<Status> RunRankThreads(int n, const std::function<Status(int)>& fn);

// The first non-OK status of `statuses` with its rank, or OK.
Status FirstError(const std::vector<Status>& statuses);

class ForkedRanks {
 public:
  // Forks n children; child `rank` waits until Release(blob), then runs fn(rank, blob) and
  // _exits with its result (never returns into the test). Fork before starting any thread in
  // the parent (e.g. a store server): a child forked while another thread holds a lock
  // (ASan's allocator, glog) can deadlock. The child's stderr stays the test's stderr.
  static ForkedRanks Fork(int n, const std::function<int(int, const std::string&)>& fn);
  // Lets every child start, handing it `blob`. Once.
  void Release(const std::string& blob);
  // Fork + Release("").
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
  std::vector<int> gates_;  // write ends of the children's start pipes, -1 once released
  std::vector<int> codes_;
};

// Exit code for children: 0 if OK, else prints "rank R: <status>" to stderr and returns 1.
int ExitCode(int rank, const Status& s);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_RANK_HARNESS_H_
