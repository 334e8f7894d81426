// How Runtime::Start finds its job's coordinator (options.h lists the sources and their order):
// join a given address, host one (alone, as mpirun's rank 0 with the address handed out through
// MPI, or as Slurm's task 0 at a fixed port on the first node), or dial Slurm's first node.
// With etcd and no coordinator given (Bootstrap::kEtcd), the first Options::etcd_candidates
// workers of the launch each host a coordinator candidate, and every worker dials the leader
// that etcd names (FindLeader, until it registers: a leader may die or step down meanwhile).
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
#include "runtime/ha/etcd_client.h"

namespace morph {


struct BootstrapResult {
  std::string coordinator_address;  // "host:port" to dial
  std::string token;                // the job token (generated when hosting without one)
  std::unique_ptr<Coordinator> coordinator;  // hosted here, or null
  std::string data_hostname;        // what Gloo should listen on ("" : GlooOptions' default)
  Bootstrap mode = Bootstrap::kHost;
  // kEtcd: coordinator_address is empty; dial the leader FindLeader names instead.
  bool leader_from_etcd = false;
};

// The control address of the leader of `prefix` (its <prefix>/leader key), looked up every 20
// ms until there is one. kDeadlineExceeded naming the prefix when none leads by `deadline`
// (etcd unreachable meanwhile: its kUnavailable as context); kDataLoss for a leader key that
// holds no control address. Any thread.
StatusOr<std::string> FindLeader(EtcdClient& etcd, const std::string& prefix, Deadline deadline);

// Where a hosted candidate that leads asks for more workers (a grow's LaunchWorkers): a key
// <prefix>/launch/<id> per request, holding the count; morphrun starts them and deletes the key.
std::string LaunchKeyPrefix(const std::string& prefix);

// kFailedPrecondition naming what is missing (no token to join with; Slurm or hosted candidates
// without MORPH_TOKEN; mpirun in a build without MPI); kInvalidArgument for a bad MORPH_ETCD or
// an unparsable SLURM_STEP_NODELIST; the coordinator's Start errors.
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
