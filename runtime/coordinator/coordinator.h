// Coordinator: the control plane's I/O shell around the Decider (docs/design.md §9). It hosts
// the job's TcpStoreServer (and alone advances its generation), accepts the workers' control
// connections (runtime/protocol/wire.h), serves the scheduler API (http_server.h), and carries
// out the decider's actions. Runs embedded (rank 0 under mpirun, inside morphrun) or standalone
// (morphd).
//
//   MORPH_ASSIGN_OR_RETURN(CoordinatorOptions o, CoordinatorOptions::FromEnv());
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> c, Coordinator::Start(std::move(o)));
//   setenv("MORPH_COORDINATOR", c->control_address().c_str(), 1);   // for the workers
//   Status job = c->Wait(Deadline::Infinite());
//
// Connections that have not sent their Hello are capped (max_unauthenticated, and an eighth of
// the open-file limit; the oldest goes first), so idle strangers never take the descriptors of
// the process that hosts the coordinator.
//
// Shell: one io thread (Boost.Asio) on which nothing blocks. Per connection it reads a header,
// checks its bound (a Hello of at most 4 KiB before authentication; the body buffer grows as
// bytes arrive), reads the body, decodes it and feeds the decider: Hello (the job token, the
// wire version), then Register (ValidateManifest; the job's manifest is the first registration's
// or CoordinatorOptions::manifest; a differing one is refused naming the first difference); only
// then Join. A refused handshake is answered with an ErrorMsg and closed. A connection speaks
// for the worker it registered as only: a StepReport or Applied whose `worker` names another is
// answered with an ErrorMsg kPermissionDenied naming the field, and closed (that worker is then
// lost). Heartbeats update the last-seen time, Leave is a leave request, Done marks the worker finished, a connection closed
// otherwise is a loss. The decider's actions run in order: sends are encoded once and queued per
// connection; ComputePlan runs on a planner thread (PlanChange below) and comes back as
// PlanReady; a tick drives heartbeat timeouts. Each decision is logged in one line.
//
// Threads: Start, Stop and the destructor from any thread but the io thread; the accessors,
// Snapshot, Resize and Wait from any thread except the io thread (Resize and Wait block).
#ifndef MORPH_RUNTIME_COORDINATOR_COORDINATOR_H_
#define MORPH_RUNTIME_COORDINATOR_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "morph/deadline.h"
#include "morph/status.h"
#include "collectives/store/tcp_store.h"
#include "runtime/coordinator/config_planner.h"
#include "runtime/coordinator/decider.h"
#include "runtime/plan/choose_recovery.h"
#include "runtime/coordinator/http_api.h"
#include "runtime/coordinator/http_server.h"
#include "runtime/ha/etcd_client.h"
#include "runtime/protocol/messages.h"

