// Options: how a training process joins an elastic job (docs/design.md §3 and §4 "Start";
// docs/operations.md lists every variable). Read from the environment once, by FromEnv; fields
// set explicitly afterwards override it. Nothing in the runtime reads the environment later.
//
//   MORPH_ASSIGN_OR_RETURN(morph::Options opts, morph::Options::FromEnv());
//   opts.model = {.num_layers = 24, .tp_candidates = {1, 2, 4}, .global_batch = 512};
//   opts.dataset_samples = 1 << 20;
//   MORPH_ASSIGN_OR_RETURN(auto rt, morph::Runtime::Start(opts, [&](morph::State& s) {
//     return s.AddTensor("w", {1024, 1024}, morph::DType::kF32, morph::Layout::Layer(0));
//   }));
//
// Bootstrap, the first that applies:
//   1. `coordinator` (MORPH_COORDINATOR=host:port): join that job's coordinator;
//   2. mpirun (OMPI_COMM_WORLD_RANK/SIZE): rank 0 hosts the coordinator and hands its address to
//      every rank through MPI (nothing else uses MPI);
//   3. Slurm (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID): task 0 hosts the coordinator on the
//      first node of SLURM_STEP_NODELIST at `coordinator_port`; the others dial it;
//   4. otherwise this process hosts a coordinator for a job of `initial_world` workers (1 by
//      default: a single-process job that others may join through its address).
//
// Plain value; thread-compatible.
#ifndef MORPH_OPTIONS_H_
#define MORPH_OPTIONS_H_

#include "morph/api.h"

#include <cstdint>
#include <string>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "morph/status.h"
#include "morph/parallel_config.h"

namespace morph {

// The config planner's inputs that come from the model (ModelConstraints without its
// callbacks): registered by every worker, equal on all of them.
struct MORPH_API ModelShape {
  int num_layers = 1;
  int num_heads = 0;
  std::vector<int> tp_candidates = {1};
  std::vector<int> pp_candidates = {1};
  int64_t global_batch = 1;
  int micro_batches = 1;
  int zero_stage = 0;
  // Per-rank memory available for registered state (0: unlimited). A config fits when every
  // rank's registered shards fit.
  int64_t device_memory_bytes = 0;
  friend bool operator==(const ModelShape&, const ModelShape&) = default;
};

// What the config planner knows of the model (docs/design.md §5): the constraints a
// configuration must meet and, optionally, a per-rank memory estimate.
struct MORPH_API ModelConstraints {
  int num_layers = 1;  // pipeline stages split these (pp <= num_layers)
  int num_heads = 0;   // tp must divide it when > 0
  std::vector<int> tp_candidates = {1};
  std::vector<int> pp_candidates = {1};
  int64_t global_batch = 1;  // dp <= global_batch (every DP rank gets a sample)
  int micro_batches = 1;     // per pipeline, for the bubble estimate and the config
  int zero_stage = 0;
  // dp must be a multiple of this (the least common multiple of the hybrid ZeRO group sizes:
  // a group size must divide dp). Workers beyond the largest such dp are spares.
  int dp_multiple = 1;
  // Estimated bytes one rank needs under a config; with device_memory_bytes > 0 a config fits
  // only if the estimate is at most that. Unset: memory always fits.
  std::function<int64_t(const ParallelConfig&)> memory_per_rank;
  int64_t device_memory_bytes = 0;
};

// A user policy: return a config to use it, nullopt to let the default policy decide.
using ConfigPolicy = std::function<std::optional<ParallelConfig>(
    int workers, const ParallelConfig* current, const ModelConstraints& model)>;

// kEtcd: coordinator candidates hosted by workers (Options::etcd_candidates): find the leader
// through etcd, hosting a candidate when among the first; kAuto picks it when etcd is set and
// no coordinator is given.
enum class Bootstrap { kAuto, kJoin, kMpi, kSlurm, kHost, kEtcd };

// Backend of the communicators a step hands out (world, dp, tp, pp; docs/operations.md
// "Backends"). kNccl needs a CUDA build and a GPU; the buffers passed to those communicators are
// then CUDA device memory. Reconfiguration traffic (the reshard transport, scalars, the closing
// barrier) goes over Gloo with either.
enum class Backend { kGloo, kNccl };
// "gloo" / "nccl".
MORPH_API const char* BackendName(Backend b);
// kInvalidArgument naming `what` (e.g. "MORPH_BACKEND") for anything but "gloo" or "nccl".
MORPH_API StatusOr<Backend> ParseBackend(std::string_view what, std::string_view text);

struct MORPH_API Options {
  // --- the model and its data (equal on every worker; checked at registration) ---
  ModelShape model;
  int64_t dataset_samples = 1;  // N of the dataset cursor
  uint64_t dataset_seed = 0;
  bool dataset_shuffle = true;
  // Samples per micro-batch on one DP rank; gradient accumulation (micro-batches per step)
  // follows from the global batch and dp.
  int64_t micro_batch = 1;

