#include "morph/options.h"

#include "runtime/ha/election.h"

#include <unistd.h>

#include <climits>
#include <cstdlib>

#include "base/params.h"
#include "collectives/store/tcp_store.h"
#include "runtime/ha/election.h"
#include "runtime/coordinator/coordinator.h"

namespace morph {

const char* BackendName(Backend b) { return b == Backend::kNccl ? "nccl" : "gloo"; }

StatusOr<Backend> ParseBackend(std::string_view what, std::string_view text) {
  if (text == "gloo") return Backend::kGloo;
  if (text == "nccl") return Backend::kNccl;
  return InvalidArgumentError(std::string(what) + "=" + std::string(text) +
                              ": not a backend (gloo or nccl)");
}

StatusOr<Options> Options::FromEnv() {
  Options o;
  MORPH_ASSIGN_OR_RETURN(o.coordinator, params::Coordinator());
  MORPH_ASSIGN_OR_RETURN(int64_t port, params::CoordinatorPort());
  o.coordinator_port = static_cast<uint16_t>(port);
  MORPH_ASSIGN_OR_RETURN(o.coordinator_bind, params::CoordinatorAddr());
  MORPH_ASSIGN_OR_RETURN(int64_t initial, params::InitialWorld());
  o.initial_world = static_cast<int>(initial);
  MORPH_ASSIGN_OR_RETURN(int64_t max_world, params::MaxWorld());
  o.max_world = static_cast<int>(max_world);
  MORPH_ASSIGN_OR_RETURN(o.heartbeat_ms, params::HeartbeatMs());
  MORPH_ASSIGN_OR_RETURN(o.heartbeat_timeout_ms, params::HeartbeatTimeoutMs());
  MORPH_ASSIGN_OR_RETURN(o.start_timeout_ms, params::StartTimeoutMs());
  MORPH_ASSIGN_OR_RETURN(o.change_timeout_ms, params::ChangeTimeoutMs());
  MORPH_ASSIGN_OR_RETURN(o.leave_deadline_ms, params::LeaveDeadlineMs());
  MORPH_ASSIGN_OR_RETURN(o.handle_sigterm, params::HandleSigterm());
  MORPH_ASSIGN_OR_RETURN(o.chunk_bytes, params::ReshardChunkBytes());
  MORPH_ASSIGN_OR_RETURN(o.staging_bytes, params::ReshardStagingBytes());
  MORPH_ASSIGN_OR_RETURN(o.batch_bytes, params::ReshardBatchBytes());
  MORPH_ASSIGN_OR_RETURN(o.shared_memory, params::ReshardShm());
  MORPH_ASSIGN_OR_RETURN(o.host_arena, params::HostArena());
  MORPH_ASSIGN_OR_RETURN(o.keep_old_until_barrier, params::ReshardKeepOld());
  MORPH_ASSIGN_OR_RETURN(o.undo_copy, params::UndoCopy());
  MORPH_ASSIGN_OR_RETURN(o.checkpoint_dir, params::CheckpointDir());
  MORPH_ASSIGN_OR_RETURN(o.checkpoint_every, params::CheckpointEvery());
  MORPH_ASSIGN_OR_RETURN(int64_t keep, params::CheckpointKeep());
  o.checkpoint_keep = static_cast<int>(keep);
  MORPH_ASSIGN_OR_RETURN(o.checkpoint_max_bytes_per_second, params::CheckpointMaxBytesPerS());

  MORPH_ASSIGN_OR_RETURN(o.resume, params::Resume());
  MORPH_ASSIGN_OR_RETURN(o.snapshot_every, params::SnapshotEvery());
  MORPH_ASSIGN_OR_RETURN(std::string token, params::Token());
  MORPH_ASSIGN_OR_RETURN(std::string token_file, params::TokenFile());
  if (!token.empty() || !token_file.empty()) {
    MORPH_ASSIGN_OR_RETURN(o.token, JobTokenFromEnv());
  }
  MORPH_ASSIGN_OR_RETURN(o.coordinator_file, params::CoordinatorFile());
  MORPH_ASSIGN_OR_RETURN(o.etcd, params::Etcd());
  MORPH_ASSIGN_OR_RETURN(o.etcd_prefix, params::EtcdPrefix());
  MORPH_ASSIGN_OR_RETURN(o.etcd_rejoin_ms, params::EtcdRejoinMs());
  MORPH_ASSIGN_OR_RETURN(o.etcd_ttl_s, params::EtcdTtlS());
  MORPH_ASSIGN_OR_RETURN(int64_t candidates, params::EtcdCandidates());
  o.etcd_candidates = static_cast<int>(candidates);
  MORPH_ASSIGN_OR_RETURN(int64_t launch_index, params::LaunchIndex());
  o.launch_index = static_cast<int>(launch_index);
  MORPH_ASSIGN_OR_RETURN(o.data_hostname, params::GlooHostname());
  MORPH_ASSIGN_OR_RETURN(o.data_iface, params::GlooIface());
  MORPH_ASSIGN_OR_RETURN(std::string backend, params::Backend());
  MORPH_ASSIGN_OR_RETURN(o.backend, ParseBackend("MORPH_BACKEND", backend));
  MORPH_ASSIGN_OR_RETURN(int64_t cuda_device, params::CudaDevice());
  o.cuda_device = static_cast<int>(cuda_device);
  MORPH_ASSIGN_OR_RETURN(o.api_address, params::ApiAddr());
  MORPH_ASSIGN_OR_RETURN(int64_t api_port, params::ApiPort());
  o.api_port = static_cast<uint16_t>(api_port);
  MORPH_ASSIGN_OR_RETURN(o.api_token_for_reads, params::ApiTokenForReads());
  MORPH_ASSIGN_OR_RETURN(o.coordinator_local_watch_ms, params::LocalWatchMs());
  MORPH_ASSIGN_OR_RETURN(o.coordinator_max_unauthenticated,
                         params::CoordinatorMaxUnauthenticated());
  MORPH_ASSIGN_OR_RETURN(o.restart_count, ParseRestartCount(std::getenv("SLURM_RESTART_COUNT")));
  // The launcher's view (read here, once: nothing later reads the environment).
  auto env_int = [](const char* name) -> StatusOr<int> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == 0) return -1;
    MORPH_ASSIGN_OR_RETURN(int64_t n, params::ParseInt64(name, v, 0, INT32_MAX));
    return static_cast<int>(n);
  };
  MORPH_ASSIGN_OR_RETURN(int ompi_size, env_int("OMPI_COMM_WORLD_SIZE"));
  MORPH_ASSIGN_OR_RETURN(int slurm_size, env_int("SLURM_NTASKS"));
  if (ompi_size > 0) {
    o.launcher_size = ompi_size;
    MORPH_ASSIGN_OR_RETURN(o.launcher_rank, env_int("OMPI_COMM_WORLD_RANK"));
  } else if (slurm_size > 0 && std::getenv("SLURM_PROCID") != nullptr) {
    o.launcher_size = slurm_size;
    MORPH_ASSIGN_OR_RETURN(o.launcher_rank, env_int("SLURM_PROCID"));
    const char* nodes = std::getenv("SLURM_STEP_NODELIST");
    if (nodes == nullptr) nodes = std::getenv("SLURM_JOB_NODELIST");
    o.slurm_nodelist = nodes ? nodes : "";
    if (o.slurm_nodelist.empty()) {
      return InvalidArgumentError("SLURM_PROCID is set but SLURM_STEP_NODELIST is not");
    }
  }
  // Not under morphrun --slurm, whose workers are each the one task of a step of their own:
  // morphrun says the job's initial world (MORPH_INITIAL_WORLD) to the candidates it starts.
  if (o.launcher_size > 0 && o.launch_index < 0) o.initial_world = o.launcher_size;
  // The local rank, for the CUDA device: mpirun's, Slurm's, else morphrun's launch index.
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MORPH_LAUNCH_INDEX"}) {
    MORPH_ASSIGN_OR_RETURN(int local, env_int(name));
    if (local >= 0) {
      o.launcher_local_rank = local;
      break;
    }
  }
  char host[HOST_NAME_MAX + 1] = {};
  if (gethostname(host, sizeof(host)) == 0) o.host = host;
  return o;
}