namespace morph {

// Resume at start (MORPH_RESUME, docs/operations.md "Whole-job preemption and requeue"): whether a
// job's first generation starts from the newest complete checkpoint of an earlier run instead of
// afresh.
//   kAuto:   on a restart, i.e. SLURM_RESTART_COUNT > 0 (a requeued Slurm job), when there is
//            a complete checkpoint; otherwise a fresh start;
//   kAlways: whenever there is a complete checkpoint (a job relaunched by hand, another
//            scheduler's restart); otherwise a fresh start;
//   kNever:  always a fresh start (the old checkpoints stay; the job's own are numbered after
//            them and a recovery never reads theirs).
enum class ResumeMode : uint8_t { kAuto, kAlways, kNever };
// "auto", "always", "never" (any case). kInvalidArgument naming `what` (the variable) otherwise.
StatusOr<ResumeMode> ParseResumeMode(std::string_view value,
                                     std::string_view what = "MORPH_RESUME");
std::string_view ResumeModeName(ResumeMode mode);
// SLURM_RESTART_COUNT's value (unset or empty: 0). kInvalidArgument for anything but a count.
StatusOr<int64_t> ParseRestartCount(const char* value);

struct CoordinatorOptions {
  std::string address = "127.0.0.1";  // control-channel bind address (MORPH_COORDINATOR_ADDR)
  uint16_t port = 0;                   // 0: ephemeral (see control_address())
  // Host workers should dial (MORPH_COORDINATOR_ADVERTISE; default: `address`, or this host's
  // name when binding 0.0.0.0 / ::).
  std::string advertise_host;
  std::string token;                     // job token (required; Hello must carry it)
  int initial_world = 1;                 // workers that must register before generation 1
  int max_world = 1 << 16;
  int64_t heartbeat_timeout_ms = 10000;  // a silent worker is lost (0: never)
  // How often to look at same-host workers' processes (MORPH_LOCAL_WATCH_MS; 0: never): one
  // that is exiting is lost at once, before the kernel has freed its memory and closed its
  // connection (process_watch.h).
  int64_t local_watch_ms = 10;
  std::optional<JobManifest> manifest;   // else defined by the first registration
  bool serve_http = true;
  HttpServerOptions http;  // the scheduler API (its token defaults to `token`)
  TcpStoreServerOptions store;
  // DeciderAction::LaunchWorkers: called (on a launcher thread, not the io thread) with the
  // number of workers to start. Null: logged only.
  std::function<void(int count)> launch_workers;
  ConfigPolicy policy;  // optional user policy for the config planner
  // The newest complete checkpoint a recovery may roll back to when no copy of a piece
  // survives (called on the planner thread). Null: the newest complete one in checkpoint_dir
  // (the workers' MORPH_CHECKPOINT_DIR), if set.
  std::function<std::optional<RecoveryCheckpoint>()> latest_checkpoint;
  std::string checkpoint_dir;
  // Resume at start (see ResumeMode): the first generation commits at the step of the newest
  // complete checkpoint (latest_checkpoint when set, else the newest in checkpoint_dir), after
  // checking that it holds exactly the job's registered tensors and scalars (else the job
  // fails with kFailedPrecondition naming the first difference). `restart_count` is the
  // scheduler's count of restarts (SLURM_RESTART_COUNT) for kAuto.
  // Unset: never (the Launcher sets both from the workers' environment, FromEnv from this
  // process's).
  std::optional<ResumeMode> resume;
  int64_t restart_count = 0;
  bool ResumeEnabled() const {
    return resume == ResumeMode::kAlways || (resume == ResumeMode::kAuto && restart_count > 0);
  }
  // The job's first generation id (at most kMaxCheckpointGeneration + 1). 0: after the newest
  // generation a checkpoint folder in checkpoint_dir names (NewestCheckpointGeneration), so a
  // job restarted on an earlier run's checkpoints never writes into a folder of theirs; 1 when
  // there is none. Sent to every worker in its Welcome: its checkpoint retention never deletes
  // a folder of a lower generation.
  int64_t first_generation = 0;
  // A handshake (Hello + Register) must complete within this, else the connection is closed.
  int64_t handshake_timeout_ms = 10000;
  // Connections that have not yet sent a Hello with the job token, at most (also at most an
  // eighth of the open-file limit, base/connection_limit.h, so that strangers cannot take the
  // descriptors of the process: a training worker's own, the store's, the scheduler API's); at
  // the cap the oldest is closed (MORPH_COORDINATOR_MAX_UNAUTHENTICATED).
  int64_t max_unauthenticated = 1024;

  // Coordinator failover (docs/design.md "Coordinator failover"; MORPH_ETCD): with etcd set
  // this coordinator is one candidate among several. It campaigns for leadership on an etcd
  // lease of etcd_ttl_s seconds under etcd_prefix; a follower refuses registrations (kUnavailable,
  // naming the leader) and decides nothing. A leader restores the decider's state the last
  // leader persisted (workers it knew have rejoin_timeout_ms to reconnect) and persists it
  // after every decision, in a transaction fenced on its lease, before carrying it out; a write
  // refused (deposed) or failed (etcd unreachable) makes it step down: its connections close
  // and it campaigns again. Unset: one coordinator, as before.
  std::optional<EtcdOptions> etcd;
  std::string etcd_prefix = "/morph/job";
  int64_t etcd_ttl_s = 2;
  int64_t rejoin_timeout_ms = 10000;