  // --- how to find the job ---
  Bootstrap bootstrap = Bootstrap::kAuto;
  std::string coordinator;  // MORPH_COORDINATOR
  // Port the hosting process's coordinator listens on (0: any; under Slurm a fixed one is
  // needed so that other tasks can dial it: MORPH_COORDINATOR_PORT, default 29400 there).
  uint16_t coordinator_port = 0;
  // Address the hosted coordinator binds (MORPH_COORDINATOR_ADDR): loopback unless told;
  // multi-host jobs set 0.0.0.0.
  std::string coordinator_bind = "127.0.0.1";
  int initial_world = 1;  // workers before generation 1 (MORPH_INITIAL_WORLD; mpirun/Slurm size)
  int max_world = 1 << 16;
  std::string token;  // MORPH_TOKEN / MORPH_TOKEN_FILE; generated when this process hosts
  // When this process hosts the coordinator (bootstrap 2-4): a file it writes "host:port\ntoken\n" to (mode
  // 0600, replaced atomically) for joiners started outside the launcher (MORPH_COORDINATOR_FILE).
  std::string coordinator_file;
  // Coordinator failover (MORPH_ETCD, docs/operations.md "Coordinator failover"): etcd's
  // endpoints "host:port,..."; set, this worker reconnects to the successor when its
  // coordinator dies (the leader named under etcd_prefix), for up to etcd_rejoin_ms, and trains
  // on meanwhile. Empty: the coordinator's death ends the worker, as before.
  std::string etcd;
  std::string etcd_prefix = "/morph/job";  // MORPH_ETCD_PREFIX
  int64_t etcd_rejoin_ms = 10000;          // MORPH_ETCD_REJOIN_MS
  int64_t etcd_ttl_s = 2;                  // MORPH_ETCD_TTL_S: a hosted candidate's lease
  // With etcd set and no coordinator given (bootstrap kAuto), the first etcd_candidates workers
  // of the launch (launch_index under morphrun, else launcher_rank) each host a coordinator
  // candidate that campaigns on etcd, and every worker finds the leader through etcd's
  // <etcd_prefix>/leader key (MORPH_ETCD_CANDIDATES; 0: no worker hosts one).
  int etcd_candidates = 3;
  int launch_index = -1;  // morphrun's MORPH_LAUNCH_INDEX; -1 when not launched by morphrun
  // The config planner's user callback (docs/design.md §5) for the coordinator this process
  // hosts (mpirun rank 0, Slurm task 0, a lone worker): asked first at every change; nullopt
  // from it falls back to the default policy. Workers that join a coordinator ignore it
  // (morphd and morphrun take theirs in CoordinatorOptions::policy). Not from the environment.
  ConfigPolicy config_policy;
  std::string host;   // this worker's host name (default: gethostname)
  // What the launcher says (FromEnv: OMPI_COMM_WORLD_RANK/SIZE, SLURM_PROCID/NTASKS and
  // SLURM_STEP_NODELIST); -1 / empty when not launched that way.
  int launcher_rank = -1;
  int launcher_size = -1;
  std::string slurm_nodelist;
  // Address Gloo listens on for this worker's data plane (MORPH_GLOO_HOSTNAME; default
  // 127.0.0.1, or the host name under Slurm).
  std::string data_hostname;
  std::string data_iface;  // MORPH_GLOO_IFACE: an interface instead of data_hostname
  // The step communicators' backend (MORPH_BACKEND) and, with kNccl, this worker's CUDA device
  // (MORPH_CUDA_DEVICE; -1: launcher_local_rank modulo the devices, 0 without one). Start makes
  // that device current on the calling thread (cudaSetDevice) before it allocates CUDA shards.
  Backend backend = Backend::kGloo;
  int cuda_device = -1;
  // This process's index on its host as the launcher says (FromEnv: OMPI_COMM_WORLD_LOCAL_RANK,
  // SLURM_LOCALID, morphrun's MORPH_LAUNCH_INDEX); -1 when none says.
  int launcher_local_rank = -1;
  // The hosted coordinator's scheduler API (MORPH_API_ADDR, MORPH_API_PORT,
  // MORPH_API_TOKEN_FOR_READS).
  std::string api_address = "127.0.0.1";
  uint16_t api_port = 0;
  bool api_token_for_reads = false;
  // The hosted coordinator's limits: how often it looks at its same-host workers' processes
  // (MORPH_LOCAL_WATCH_MS; 0: never) and how many connections may wait to authenticate
  // (MORPH_COORDINATOR_MAX_UNAUTHENTICATED; also at most an eighth of RLIMIT_NOFILE).
  int64_t coordinator_local_watch_ms = 10;
  int64_t coordinator_max_unauthenticated = 1024;
  // Slurm's count of this job's requeues (SLURM_RESTART_COUNT; 0 for a first run): with
  // resume "auto" a restart resumes from the newest checkpoint.
  int64_t restart_count = 0;

