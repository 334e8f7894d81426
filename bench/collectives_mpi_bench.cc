// Gloo communicator vs Open MPI on the same ranks, sizes and run: allreduce (f32 sum) and
// point-to-point bandwidth. Launch under mpirun; rank 0 prints one JSON object per case:
//   mpirun --allow-run-as-root --oversubscribe -np 4 build/bench/collectives_mpi_bench
// ratio_vs_mpi = gloo seconds / MPI seconds (lower is better; 1.0 = parity).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "base/mpi_check.h"  // <mpi.h> without the C++ bindings
#include "collectives/gloo_communicator.h"
#include "collectives/mpi_bootstrap.h"
#include "collectives/tcp_store.h"

namespace morph {
namespace {

constexpr char kToken[] = "bench-token";
constexpr auto kTimeout = std::chrono::seconds(120);

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median of `reps` timings of fn(), each preceded by an MPI barrier.
template <typename Fn>
double Time(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = Now();
    fn();
    double local = Now() - t0, slowest = 0;
    MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t.push_back(slowest);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Status Run() {
  std::unique_ptr<TcpStoreServer> server;
  MORPH_ASSIGN_OR_RETURN(MpiBootstrap boot, MpiBootstrap::Share([&]() -> StatusOr<std::string> {
                           MORPH_ASSIGN_OR_RETURN(server,
                                                  TcpStoreServer::Start("127.0.0.1", 0, kToken));
                           return server->address();
                         }));
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(boot.blob, kToken, 0, Deadline::AfterMs(30000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "bench", boot.rank, boot.size,
                                                             nullptr, Deadline::AfterMs(30000)));
  const int rank = boot.rank, world = boot.size;
  for (size_t bytes : {size_t{64} << 10, size_t{4} << 20, size_t{64} << 20}) {
    const size_t n = bytes / sizeof(float);
    std::vector<float> buf(n, 1.0f);
    const int reps = bytes >= (size_t{64} << 20) ? 3 : 10;
    Status st;
    double gloo = Time(reps, [&] {
      Status s = comm->Allreduce(buf.data(), n, DataType::kF32, ReduceOp::kSum, kTimeout);
      if (st.ok()) st = s;
    });
    MORPH_RETURN_IF_ERROR(st) << "gloo allreduce";
    double mpi = Time(reps, [&] {
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    });
    if (rank == 0) {
      std::printf(
          "{\"name\":\"allreduce_f32_sum\",\"ranks\":%d,\"bytes\":%zu,\"seconds\":%.6f,"
          "\"mpi_seconds\":%.6f,\"ratio_vs_mpi\":%.3f,\"gloo_algbw_GBps\":%.3f,"
          "\"mpi_algbw_GBps\":%.3f}\n",
          world, bytes, gloo, mpi, gloo / mpi, bytes / gloo / 1e9, bytes / mpi / 1e9);
    }
    // Point to point: rank 0 -> rank 1, the others idle.
    std::vector<uint8_t> p2p(bytes, 7);
    double gloo_p2p = Time(reps, [&] {
      Status s;
      if (rank == 0) s = comm->SendRecv({{P2POp::Kind::kSend, 1, p2p.data(), bytes}}, kTimeout);
      if (rank == 1) s = comm->SendRecv({{P2POp::Kind::kRecv, 0, p2p.data(), bytes}}, kTimeout);
      if (st.ok()) st = s;
    });
    MORPH_RETURN_IF_ERROR(st) << "gloo send/recv";
    double mpi_p2p = Time(reps, [&] {
      if (rank == 0) MPI_Send(p2p.data(), static_cast<int>(bytes), MPI_BYTE, 1, 0, MPI_COMM_WORLD);
      if (rank == 1) {
        MPI_Recv(p2p.data(), static_cast<int>(bytes), MPI_BYTE, 0, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
      }
    });
    if (rank == 0) {
      std::printf(
          "{\"name\":\"send_recv\",\"ranks\":%d,\"bytes\":%zu,\"seconds\":%.6f,"
          "\"mpi_seconds\":%.6f,\"ratio_vs_mpi\":%.3f,\"gloo_GBps\":%.3f,\"mpi_GBps\":%.3f}\n",
          world, bytes, gloo_p2p, mpi_p2p, gloo_p2p / mpi_p2p, bytes / gloo_p2p / 1e9,
          bytes / mpi_p2p / 1e9);
      std::fflush(stdout);
    }
  }
  comm.reset();
  MPI_Barrier(MPI_COMM_WORLD);
  store.reset();
  return MpiBootstrap::Finalize();
}

}  // namespace
}  // namespace morph

int main() {
  morph::Status s = morph::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "collectives_mpi_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
