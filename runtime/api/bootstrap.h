// How Runtime::Start finds its job's coordinator (options.h lists the sources and their order):
// join a given address, host one (alone, as mpirun's rank 0 with the address handed out through
// MPI, or as Slurm's task 0 at a fixed port on the first node), or dial Slurm's first node.
//
// Training thread, once, from Runtime::Start.
#ifndef MORPH_RUNTIME_API_BOOTSTRAP_H_
#define MORPH_RUNTIME_API_BOOTSTRAP_H_

#include <memory>
#include <string>

#include "morph/deadline.h"
#include "morph/status.h"
#include "morph/options.h"
#include "runtime/coordinator/coordinator.h"

namespace morph {


struct BootstrapResult {
  std::string coordinator_address;  // "host:port" to dial
  std::string token;                // the job token (generated when hosting without one)
  std::unique_ptr<Coordinator> coordinator;  // hosted here, or null
  std::string data_hostname;        // what Gloo should listen on ("" : GlooOptions' default)
  Bootstrap mode = Bootstrap::kHost;
};

// kFailedPrecondition naming what is missing (no token to join with; Slurm without
// MORPH_TOKEN; mpirun in a build without MPI), kInvalidArgument for an unparsable
// SLURM_STEP_NODELIST, the coordinator's Start errors.
StatusOr<BootstrapResult> ResolveBootstrap(const Options& options, Deadline deadline);

// The first host of a Slurm host list: "node[01-04,07],gpu5" -> "node01", "a,b" -> "a".
// kInvalidArgument for an empty or malformed list.
StatusOr<std::string> FirstSlurmHost(const std::string& nodelist);

// Writes "<address>\n<token>\n" to `path` (Options::coordinator_file) with mode 0600, through a
// temporary file renamed over it (a reader never sees half of it). Nothing for an empty path.
// kFailedPrecondition naming the path and the system's reason when it cannot be written.
Status WriteCoordinatorFile(const std::string& path, const std::string& address,
                            const std::string& token);

// Writes `body` to `path` with mode 0600 through a temporary file renamed over it (the token file
// morphrun --slurm hands its workers, the coordinator file). kFailedPrecondition naming
// `what`=path and the system's reason when it cannot be written.
Status WritePrivateFile(const std::string& path, const std::string& body,
                        const std::string& what);

// 32 hex digits from the system's random source.
StatusOr<std::string> RandomToken();

}  // namespace morph

#endif  // MORPH_RUNTIME_API_BOOTSTRAP_H_