  // --- timing ---
  int64_t heartbeat_ms = 1000;           // MORPH_HEARTBEAT_MS
  // MORPH_HEARTBEAT_TIMEOUT_MS: a worker silent this long is lost (hosted coordinator), and a
  // coordinator host that acknowledges none of this worker's heartbeats this long is gone
  // (the connection is closed: BeginStep returns kUnavailable). 0: never / TCP's own limit.
  int64_t heartbeat_timeout_ms = 10000;
  int64_t start_timeout_ms = 300000;     // MORPH_START_TIMEOUT_MS: Start's whole wait
  int64_t change_timeout_ms = 300000;    // MORPH_CHANGE_TIMEOUT_MS: one reconfiguration
  int64_t leave_deadline_ms = 30000;     // MORPH_LEAVE_DEADLINE_MS: SIGTERM -> state moved away
  bool handle_sigterm = true;            // MORPH_HANDLE_SIGTERM: SIGTERM = preemption notice

  // --- reshard (equal on all workers) ---
  uint64_t chunk_bytes = uint64_t{4} << 20;      // MORPH_RESHARD_CHUNK_BYTES
  uint64_t staging_bytes = uint64_t{256} << 20;  // MORPH_RESHARD_STAGING_BYTES
  uint64_t batch_bytes = uint64_t{64} << 20;     // MORPH_RESHARD_BATCH_BYTES
  bool shared_memory = true;                     // MORPH_RESHARD_SHM
  // Host shards of tensors morph allocates (AddTensor, host memory) come from a shared-memory
  // arena (memfd mappings) so that a same-host peer copies them with memcpy from a mapping
  // instead of process_vm_readv during a reshard (MORPH_HOST_ARENA). Adopted tensors keep their
  // allocator's storage. Only with shared_memory. Off by default: memfd pages cost more to
  // fault in and to free than anonymous ones, and such shards can neither grow in place nor be
  // recycled (runtime/switch/switch.h), so the switch took longer (docs/performance.md).
  bool host_arena = false;
  // Keep every old shard until the switch's closing barrier (MORPH_RESHARD_KEEP_OLD): a switch
  // cut short by a failure then leaves the old state whole, so the recovery can use it. Costs
  // the old state's bytes during a switch (peak old + new).
  bool keep_old_until_barrier = false;
  // Copy this rank's shards and scalars at every BeginUpdate (MORPH_UNDO_COPY; host storage
  // only). A failure can stop the ranks on either side of a step's update: one whose commit
  // vote completed applied it while one that missed a dying peer's vote did not. With this
  // copy the first can go back a step, so a recovery finds every piece at one step; a state
  // torn by a failure during the update is replaced by the copy too. Costs one more copy of the
  // state in memory and one memcpy of it per step.
  bool undo_copy = false;

  // --- failures (docs/design.md §4 "Failure"; equal on all workers) ---
  // Periodic asynchronous checkpoints in the layout-free format (reshard/checkpoint.h), the
  // last resort when every replica of a piece is lost: MORPH_CHECKPOINT_DIR (empty: none),
  // every MORPH_CHECKPOINT_EVERY steps (at the step's start), keeping this job's newest
  // MORPH_CHECKPOINT_KEEP complete ones (an earlier run's folders there are never deleted:
  // docs/operations.md "Checkpoint retention").
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int checkpoint_keep = 2;
  // MORPH_CHECKPOINT_MAX_BYTES_PER_S: the most bytes per second one rank's save writes (0: no
  // limit), so that saves leave a shared disk or file system to training and other jobs.
  uint64_t checkpoint_max_bytes_per_second = 0;

  // Resume at start, for the coordinator this worker hosts (mpirun rank 0, Slurm task 0, a
  // lone worker): MORPH_RESUME "auto" (on a restart, SLURM_RESTART_COUNT > 0), "always" or
  // "never" — whether the job's first generation starts from the newest complete checkpoint in
  // checkpoint_dir whose data verifies (docs/operations.md "Whole-job preemption and requeue").
  // Then fresh_start() is false.
  std::string resume = "auto";
  // In-memory buddy snapshots (Gemini): every MORPH_SNAPSHOT_EVERY steps (0: off) each rank
  // copies its state into host memory and sends the copy to its buddy, a rank on another host
  // when there is one. Costs two copies of the rank's state in host memory.
  int64_t snapshot_every = 0;

  // Reads every variable above once. kInvalidArgument naming the variable for a value that
  // does not parse; kNotFound / kPermissionDenied for an unreadable MORPH_TOKEN_FILE.
  static StatusOr<Options> FromEnv();
  // kInvalidArgument naming the field: micro_batch < 1, initial_world < 1 or > max_world,
  // heartbeat_ms < 1, a timeout < 1, cuda_device < -1, ValidateManifest's errors for the model.
  Status Validate() const;
};

}  // namespace morph

#endif  // MORPH_OPTIONS_H_
