// MPI errors as Status. Header-only so that base/ does not depend on MPI; only the MPI
// bootstrap uses it. Errors are returned only when the communicator's error handler is
// MPI_ERRORS_RETURN (the bootstrap sets it).
//
//   MORPH_MPI_RETURN_IF_ERROR(MPI_Bcast(buf, n, MPI_BYTE, 0, MPI_COMM_WORLD));
#ifndef MORPH_BASE_MPI_CHECK_H_
#define MORPH_BASE_MPI_CHECK_H_

// Only the C API: the deprecated C++ bindings need an extra library.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <string>

#include "base/check.h"

namespace morph {

// MPI_ERR_ARG / COUNT / TYPE / RANK / ROOT / BUFFER / COMM / TAG -> kInvalidArgument;
// MPI_ERR_NO_MEM -> kResourceExhausted; anything else (a peer process gone, MPI_ERR_OTHER,
// MPI_ERR_INTERN) -> kUnavailable, since the MPI job itself can no longer be trusted.
inline StatusCode MpiErrorToStatusCode(int code) {
  int cls = code;
  if (MPI_Error_class(code, &cls) != MPI_SUCCESS) cls = code;
  switch (cls) {
    case MPI_ERR_ARG:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_RANK:
    case MPI_ERR_ROOT:
    case MPI_ERR_BUFFER:
    case MPI_ERR_COMM:
    case MPI_ERR_TAG:
      return StatusCode::kInvalidArgument;
    case MPI_ERR_NO_MEM:
      return StatusCode::kResourceExhausted;
    default:
      return StatusCode::kUnavailable;
  }
}

inline Status MpiToStatus(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return Status();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  std::string msg;
  if (MPI_Error_string(code, text, &len) == MPI_SUCCESS) {
    msg.assign(text, static_cast<size_t>(len));
  } else {
    msg = "unknown MPI error";
  }
  return ApiError(MpiErrorToStatusCode(code), "MPI", call, code, msg, file, line);
}

}  // namespace morph

#define MORPH_MPI_RETURN_IF_ERROR(call) \
  MORPH_RETURN_IF_ERROR(::morph::MpiToStatus((call), #call, __FILE__, __LINE__))

#endif  // MORPH_BASE_MPI_CHECK_H_
