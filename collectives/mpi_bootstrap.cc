#include "collectives/mpi_bootstrap.h"

#include <cstdlib>
#include <vector>

#include "base/mpi_check.h"

namespace morph {
namespace {

constexpr int kMaxBlob = 64 << 10;
bool g_we_initialized = false;  // main thread only, like MPI itself

}  // namespace

StatusOr<MpiBootstrap> MpiBootstrap::Share(
    const std::function<StatusOr<std::string>()>& make_blob) {
  int initialized = 0;
  MORPH_MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
  if (!initialized) {
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) {
      return UnavailableError("MPI_Init_thread failed with code " + std::to_string(rc));
    }
    g_we_initialized = true;
  }
  MORPH_MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  MpiBootstrap boot;
  MORPH_MPI_RETURN_IF_ERROR(MPI_Comm_rank(MPI_COMM_WORLD, &boot.rank));
  MORPH_MPI_RETURN_IF_ERROR(MPI_Comm_size(MPI_COMM_WORLD, &boot.size));
  if (const char* lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK"); lr != nullptr) {
    boot.local_rank = std::atoi(lr);
  }
  // Header: [ok flag, length], then the bytes (the blob, or rank 0's error message).
  int header[2] = {0, 0};
  std::string payload;
  if (boot.rank == 0) {
    StatusOr<std::string> blob = make_blob();
    if (blob.ok() && blob->size() > static_cast<size_t>(kMaxBlob)) {
      blob = InvalidArgumentError("bootstrap blob of " + std::to_string(blob->size()) +
                                  " bytes is larger than " + std::to_string(kMaxBlob));
    }
    header[0] = blob.ok() ? 1 : 0;
    payload = blob.ok() ? *blob : blob.status().ToString();
    payload.resize(std::min<size_t>(payload.size(), kMaxBlob));
    header[1] = static_cast<int>(payload.size());
  }
  MORPH_MPI_RETURN_IF_ERROR(MPI_Bcast(header, 2, MPI_INT, 0, MPI_COMM_WORLD))
      << "broadcasting the bootstrap blob's size";
  if (header[1] < 0 || header[1] > kMaxBlob) {
    return InternalError("bootstrap blob size " + std::to_string(header[1]));
  }
  payload.resize(static_cast<size_t>(header[1]));
  MORPH_MPI_RETURN_IF_ERROR(MPI_Bcast(payload.data(), header[1], MPI_CHAR, 0, MPI_COMM_WORLD))
      << "broadcasting the bootstrap blob";
  if (header[0] != 1) return UnavailableError("rank 0 could not bootstrap: " + payload);
  boot.blob = std::move(payload);
  return boot;
}

Status MpiBootstrap::Finalize() {
  if (!g_we_initialized) return Status::Ok();
  g_we_initialized = false;
  MORPH_MPI_RETURN_IF_ERROR(MPI_Finalize());
  return Status::Ok();
}

}  // namespace morph
