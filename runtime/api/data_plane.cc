#include "runtime/api/data_plane.h"

#include <glog/logging.h>

#include <string>

#include "collectives/gloo/gloo_communicator.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>

#include "collectives/nccl/nccl_communicator.h"
#endif

namespace morph {

bool IsStepGroup(std::string_view name) {
  return name == "world" || name.starts_with("dp/") || name.starts_with("tp/") ||
         name.starts_with("pp/");
}

CommunicatorFactory RouteStepGroups(CommunicatorFactory steps, CommunicatorFactory control) {
  return [steps = std::move(steps), control = std::move(control)](
             Store& store, std::string_view name, int rank, int size,
             Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    return IsStepGroup(name) ? steps(store, name, rank, size, deadline)
                             : control(store, name, rank, size, deadline);
  };
}

StatusOr<int> ChooseCudaDevice(int requested, int local_rank, int device_count) {
  if (device_count < 1) return FailedPreconditionError("no CUDA device");
  if (requested >= 0) {
    if (requested >= device_count) {
      return FailedPreconditionError("MORPH_CUDA_DEVICE=" + std::to_string(requested) +
                                     ": this machine has " + std::to_string(device_count) +
                                     " CUDA device" + (device_count == 1 ? "" : "s"));
    }
    return requested;
  }
  return local_rank < 0 ? 0 : local_rank % device_count;
}

StatusOr<DataPlane> MakeDataPlane(const Options& options, std::shared_ptr<GlooDevice> gloo) {
  DataPlane out;
  CommunicatorFactory control = GlooFactory(std::move(gloo));
  if (options.backend == Backend::kGloo) {
    out.factory = std::move(control);
    return out;
  }
#if MORPH_WITH_CUDA
  std::string why;
  if (!CudaDeviceAvailable(&why)) {
    return FailedPreconditionError("MORPH_BACKEND=nccl: no CUDA device found (" + why + ")");
  }
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return FailedPreconditionError(std::string("MORPH_BACKEND=nccl: no CUDA device found (") +
                                   cudaGetErrorString(e) + ")");
  }
  MORPH_ASSIGN_OR_RETURN(out.cuda_device,
                         ChooseCudaDevice(options.cuda_device, options.launcher_local_rank, count),
                         "MORPH_BACKEND=nccl");
  if (cudaError_t e = cudaSetDevice(out.cuda_device); e != cudaSuccess) {
    return FailedPreconditionError("MORPH_BACKEND=nccl: cudaSetDevice(" +
                                   std::to_string(out.cuda_device) + "): " + cudaGetErrorString(e));
  }
  LOG(INFO) << "data plane: NCCL on CUDA device " << out.cuda_device << " of " << count
            << " (reconfiguration traffic over Gloo)";
  out.factory = RouteStepGroups(NcclFactory(out.cuda_device), std::move(control));
  return out;
#else
  return FailedPreconditionError(
      "MORPH_BACKEND=nccl: morph was built without CUDA/NCCL (configure with the CUDA toolkit "
      "and NCCL present, MORPH_WITH_CUDA=ON)");
#endif
}

}  // namespace morph
