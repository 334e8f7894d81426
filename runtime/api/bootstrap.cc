#include "runtime/api/bootstrap.h"

#include <fcntl.h>
#include <glog/logging.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "runtime/api/test_hooks.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/ha/election.h"
#if MORPH_WITH_MPI
#include "collectives/mpi_bootstrap.h"
#endif

namespace morph {
namespace {

constexpr uint16_t kSlurmDefaultPort = 29400;

// What a coordinator hosted in a worker is given: `o`'s settings, bound to bind:port with its
// scheduler API on api_port, admitting `initial_world` workers with `token`.
StatusOr<CoordinatorOptions> HostedOptions(const Options& o, int initial_world,
                                           const std::string& bind, uint16_t port,
                                           uint16_t api_port, const std::string& token) {
  CoordinatorOptions c;
  c.address = bind;
  c.port = port;
  c.token = token;
  c.initial_world = initial_world;
  c.max_world = o.max_world;
  c.heartbeat_timeout_ms = o.heartbeat_timeout_ms;
  c.local_watch_ms = o.coordinator_local_watch_ms;
  c.max_unauthenticated = o.coordinator_max_unauthenticated;
  c.checkpoint_dir = o.checkpoint_dir;
  MORPH_ASSIGN_OR_RETURN(c.resume, ParseResumeMode(o.resume, "resume"));
  c.restart_count = o.restart_count;
  c.http.address = o.api_address;
  c.http.port = api_port;
  c.http.token_for_reads = o.api_token_for_reads;
  c.http.token = token;
  c.http.max_world = o.max_world;
  c.policy = o.config_policy;
  return c;
}

StatusOr<std::unique_ptr<Coordinator>> Host(const Options& o, int initial_world,
                                            const std::string& bind, uint16_t port,
                                            const std::string& token) {
  MORPH_ASSIGN_OR_RETURN(CoordinatorOptions c,
                         HostedOptions(o, initial_world, bind, port, o.api_port, token));
  return Coordinator::Start(std::move(c));
}

// A coordinator candidate hosted by the worker at `index` of the launch (Bootstrap::kEtcd).
// Candidates of one host must not share ports: fixed ones (MORPH_COORDINATOR_PORT,
// MORPH_API_PORT) are offset by the index. A grow's LaunchWorkers becomes a key
// <prefix>/launch/<nonce>-<n> holding the count, which morphrun (Launcher) turns into joiners.
StatusOr<std::unique_ptr<Coordinator>> HostCandidate(const Options& o, int index,
                                                     const EtcdOptions& etcd) {
  std::string bind = o.coordinator_bind;
  if (!o.slurm_nodelist.empty() && bind == "127.0.0.1") bind = "0.0.0.0";
  MORPH_ASSIGN_OR_RETURN(
      CoordinatorOptions c,
      HostedOptions(o, o.initial_world, bind,
                    o.coordinator_port ? static_cast<uint16_t>(o.coordinator_port + index) : 0,
                    o.api_port ? static_cast<uint16_t>(o.api_port + index) : 0, o.token));
  c.etcd = etcd;
  c.etcd_prefix = o.etcd_prefix;
  c.etcd_ttl_s = o.etcd_ttl_s;
  c.rejoin_timeout_ms = o.etcd_rejoin_ms;
  // Runs on the coordinator's launcher thread, only ever for a leader's persisted decision.
  auto client = std::make_shared<EtcdClient>(etcd);
  StatusOr<std::string> nonce = RandomToken();
  c.launch_workers = [client, key = LaunchKeyPrefix(o.etcd_prefix) +
                                    (nonce.ok() ? nonce->substr(0, 12) : std::to_string(index)),
                      n = std::make_shared<std::atomic<int64_t>>(0)](int count) {
    const std::string k = key + "-" + std::to_string(n->fetch_add(1));
    Status s = client->Put(k, std::to_string(count));
    if (s.ok()) {
      LOG(INFO) << "asked the launcher for " << count << " worker(s) (etcd " << k << ")";
    } else {
      LOG(WARNING) << "cannot ask the launcher for " << count << " worker(s): " << s;
    }
  };
  return Coordinator::Start(std::move(c));
}

StatusOr<BootstrapResult> ResolveEtcd(const Options& o, BootstrapResult r, Deadline deadline) {
  if (o.token.empty()) {
    return FailedPreconditionError(
        "coordinator candidates hosted by workers (MORPH_ETCD without MORPH_COORDINATOR) need the "
        "same job token in every worker: set MORPH_TOKEN or MORPH_TOKEN_FILE");
  }
  MORPH_ASSIGN_OR_RETURN(EtcdOptions etcd, EtcdOptions::Parse(o.etcd, "MORPH_ETCD"));
  // morphrun's launch index first: under morphrun --slurm each worker is task 0 of its own step.
  const int index = o.launch_index >= 0 ? o.launch_index : o.launcher_rank;
  if (index >= 0 && index < o.etcd_candidates) {
    if (index > 0) {
      // Candidate 0 (rank 0) leads a new job, as without failover: the others campaign once a
      // leader exists, or after index seconds without one (candidate 0 is slow or gone). A
      // worker waits for a leader before it registers anyway.
      EtcdClient client(etcd);
      (void)FindLeader(client, o.etcd_prefix, Min(deadline, Deadline::AfterMs(1000 * index)));
    }
    MORPH_ASSIGN_OR_RETURN(r.coordinator, HostCandidate(o, index, etcd));
    LOG(INFO) << "hosting coordinator candidate " << index << " of " << o.etcd_candidates
              << " at " << r.coordinator->control_address() << " (scheduler API port "
              << r.coordinator->http_port() << ") for " << o.initial_world
              << " worker(s), etcd prefix " << o.etcd_prefix;
  }
  if (!o.slurm_nodelist.empty() && (r.data_hostname.empty() || r.data_hostname == "127.0.0.1")) {
    r.data_hostname = o.host;
  }
  r.leader_from_etcd = true;
  return r;
}

}  // namespace

std::string LaunchKeyPrefix(const std::string& prefix) { return prefix + "/launch/"; }

StatusOr<std::string> FindLeader(EtcdClient& etcd, const std::string& prefix, Deadline deadline) {
  Status last;
  bool logged = false;
  while (true) {
    StatusOr<std::optional<std::string>> v = LookupLeader(etcd, prefix);
    if (v.ok() && v->has_value()) return LeaderControlAddress(**v);
    if (!v.ok()) last = v.status();
    if (!logged) {
      logged = true;
      LOG(INFO) << "waiting for a coordinator to lead " << prefix << " (etcd "
                << etcd.options().endpoints.front() << ")";
    }
    if (deadline.Remaining() < std::chrono::milliseconds(20)) {
      return DeadlineExceededError("no coordinator leads " + prefix + " in etcd in time" +
                                   (last.ok() ? "" : " (last lookup: " + last.ToString() + ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Status WritePrivateFile(const std::string& path, const std::string& body,
                        const std::string& what) {
  auto fail = [&](const std::string& step) {
    return FailedPreconditionError(what + "=" + path + ": " + step + ": " +
                                   std::strerror(errno));
  };
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot create " + tmp);
  size_t done = 0;
  while (done < body.size()) {
    ssize_t n = write(fd, body.data() + done, body.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Status s = fail("cannot write " + tmp);
      close(fd);
      unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  // The mode is 0600 whatever the file was before (O_CREAT's mode applies to new files only).
  if (fchmod(fd, 0600) != 0 || close(fd) != 0) {
    Status s = fail("cannot finish " + tmp);
    unlink(tmp.c_str());
    return s;
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    Status s = fail("cannot rename " + tmp);
    unlink(tmp.c_str());
    return s;
  }
  return Status();
}

Status WriteCoordinatorFile(const std::string& path, const std::string& address,
                            const std::string& token) {
  if (path.empty()) return Status();
  return WritePrivateFile(path, address + "\n" + token + "\n", "MORPH_COORDINATOR_FILE");
}

StatusOr<std::string> RandomToken() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[16];
  if (!in.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    return UnavailableError("cannot read /dev/urandom for a job token");
  }
  std::string out;
  char hex[3];
  for (unsigned char b : bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", b);
    out += hex;
  }
  return out;
}

StatusOr<std::string> FirstSlurmHost(const std::string& nodelist) {
  if (nodelist.empty()) return InvalidArgumentError("SLURM_STEP_NODELIST is empty");
  size_t end = nodelist.find_first_of(",[");
  if (end == std::string::npos || nodelist[end] == ',') {
    std::string host = nodelist.substr(0, end);
    if (host.empty()) return InvalidArgumentError("SLURM_STEP_NODELIST=" + nodelist + ": no host");
    return host;
  }
  // prefix[range,...]: the first number of the first range keeps its zero padding.
  std::string prefix = nodelist.substr(0, end);
  size_t close = nodelist.find(']', end);
  if (close == std::string::npos) {
    return InvalidArgumentError("SLURM_STEP_NODELIST=" + nodelist + ": '[' without ']'");
  }
  std::string inside = nodelist.substr(end + 1, close - end - 1);
  size_t stop = inside.find_first_of(",-");
  std::string first = inside.substr(0, stop);
  if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos) {
    return InvalidArgumentError("SLURM_STEP_NODELIST=" + nodelist + ": range '" + inside +
                                "' does not start with a number");
  }
  // A suffix after ']' (rare: "n[1-2]-ib") belongs to every host.
  size_t suffix_end = nodelist.find(',', close);
  return prefix + first + nodelist.substr(close + 1, suffix_end - close - 1);
}

StatusOr<BootstrapResult> ResolveBootstrap(const Options& o, Deadline deadline) {
  BootstrapResult r;
  r.token = o.token;
  r.data_hostname = o.data_hostname;
  Bootstrap mode = o.bootstrap;
  if (mode == Bootstrap::kAuto) {
    if (!o.etcd.empty() && o.coordinator.empty()) {
      mode = Bootstrap::kEtcd;
    } else if (!o.coordinator.empty()) {
      mode = Bootstrap::kJoin;
    } else if (o.launcher_size > 0 && o.slurm_nodelist.empty()) {
      mode = Bootstrap::kMpi;
    } else if (o.launcher_size > 0) {
      mode = Bootstrap::kSlurm;
    } else {
      mode = Bootstrap::kHost;
    }
  }
  r.mode = mode;
  switch (mode) {
    case Bootstrap::kEtcd:
      return ResolveEtcd(o, std::move(r), deadline);
    case Bootstrap::kAuto:
    case Bootstrap::kJoin:
      if (o.coordinator.empty()) {
        return FailedPreconditionError("joining a job needs its coordinator: set "
                                       "MORPH_COORDINATOR=host:port (Options::coordinator)");
      }
      if (r.token.empty()) {
        return FailedPreconditionError("joining " + o.coordinator +
                                       " needs the job token: set MORPH_TOKEN or "
                                       "MORPH_TOKEN_FILE (Options::token)");
      }
      r.coordinator_address = o.coordinator;
      // A Slurm step joining a job (morphrun --slurm's workers): peers on other nodes dial this
      // worker's data plane, so it listens on the host's name as under the Slurm bootstrap.
      if (!o.slurm_nodelist.empty() &&
          (r.data_hostname.empty() || r.data_hostname == "127.0.0.1")) {
        r.data_hostname = o.host;
      }
      return r;
    case Bootstrap::kHost: {
      if (r.token.empty()) {
        MORPH_ASSIGN_OR_RETURN(r.token, RandomToken());
      }
      MORPH_ASSIGN_OR_RETURN(r.coordinator, Host(o, o.initial_world, o.coordinator_bind,
                                                 o.coordinator_port, r.token));
      r.coordinator_address = r.coordinator->control_address();
      LOG(INFO) << "hosting the coordinator at " << r.coordinator_address << " for "
                << o.initial_world << " worker(s)";
      MORPH_RETURN_IF_ERROR(
          WriteCoordinatorFile(o.coordinator_file, r.coordinator_address, r.token));
      return r;
    }
    case Bootstrap::kMpi: {
#if MORPH_WITH_MPI
      std::unique_ptr<Coordinator> hosted;
      StatusOr<MpiBootstrap> shared = MpiBootstrap::Share([&]() -> StatusOr<std::string> {
        std::string token = o.token;
        if (token.empty()) {
          MORPH_ASSIGN_OR_RETURN(token, RandomToken());
        }
        MORPH_ASSIGN_OR_RETURN(hosted, Host(o, o.launcher_size, o.coordinator_bind,
                                            o.coordinator_port, token));
        LOG(INFO) << "mpirun rank 0: hosting the coordinator at " << hosted->control_address()
                  << " for " << o.launcher_size << " worker(s)";
        MORPH_RETURN_IF_ERROR(
            WriteCoordinatorFile(o.coordinator_file, hosted->control_address(), token));
        return hosted->control_address() + "\n" + token;
      });
      // MPI is used for nothing else: finalize it now, on every rank at the same point (it is
      // collective). Otherwise each worker would have to finalize at its exit, together, and a
      // worker that leaves the job early (or a job that outlives its first ranks) would count as
      // an abnormal termination for mpirun, which then kills the job.
      Status finalized = MpiBootstrap::Finalize();
      MORPH_RETURN_IF_ERROR(shared.status());
      MORPH_RETURN_IF_ERROR(finalized);
      MpiBootstrap& boot = *shared;
      size_t nl = boot.blob.find('\n');
      if (nl == std::string::npos) return InternalError("mpi bootstrap: malformed blob");
      r.coordinator_address = boot.blob.substr(0, nl);
      r.token = boot.blob.substr(nl + 1);
      r.coordinator = std::move(hosted);
      return r;
#else
      return FailedPreconditionError(
          "launched by mpirun (OMPI_COMM_WORLD_SIZE is set) but morph was built without MPI; "
          "set MORPH_COORDINATOR to join a coordinator instead");
#endif
    }
    case Bootstrap::kSlurm: {
      if (r.token.empty()) {
        return FailedPreconditionError(
            "under Slurm every task needs the same job token: export MORPH_TOKEN (or "
            "MORPH_TOKEN_FILE) in the batch script");
      }
      MORPH_ASSIGN_OR_RETURN(std::string first, FirstSlurmHost(o.slurm_nodelist));
      uint16_t port = o.coordinator_port ? o.coordinator_port : kSlurmDefaultPort;
      if (r.data_hostname.empty() || r.data_hostname == "127.0.0.1") r.data_hostname = o.host;
      if (o.launcher_rank == 0) {
        std::string bind = o.coordinator_bind == "127.0.0.1" ? "0.0.0.0" : o.coordinator_bind;
        MORPH_ASSIGN_OR_RETURN(r.coordinator, Host(o, o.launcher_size, bind, port, r.token));
        LOG(INFO) << "Slurm task 0: hosting the coordinator at " << first << ":" << port
                  << " for " << o.launcher_size << " worker(s)";
        MORPH_RETURN_IF_ERROR(WriteCoordinatorFile(
            o.coordinator_file, r.coordinator->control_address(), r.token));
      }
      r.coordinator_address = first + ":" + std::to_string(port);
      (void)deadline;  // the agent retries refused connections until the start deadline
      return r;
    }
  }
  return InternalError("unknown bootstrap mode");
}

}  // namespace morph