Status Options::Validate() const {
  if (micro_batch < 1) {
    return InvalidArgumentError("micro_batch: must be at least 1, got " +
                                std::to_string(micro_batch));
  }
  if (max_world < 1) return InvalidArgumentError("max_world: must be at least 1");
  if (initial_world < 1 || initial_world > max_world) {
    return InvalidArgumentError("initial_world: " + std::to_string(initial_world) +
                                " is outside [1, max_world=" + std::to_string(max_world) + "]");
  }
  if (heartbeat_ms < 1) return InvalidArgumentError("heartbeat_ms: must be at least 1");
  if (!etcd.empty()) {
    MORPH_RETURN_IF_ERROR(ValidateJobPrefix(etcd_prefix, "etcd_prefix"));
  }
  if (etcd_ttl_s < 1 || etcd_candidates < 0) {
    return InvalidArgumentError("etcd_ttl_s / etcd_candidates: must be >= 1 / >= 0, got " +
                                std::to_string(etcd_ttl_s) + " / " +
                                std::to_string(etcd_candidates));
  }
  if (coordinator_local_watch_ms < 0 || coordinator_max_unauthenticated < 1 || restart_count < 0) {
    return InvalidArgumentError(
        "coordinator_local_watch_ms / coordinator_max_unauthenticated / restart_count: must be "
        ">= 0 / >= 1 / >= 0, got " + std::to_string(coordinator_local_watch_ms) + " / " +
        std::to_string(coordinator_max_unauthenticated) + " / " + std::to_string(restart_count));
  }
  for (auto [name, v] : {std::pair{"heartbeat_timeout_ms", heartbeat_timeout_ms},
                         std::pair{"start_timeout_ms", start_timeout_ms},
                         std::pair{"change_timeout_ms", change_timeout_ms},
                         std::pair{"leave_deadline_ms", leave_deadline_ms}}) {
    if (v < 1) return InvalidArgumentError(std::string(name) + ": must be at least 1 ms");
  }
  if (checkpoint_every < 0 || snapshot_every < 0 || checkpoint_keep < 1) {
    return InvalidArgumentError("checkpoint_every / snapshot_every: must be >= 0, "
                                "checkpoint_keep >= 1");
  }
  if (checkpoint_every > 0 && checkpoint_dir.empty()) {
    return InvalidArgumentError("checkpoint_every: set without checkpoint_dir "
                                "(MORPH_CHECKPOINT_DIR)");
  }
  if (cuda_device < -1) {
    return InvalidArgumentError("cuda_device: must be -1 (the local rank) or a device index, got " +
                                std::to_string(cuda_device));
  }

  MORPH_RETURN_IF_ERROR(ParseResumeMode(resume, "resume").status());
  if (dataset_samples < 1) {
    return InvalidArgumentError("dataset_samples: must be at least 1, got " +
                                std::to_string(dataset_samples));
  }
  if (model.global_batch < 1) {
    return InvalidArgumentError("model.global_batch: must be at least 1, got " +
                                std::to_string(model.global_batch));
  }
  return Status();
}

}  // namespace morph
