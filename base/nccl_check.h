// NCCL errors as Status. Header-only so that base/ does not depend on NCCL.
//
//   MORPH_NCCL_RETURN_IF_ERROR(ncclAllReduce(...)) << "allreduce of " << n << " floats";
#ifndef MORPH_BASE_NCCL_CHECK_H_
#define MORPH_BASE_NCCL_CHECK_H_

#include <nccl.h>

#include <string>

#include "base/check.h"

namespace morph {

// ncclSystemError / ncclRemoteError (a peer or the network failed) -> kUnavailable;
// ncclInvalidArgument / ncclInvalidUsage -> kInvalidArgument; ncclInProgress is not an error
// for non-blocking communicators and is reported as kUnavailable only if passed here;
// others -> kInternal.
inline StatusCode NcclResultToStatusCode(ncclResult_t r) {
  switch (r) {
    case ncclSystemError:
    case ncclRemoteError:
    case ncclInProgress:
      return StatusCode::kUnavailable;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return StatusCode::kInvalidArgument;
    default:
      return StatusCode::kInternal;
  }
}

// `comm` may be null; when given, NCCL's last error text for it is appended.
inline Status NcclToStatus(ncclResult_t r, const char* call, const char* file, int line,
                           ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return Status();
  std::string msg = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') {
    msg += " (";
    msg += last;
    msg += ")";
  }
  return ApiError(NcclResultToStatusCode(r), "NCCL", call, static_cast<long long>(r), msg, file,
                  line);
}

}  // namespace morph

#define MORPH_NCCL_RETURN_IF_ERROR(call) \
  MORPH_RETURN_IF_ERROR(::morph::NcclToStatus((call), #call, __FILE__, __LINE__))

#endif  // MORPH_BASE_NCCL_CHECK_H_
