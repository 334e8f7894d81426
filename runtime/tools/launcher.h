// Launcher: what `morphrun` is (docs/operations.md "morphrun"), as a library so that the
// multi-process tests drive the same code. It hosts the job's coordinator, starts the initial
// workers as child processes (MORPH_COORDINATOR in their environment, and MORPH_TOKEN_FILE
// naming a 0600 file that holds the job token: never the token itself), starts
// joiners when the coordinator asks for more workers (a grow request), reaps workers that exit,
// forwards signals, and ends with the job's status.
//
//   LauncherOptions o{.workers = 4, .argv = {"./train", "--steps=100"}};
//   MORPH_ASSIGN_OR_RETURN(auto launcher, Launcher::Start(std::move(o)));
//   MORPH_ASSIGN_OR_RETURN(int code, launcher->Wait(Deadline::AfterMs(3600000)));
//
// With etcd (LauncherOptions::etcd, or MORPH_ETCD in the environment; docs/operations.md
// "Coordinator failover") it hosts no coordinator: its first MORPH_ETCD_CANDIDATES workers host
// candidates, every worker finds the leader in etcd (MORPH_ETCD_PREFIX, a fresh one per launch
// unless set), a leader's grow request arrives as a key under <prefix>/launch/ (polled every 100
// ms, deleted, turned into joiners), and the job's outcome is read from <prefix>/state. The
// scheduler API is the leader's (its http_port in <prefix>/leader).
//
// Under Slurm (morphrun --slurm, docs/operations.md "Slurm") each worker is its own job step:
// `wrapper` = {"srun", "-N1", "-n1", "--exact", ...} is put before argv, so the child is the
// step's srun, and `token_file` is on a file system every node reads.
//
// Threads: Start, Wait and the destructor on one thread; Spawn, Signal, children() and
// coordinator() from any thread.
#ifndef MORPH_RUNTIME_TOOLS_LAUNCHER_H_
#define MORPH_RUNTIME_TOOLS_LAUNCHER_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/ha/etcd_client.h"

namespace morph {

struct LauncherOptions {
  int workers = 1;                 // started at once; the first generation waits for them
  int max_workers = 1 << 16;       // grow requests beyond are refused by the coordinator
  std::vector<std::string> argv;   // the worker program and its arguments
  std::map<std::string, std::string> env;  // added to each worker's environment
  // Each worker's stdout and stderr go to <log_dir>/worker-<n>.log (mode 0600, whatever an
  // earlier file of that name had) when set, else inherited.
  std::string log_dir;
  // After the job ended (or on a fatal signal), workers still running get SIGTERM, then SIGKILL
  // after this long.
  int64_t kill_grace_ms = 10000;
  // Token generated when empty; initial_world = workers. checkpoint_dir (when empty), resume
  // and restart_count (when resume is unset) come from the workers' environment (this
  // process's plus `env`): MORPH_CHECKPOINT_DIR, MORPH_RESUME (default auto),
  // SLURM_RESTART_COUNT.
  CoordinatorOptions coordinator;
  // Put before argv for every worker (e.g. srun and its options); "{index}" in an element is
  // replaced by the worker's launch index. Empty: argv is started directly.
  std::vector<std::string> wrapper;
  // The token is written to this file (mode 0600, removed when the Launcher ends) and workers
  // get MORPH_TOKEN_FILE=<path>, never MORPH_TOKEN (a process's environment is readable in
  // /proc/<pid>/environ, and by whatever it starts). Empty: a file "token" in a private
  // folder (0700, removed too) under $TMPDIR or /tmp.
  std::string token_file;
  // Coordinator failover with candidates hosted by the workers (above): etcd's endpoints
  // ("host:port,..."; empty: MORPH_ETCD of the workers' environment, this process's plus `env`;
  // both empty: the launcher hosts the coordinator) and the job's prefix (empty:
  // MORPH_ETCD_PREFIX there, else "/morph/morphrun-<12 random hex digits>", whose keys the
  // destructor deletes once every worker is gone). The workers get
  // MORPH_ETCD, MORPH_ETCD_PREFIX, MORPH_INITIAL_WORLD = workers, MORPH_MAX_WORLD = max_workers,
  // and MORPH_COORDINATOR_PORT / MORPH_API_PORT from coordinator.port / coordinator.http.port
  // when set (candidate i adds i to each).
  std::string etcd;
  std::string etcd_prefix;
};

struct ChildInfo {
  int index = 0;  // order of launch
  pid_t pid = 0;
  bool running = true;
  int exit_code = 0;  // when !running: the exit status, or 128 + signal
};

class Launcher {
 public:
  // kInvalidArgument for an empty argv or workers < 1; the coordinator's Start errors;
  // kFailedPrecondition when the token file (or its private folder) cannot be written;
  // kInternal when a worker cannot be started (fork/exec, naming the program).
  static StatusOr<std::unique_ptr<Launcher>> Start(LauncherOptions options);
  ~Launcher();  // stops the workers (SIGTERM, then SIGKILL) and the coordinator

