// morphctl's commands, as a library so that tests run them in-process (the morphctl binary is a
// thin main over RunMorphctl). docs/operations.md "morphctl" is the user's reference.
//
//   morphctl [--addr host:port] [--token T] [--timeout-ms MS] [--json] COMMAND ...
//     status                      GET /v1/status, human-readable (--json: the server's JSON)
//     resize N                    POST /v1/resize {"world_size": N}
//     add K                       POST /v1/resize {"add": K}
//     remove ID...                POST /v1/resize {"remove": [ID, ...]}
//       (resize/add/remove also take --deadline-ms D and --reason R)
//     watch [--interval-ms MS] [--count N]   live view until Ctrl-C or N polls
//     metrics                     GET /metrics (Prometheus text)
//
//   std::ostringstream out, err;
//   int rc = RunMorphctl({"--addr", "127.0.0.1:8080", "status"}, out, err);
//
// Whatever a server sent (hosts, phases, explanations, error messages, metrics) is printed
// through base/printable.h (control and non-ASCII bytes escaped: \n, \x1b, ...), and --json
// documents as one line of printable ASCII JSON; a --json reply that is not JSON is exit 1.
//
// Exit codes (MorphctlExit): 0 done, 1 unexpected reply or internal error, 2 usage or local
// configuration (bad flag or value, no address, no token for a mutating call), 3 refused by the
// server (any HTTP 4xx/5xx: its message is printed), 4 coordinator unreachable (refused,
// reset, timed out).
//
// Thread: any; RunMorphctl reads the environment (MORPH_API_ADDR, MORPH_API_PORT, MORPH_TOKEN,
// MORPH_TOKEN_FILE) and blocks for at most the timeout per request (watch: until interrupted or
// --count polls).
#ifndef MORPH_RUNTIME_TOOLS_MORPHCTL_CLI_H_
#define MORPH_RUNTIME_TOOLS_MORPHCTL_CLI_H_

#include <atomic>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "morph/status.h"

namespace morph {

enum MorphctlExit : int {
  kExitOk = 0,
  kExitError = 1,
  kExitUsage = 2,
  kExitRefused = 3,
  kExitUnreachable = 4,
};

// Runs one morphctl invocation (`args` without the program name). `interrupted`, when given,
// ends `watch` as soon as it turns true (the binary sets it from SIGINT/SIGTERM).
int RunMorphctl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                const std::atomic<bool>* interrupted = nullptr);

// The usage text (printed for --help and after a usage error).
std::string MorphctlUsage();

// GET /v1/status's document as text for a person (the server's strings escaped, Printable).
// kDataLoss naming the member when the document lacks one of the members docs/operations.md
// lists or has it with the wrong type.
StatusOr<std::string> FormatStatus(const nlohmann::json& status);

// The live view of `watch`: fed every polled status document, it returns the lines to print:
// a status line ("step 1234  world 4  dp=2 tp=2 pp=1  generation 3 stable") whenever the step,
// world, config, generation or phase changed, and one line per new reconfiguration with its
// phase timings. The first update prints the status and the last reconfiguration, if any.
class WatchView {
 public:
  StatusOr<std::vector<std::string>> Update(const nlohmann::json& status);

 private:
  bool first_ = true;
  std::string last_line_;
  int64_t last_reconfigurations_ = 0;
  int64_t last_to_generation_ = -1;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_TOOLS_MORPHCTL_CLI_H_
