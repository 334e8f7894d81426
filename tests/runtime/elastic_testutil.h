// What the multi-process runtime tests share, whatever launched the elastic_worker processes
// (the Launcher in elastic_test.cc, the morphrun binary or mpirun in launch_test.cc): the check
// that the samples each step consumed, from the workers' logs, are exactly the fixed global
// order; and, for tests that run programs as a user would, starting a process with its output
// in a file, waiting for it with a timeout, and one HTTP request to a scheduler API.
// gtest assertions; the test's thread.
#ifndef MORPH_TESTS_RUNTIME_ELASTIC_TESTUTIL_H_
#define MORPH_TESTS_RUNTIME_ELASTIC_TESTUTIL_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "morph/parallel_config.h"

namespace morph::testing {

// elastic_worker's data set: 48 samples, a global batch of 12, seed 7 (an epoch every 4 steps).
constexpr int64_t kElasticBatch = 12;
constexpr int64_t kElasticSamples = 48;

// dp x tp x pp over elastic_worker's 4 layers, evenly staged.
ParallelConfig Config(int dp, int tp, int pp);

// The tail of every *.log file in `dir` (the workers' output), for failure messages.
std::string WorkerLogs(const std::filesystem::path& dir);

// From every DP rank's <dir>/*.samples: every step 0..steps-1 trained exactly once per DP rank,
// the DP slices disjoint, each step's union the global order's next batch, each epoch a
// permutation of the dataset.
// With `retrained`, a step may appear in several generations (a recovery trained it again):
// the latest generation's entries count.
void CheckSamples(const std::filesystem::path& dir, int64_t steps, bool retrained = false);

// Starts argv[0] (a path) with this process's environment plus `env` (a value of "" removes the
// variable), stdout and stderr to `log`, in its own process group. -1 when fork fails.
pid_t SpawnProcess(const std::vector<std::string>& argv,
                   const std::map<std::string, std::string>& env, const std::string& log);
// Its exit code (128 + signal when killed), or nullopt if it still runs after `timeout_ms`.
std::optional<int> WaitExit(pid_t pid, int64_t timeout_ms);

// The scheduler API port a morphd printed on a line {"control": ..., "http_port": N} of its
// output file `out`, waiting up to `timeout_ms`; 0 when it printed none by then.
uint16_t WaitForMorphdApiPort(const std::filesystem::path& out, int64_t timeout_ms = 20000);

// One line of an elastic_worker's <dir>/worker-<id>.samples: the step it trained, the
// generation, the config's dp, its DP rank, and the sample indices it trained on.
struct SampleLine {
  int64_t step = 0, generation = 0, dp = 0, dp_rank = 0;
  std::vector<int64_t> samples;
};
// Every *.samples file of `dir`: file name -> its complete lines, in order.
std::map<std::string, std::vector<SampleLine>> ReadSampleFiles(const std::filesystem::path& dir);

// Milliseconds of the steady clock since `t`.
double MsSince(std::chrono::steady_clock::time_point t);
// SIGTERM, then SIGKILL after `grace_ms`; reaps it. For cleanup.
void Stop(pid_t pid, int64_t grace_ms = 3000);

// The text of a file ("" when it cannot be read).
std::string ReadFile(const std::filesystem::path& path);
// Runs a shell command (stderr with stdout); its exit status, -1 if it did not exit; its output
// into `out` when given.
int Sh(const std::string& cmd, std::string* out = nullptr);
// Lines of `log` in which an elastic_worker says it stopped because the coordinator is gone:
// "elastic_worker P: <call>: UNAVAILABLE: [context: ]connection to the coordinator lost...",
// from whichever call of its training loop came first after the loss (BeginStep, AbortStep,
// CommitUpdate; a commit vote adds "step N: its commit vote failed and no recovery followed").
int CoordinatorLostLines(const std::string& log);
// The decimal numbers that follow each occurrence of `before` in `text`.
std::vector<std::string> NumbersAfter(const std::string& text, const std::string& before);
// The coordinator file a hosting worker writes (MORPH_COORDINATOR_FILE: "host:port\ntoken\n"),
// once it is complete; false after `timeout_ms`.
bool ReadCoordinatorFile(const std::filesystem::path& path, std::string& address,
                         std::string& token, int64_t timeout_ms = 30000);


// One HTTP/1.1 request to 127.0.0.1:port (Connection: close), with "Authorization: Bearer
// <token>" when `token` is not empty. The status code (0 when the request failed) and the body.
struct HttpReply {
  int code = 0;
  std::string body;
};
HttpReply Http(uint16_t port, const std::string& method, const std::string& target,
               const std::string& body = "", const std::string& token = "");

// GET /v1/status of the scheduler API on 127.0.0.1:api_port as JSON (null when unreadable).
nlohmann::json ApiStatus(uint16_t api_port);
// Polls ApiStatus every 20 ms until `pred` holds for it; false after `timeout_ms`.
bool WaitForStatus(uint16_t api_port, const std::function<bool(const nlohmann::json&)>& pred,
                   int64_t timeout_ms = 60000);
// A status at `generation` or later with `world` members and no resize under way or pending.
bool Stable(const nlohmann::json& s, int64_t generation, size_t world);

// A TCP port that was free a moment ago on 127.0.0.1.
uint16_t FreePort();

}  // namespace morph::testing

#endif  // MORPH_TESTS_RUNTIME_ELASTIC_TESTUTIL_H_