  // The coordinator it hosts; only without etcd (hosts_coordinator()).
  Coordinator& coordinator() { return *coordinator_; }
  bool hosts_coordinator() const { return coordinator_ != nullptr; }
  // The file that holds the job token (morphctl reads it through MORPH_TOKEN_FILE).
  const std::string& token_file() const { return options_.token_file; }
  // The job ended because every worker asked to leave (a whole-job preemption, a forwarded
  // signal), not because it completed. Valid once Wait returned a code.
  bool stopped_as_asked() const { return stopped_as_asked_; }
  // With etcd: the job's prefix there ("" without).
  const std::string& etcd_prefix() const { return options_.etcd_prefix; }
  // Starts `count` more workers; returns how many started.
  int Spawn(int count);
  // Sends `sig` to every running worker.
  void Signal(int sig);
  std::vector<ChildInfo> children() const;

  // Until the job completes (the coordinator's Wait) and every worker exited: 0 when the job
  // completed and every worker exited 0 or was killed by a signal (exit code >= 128: a failure
  // the job survived, as a scheduler's SIGKILL of a removed node's task); otherwise the first
  // worker exit code in 1..127, or 1 when the job failed (then any non-zero code counts). Also
  // ends, 2 s after the last worker exited, when every worker is gone but the job did not
  // complete (nobody is left to finish it). kDeadlineExceeded if the
  // deadline passed first (workers are left running: the destructor stops them); what it saw
  // carries over to the next call, so a loop of short Waits (morphrun's) ends like one long one.
  StatusOr<int> Wait(Deadline deadline);

 private:
  Launcher() = default;
  Status SpawnOne();
  void Reap();
  // With etcd, on watcher_: starts the workers a leader asks for (<prefix>/launch/ keys) and
  // reads the job's outcome from <prefix>/state until it is known or the launcher ends.
  void Watch();
  // The job's outcome from its saved state: OK (completed or stopped as asked), an error (it
  // failed), nullopt while it runs (or etcd cannot be read).
  std::optional<Status> OutcomeFromEtcd();

  LauncherOptions options_;
  std::string private_dir_;  // the token file's folder when the Launcher made one
  std::unique_ptr<Coordinator> coordinator_;
  // Wait's progress (Wait's thread): the job's outcome once known, and since when no worker ran.
  std::optional<Status> job_;
  bool stopped_as_asked_ = false;
  std::optional<std::chrono::steady_clock::time_point> all_gone_;
  std::mutex spawn_mu_;  // SpawnOne, whole (Start's thread and the coordinator's launcher thread)
  mutable std::mutex mu_;
  std::vector<ChildInfo> children_;
  // With etcd (mu_ for etcd_outcome_).
  std::unique_ptr<EtcdClient> etcd_;
  std::optional<Status> etcd_outcome_;
  bool own_prefix_ = false;  // made up here: its keys are deleted when the launcher ends
  std::thread watcher_;
  std::atomic<bool> stopping_{false};
};

}  // namespace morph

#endif  // MORPH_RUNTIME_TOOLS_LAUNCHER_H_
