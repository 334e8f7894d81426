#include "collectives/rank_harness.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

namespace morph {

std::vector<Status> RunRankThreads(int n, const std::function<Status(int)>& fn) {
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { results[r] = fn(r); });
  for (auto& t : threads) t.join();
  return results;
}

Status FirstError(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) return statuses[r].WithContext("rank " + std::to_string(r));
  }
  return Status::Ok();
}

ForkedRanks ForkedRanks::Start(int n, const std::function<int(int)>& fn) {
  ForkedRanks ranks;
  std::fflush(nullptr);
  for (int r = 0; r < n; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = fn(r);
      std::fflush(nullptr);
      ::_exit(code);
    }
    ranks.pids_.push_back(pid);  // -1 on failure: Wait reports it
  }
  ranks.codes_.assign(n, -1);
  return ranks;
}

ForkedRanks::~ForkedRanks() {
  if (!pids_.empty()) Wait(Deadline::AfterMs(0));
}

void ForkedRanks::Kill(int rank) {
  if (pids_[rank] > 0 && codes_[rank] == -1) ::kill(pids_[rank], SIGKILL);
}

std::vector<int> ForkedRanks::Wait(Deadline deadline) {
  for (size_t r = 0; r < pids_.size(); ++r) {
    if (pids_[r] <= 0) {
      codes_[r] = 255;
      continue;
    }
    while (codes_[r] == -1) {
      int status = 0;
      pid_t got = ::waitpid(pids_[r], &status, WNOHANG);
      if (got == pids_[r]) {
        codes_[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (got < 0) {
        codes_[r] = 255;
        break;
      }
      if (deadline.Expired()) {
        ::kill(pids_[r], SIGKILL);
        ::waitpid(pids_[r], &status, 0);
        codes_[r] = 128 + SIGKILL;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  return codes_;
}

int ExitCode(int rank, const Status& s) {
  if (s.ok()) return 0;
  std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
  return 1;
}

}  // namespace morph
