// The data plane of a worker: which backend builds the communicators a step hands out (world,
// dp, tp, pp: Options::backend) and which CUDA device a worker with NCCL uses. The change
// communicator stays on Gloo whatever the backend: it carries the reshard transport of host
// tensors (TCP or cross-memory attach), the scalar broadcast and the closing barrier, none of
// which NCCL can do on host buffers. With NCCL, morph-owned CUDA tensors move over NCCL instead
// (the switch's device path, SwitchOptions::device, set by Runtime::Impl::SetDevicePath); other
// CUDA state is staged through host memory (SwitchOptions::stage_old_in_host).
//
//   MORPH_ASSIGN_OR_RETURN(DataPlane dp, MakeDataPlane(opts, gloo_device));
//   GroupBuilder builder(dp.factory);   // world/dp/tp/pp on NCCL, "change" on Gloo
//
// Training thread (MakeDataPlane makes the chosen device current on the calling thread).
#ifndef MORPH_RUNTIME_API_DATA_PLANE_H_
#define MORPH_RUNTIME_API_DATA_PLANE_H_

#include <memory>
#include <string_view>

#include "morph/status.h"
#include "collectives/groups.h"
#include "morph/options.h"

namespace morph {

struct DataPlane {
  CommunicatorFactory factory;
  int cuda_device = -1;  // the NCCL communicators' device; -1 with Gloo
};

// True for the names of the communicators GroupBuilder builds for a step: "world", "dp/...",
// "tp/...", "pp/..." (collectives/groups.h). Other names ("change": reconfiguration) are not.
bool IsStepGroup(std::string_view name);

// A factory that builds the step groups (IsStepGroup) with `steps` and every other communicator
// with `control`.
CommunicatorFactory RouteStepGroups(CommunicatorFactory steps, CommunicatorFactory control);

// The device a worker uses: `requested` (>= 0) if the machine has it, else `local_rank` modulo
// `device_count` (0 when local_rank < 0). kFailedPrecondition "MORPH_CUDA_DEVICE=3: this
// machine has 2 CUDA devices" for a requested index out of range; kFailedPrecondition when
// device_count < 1.
StatusOr<int> ChooseCudaDevice(int requested, int local_rank, int device_count);

// Gloo: GlooFactory(gloo) for everything. Nccl: NcclFactory(device) for the step groups and
// GlooFactory(gloo) for the rest, with the device from ChooseCudaDevice made current on this
// thread. kFailedPrecondition "MORPH_BACKEND=nccl: morph was built without CUDA/NCCL" in a
// build without CUDA, "MORPH_BACKEND=nccl: no CUDA device found (<what CUDA said>)" on a
// machine without a usable GPU, ChooseCudaDevice's errors, cudaSetDevice's error. Training
// thread.
StatusOr<DataPlane> MakeDataPlane(const Options& options, std::shared_ptr<GlooDevice> gloo);

}  // namespace morph

#endif  // MORPH_RUNTIME_API_DATA_PLANE_H_