  // MORPH_COORDINATOR_ADDR, MORPH_COORDINATOR_PORT, MORPH_COORDINATOR_ADVERTISE, MORPH_TOKEN /
  // MORPH_TOKEN_FILE, MORPH_INITIAL_WORLD, MORPH_MAX_WORLD, MORPH_HEARTBEAT_TIMEOUT_MS,
  // MORPH_COORDINATOR_MAX_UNAUTHENTICATED, MORPH_LOCAL_WATCH_MS, MORPH_CHECKPOINT_DIR, MORPH_RESUME (default auto) and SLURM_RESTART_COUNT,
  // MORPH_ETCD, MORPH_ETCD_PREFIX, MORPH_ETCD_TTL_S, MORPH_ETCD_REJOIN_MS, plus
  // HttpServerOptions::FromEnv and TcpStoreServerOptions::FromEnv. kInvalidArgument naming the
  // variable for a bad value; kFailedPrecondition when no token is set; kNotFound /
  // kPermissionDenied for an unreadable token file. Any thread.
  static StatusOr<CoordinatorOptions> FromEnv();
};

// The shell's ComputePlan, a pure function (it runs on the planner thread): the config
// planner's choice for req.target_world (ModelConstraints from manifest.model, the memory
// estimate from the manifest's state bytes per rank), the exact assignment (AssignRanks), and
// the commit digest (PlanForChange over ParticipantOrder). The errors of those steps.
StatusOr<PlannedChange> PlanChange(const JobManifest& manifest, const ConfigPolicy& policy,
                                   const PlanRequest& req);

class Coordinator {
 public:
  // Binds the control channel, starts the store, the scheduler API and the io thread.
  // kInvalidArgument for an empty token, initial_world < 1, max_world < initial_world, an
  // invalid manifest, an address that does not parse or a first_generation beyond
  // kMaxCheckpointGeneration + 1; kFailedPrecondition naming a checkpoint folder whose
  // generation the job could not number after (NewestCheckpointGeneration); kUnavailable when a
  // bind fails.
  static StatusOr<std::unique_ptr<Coordinator>> Start(CoordinatorOptions options);
  ~Coordinator();  // Stop()
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  std::string control_address() const;  // "host:port" for MORPH_COORDINATOR
  std::string store_address() const;    // "host:port" of the hosted store (same token)
  uint16_t http_port() const;           // 0 if !serve_http
  TcpStoreServer& store();

  // The coordinator's state as /v1/status shows it: a copy published by the io thread (at
  // most ~50 ms old).
  CoordinatorSnapshot Snapshot() const;
  // The same path as POST /v1/resize (request_id is assigned here); returns the decider's
  // answer: OK when accepted (the change runs on), its error otherwise; kDeadlineExceeded
  // when no answer came in time; kFailedPrecondition after Stop.
  Status Resize(ResizeRequest request, Deadline deadline);
  // Blocks until the job completed (OK: every member sent Done), failed (the decider's
  // JobFailed status), stopped because every worker asked to leave (kCancelled: JobStopped),
  // the coordinator was stopped (kAborted) or `deadline` passed (kDeadlineExceeded).
  Status Wait(Deadline deadline);
  // Closes the listener, every connection, the scheduler API and the store; idempotent.
  void Stop();
  // Coordinator failover: a leader gives its leadership up (as after a refused write: its
  // connections close, its lease is revoked so another candidate may lead at once, and it
  // campaigns again a TTL later), e.g. when the worker that hosts it leaves the job. Nothing
  // without etcd or when not leading. Any thread; returns at once.
  void Resign();

  struct Stats {
    int64_t connections_accepted = 0;
    int64_t handshakes_refused = 0;  // ErrorMsg + close during Hello/Register
    // Closed before their Hello because max_unauthenticated others were waiting (or the
    // process ran out of descriptors); counted in handshakes_refused too.
    int64_t unauthenticated_dropped = 0;
    int64_t workers_registered = 0;
    int64_t workers_connected = 0;   // registered and still connected
    int64_t frames_received = 0;
    int64_t frames_sent = 0;         // fully written
    int64_t commits_sent = 0;        // commit frames fully written
    int64_t hosts_known = 0;         // workers' host strings held (for /v1/status)
    // Coordinator failover: whether this candidate leads (always true without etcd), how many
    // times it took over, and its fenced state writes (count, total and largest latency).
    bool leading = true;
    int64_t successions = 0;
    int64_t etcd_writes = 0;
    double etcd_write_ms_total = 0;
    double etcd_write_ms_max = 0;
    double io_cpu_seconds = 0;       // CPU time the io thread used so far
  };
  Stats stats() const;  // any thread

  class Impl;

 private:
  explicit Coordinator(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_COORDINATOR_H_
