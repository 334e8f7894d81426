#include "collectives/testing/rank_harness.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
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

ForkedRanks ForkedRanks::Fork(int n, const std::function<int(int, const std::string&)>& fn) {
  ForkedRanks ranks;
  std::fflush(nullptr);
  for (int r = 0; r < n; ++r) {
    int gate[2] = {-1, -1};
    if (::pipe(gate) != 0) {
      ranks.pids_.push_back(-1);
      ranks.gates_.push_back(-1);
      continue;
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(gate[1]);
      for (int fd : ranks.gates_) {
        if (fd >= 0) ::close(fd);
      }
      // Wait for the blob: the parent starts its threads only after every fork.
      std::string blob;
      char buf[256];
      while (true) {
        ssize_t got = ::read(gate[0], buf, sizeof(buf));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        blob.append(buf, static_cast<size_t>(got));
      }
      ::close(gate[0]);
      int code = fn(r, blob);
      std::fflush(nullptr);
      ::_exit(code);
    }
    ::close(gate[0]);
    ranks.pids_.push_back(pid);  // -1 on failure: Wait reports it
    ranks.gates_.push_back(pid > 0 ? gate[1] : -1);
    if (pid <= 0) ::close(gate[1]);
  }
  ranks.codes_.assign(n, -1);
  return ranks;
}

void ForkedRanks::Release(const std::string& blob) {
  for (int& fd : gates_) {
    if (fd < 0) continue;
    size_t off = 0;
    while (off < blob.size()) {
      ssize_t w = ::write(fd, blob.data() + off, blob.size() - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    ::close(fd);
    fd = -1;
  }
}

ForkedRanks ForkedRanks::Start(int n, const std::function<int(int)>& fn) {
  ForkedRanks ranks = Fork(n, [&](int rank, const std::string&) { return fn(rank); });
  ranks.Release("");
  return ranks;
}

ForkedRanks::~ForkedRanks() {
  Release("");  // children still gated see EOF and run (then get killed below)
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
