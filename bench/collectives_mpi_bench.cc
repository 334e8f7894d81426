// Gloo communicator vs Open MPI on the same ranks, sizes and run: allreduce (f32 sum; bf16
// against MPI's f32 of the same count), reduce-scatter and point to point, from 8 B (latency)
// to 64 MiB (bandwidth). Launch under mpirun; rank 0 prints one JSON object per case:
//   mpirun --allow-run-as-root --oversubscribe -np 4 build/bench/collectives_mpi_bench [max_bytes]
// ratio_vs_mpi = gloo seconds / MPI seconds (lower is better; 1.0 = parity). Up to 64 KiB the
// default communicator takes the same-host shared-memory path (MORPH_GLOO_SHM); a second one
// built with shared_memory = false times the TCP path in the same run: tcp_seconds and
// tcp_ratio_vs_mpi. Broadcast, allgather and barrier run at the small sizes only.
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

// Seconds per call of fn(): median over `reps` timings of `iters` back-to-back calls, each
// timing started after an MPI barrier and taken on the slowest rank. Back-to-back calls keep
// Open MPI's busy-polling (in the barrier and the timing allreduce) from competing for the
// cores with the Gloo threads of a rank that is still working.
template <typename Fn>
double Time(int reps, int iters, Fn&& fn) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = Now();
    for (int k = 0; k < iters; ++k) fn();
    double local = (Now() - t0) / iters, slowest = 0;
    MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t.push_back(slowest);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// `tcp` < 0: not measured.
void Print(const char* name, int world, size_t bytes, double gloo, double mpi, double tcp = -1) {
  char extra[128] = "";
  if (tcp >= 0) {
    std::snprintf(extra, sizeof(extra), ",\"tcp_seconds\":%.6f,\"tcp_ratio_vs_mpi\":%.3f", tcp,
                  tcp / mpi);
  }
  std::printf(
      "{\"name\":\"%s\",\"ranks\":%d,\"bytes\":%zu,\"seconds\":%.6f,"
      "\"mpi_seconds\":%.6f,\"ratio_vs_mpi\":%.3f,\"gloo_algbw_GBps\":%.3f,"
      "\"mpi_algbw_GBps\":%.3f%s}\n",
      name, world, bytes, gloo, mpi, gloo / mpi, bytes / gloo / 1e9, bytes / mpi / 1e9, extra);
  std::fflush(stdout);
}

Status Run(size_t max_bytes) {
  std::unique_ptr<TcpStoreServer> server;
  MORPH_ASSIGN_OR_RETURN(MpiBootstrap boot, MpiBootstrap::Share([&]() -> StatusOr<std::string> {
                           MORPH_ASSIGN_OR_RETURN(server,
                                                  TcpStoreServer::Start("127.0.0.1", 0, kToken));
                           return server->address();
                         }));
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(boot.blob, kToken, 0, Deadline::AfterMs(30000)));
  MORPH_ASSIGN_OR_RETURN(GlooOptions gloo_options, GlooOptions::FromEnv());
  MORPH_ASSIGN_OR_RETURN(auto device, GlooDevice::Create(gloo_options));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "bench", boot.rank, boot.size,
                                                             device, Deadline::AfterMs(30000)));
  GlooOptions tcp_options = gloo_options;
  tcp_options.shared_memory = false;
  MORPH_ASSIGN_OR_RETURN(auto tcp_device, GlooDevice::Create(tcp_options));
  MORPH_ASSIGN_OR_RETURN(auto tcp_comm,
                         GlooCommunicator::Create(*store, "bench-tcp", boot.rank, boot.size,
                                                  tcp_device, Deadline::AfterMs(30000)));
  const int rank = boot.rank, world = boot.size;
  constexpr size_t kSmall = size_t{64} << 10;  // the shared-memory path's limit
  // Small messages (the runtime's per-step votes, loss reductions) and large ones (gradients).
  for (size_t bytes :
       {size_t{8}, size_t{4} << 10, size_t{64} << 10, size_t{4} << 20, size_t{64} << 20}) {
    if (bytes > max_bytes) break;
    const size_t n = bytes / sizeof(float);
    const int reps = bytes >= (size_t{64} << 20) ? 3 : 7;
    const int iters = bytes <= (size_t{64} << 10) ? 50 : 1;
    std::vector<float> buf(n, 1.0f);
    Status st;
    auto keep = [&](const Status& s) {
      if (st.ok()) st = s;
    };
    // The same calls on the TCP-only communicator, at the sizes where the paths differ.
    auto tcp_time = [&](auto&& fn) { return bytes <= kSmall ? Time(reps, iters, fn) : -1.0; };
    double gloo = Time(reps, iters, [&] {
      keep(comm->Allreduce(buf.data(), n, DType::kF32, ReduceOp::kSum, kTimeout));
    });
    double tcp = tcp_time([&] {
      keep(tcp_comm->Allreduce(buf.data(), n, DType::kF32, ReduceOp::kSum, kTimeout));
    });
    MORPH_RETURN_IF_ERROR(st) << "gloo allreduce";
    double mpi = Time(reps, iters, [&] {
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    });
    if (rank == 0) Print("allreduce_f32_sum", world, bytes, gloo, mpi, tcp);
    const double mpi_allreduce = mpi;

    // Reduce-scatter: `bytes` of input per rank (at least one element per rank).
    const size_t piece = std::max<size_t>(1, n / world);
    if (buf.size() < piece * world) buf.resize(piece * world, 1.0f);
    std::vector<float> out(piece);
    gloo = Time(reps, iters, [&] {
      keep(comm->ReduceScatter(buf.data(), out.data(), piece, DType::kF32, ReduceOp::kSum,
                               kTimeout));
    });
    tcp = tcp_time([&] {
      keep(tcp_comm->ReduceScatter(buf.data(), out.data(), piece, DType::kF32, ReduceOp::kSum,
                                   kTimeout));
    });
    MORPH_RETURN_IF_ERROR(st) << "gloo reduce_scatter";
    mpi = Time(reps, iters, [&] {
      MPI_Reduce_scatter_block(buf.data(), out.data(), static_cast<int>(piece), MPI_FLOAT, MPI_SUM,
                               MPI_COMM_WORLD);
    });
    if (rank == 0) Print("reduce_scatter_f32_sum", world, piece * world * 4, gloo, mpi, tcp);

    if (bytes <= kSmall) {
      gloo = Time(reps, iters, [&] {
        keep(comm->Broadcast(buf.data(), n, DType::kF32, 0, kTimeout));
      });
      tcp = Time(reps, iters, [&] {
        keep(tcp_comm->Broadcast(buf.data(), n, DType::kF32, 0, kTimeout));
      });
      MORPH_RETURN_IF_ERROR(st) << "gloo broadcast";
      mpi = Time(reps, iters, [&] {
        MPI_Bcast(buf.data(), static_cast<int>(n), MPI_FLOAT, 0, MPI_COMM_WORLD);
      });
      if (rank == 0) Print("broadcast_f32", world, bytes, gloo, mpi, tcp);

      // Allgather: `bytes` per rank in.
      std::vector<float> all(n * world);
      gloo = Time(reps, iters, [&] {
        keep(comm->Allgather(buf.data(), all.data(), n, DType::kF32, kTimeout));
      });
      tcp = Time(reps, iters, [&] {
        keep(tcp_comm->Allgather(buf.data(), all.data(), n, DType::kF32, kTimeout));
      });
      MORPH_RETURN_IF_ERROR(st) << "gloo allgather";
      mpi = Time(reps, iters, [&] {
        MPI_Allgather(buf.data(), static_cast<int>(n), MPI_FLOAT, all.data(), static_cast<int>(n),
                      MPI_FLOAT, MPI_COMM_WORLD);
      });
      if (rank == 0) Print("allgather_f32", world, bytes, gloo, mpi, tcp);
    }
    if (bytes == 8) {
      gloo = Time(reps, iters, [&] { keep(comm->Barrier(kTimeout)); });
      tcp = Time(reps, iters, [&] { keep(tcp_comm->Barrier(kTimeout)); });
      MORPH_RETURN_IF_ERROR(st) << "gloo barrier";
      mpi = Time(reps, iters, [&] { MPI_Barrier(MPI_COMM_WORLD); });
      if (rank == 0) Print("barrier", world, 0, gloo, mpi, tcp);
    }

    // bf16 on Gloo (reduced in f32) against MPI's f32 allreduce of the same element count:
    // MPI has no bf16; this shows what the halved bytes buy or cost.
    std::vector<uint16_t> half(n, FloatToBFloat16(1.0f));
    gloo = Time(reps, iters, [&] {
      keep(comm->Allreduce(half.data(), n, DType::kBF16, ReduceOp::kSum, kTimeout));
    });
    tcp = tcp_time([&] {
      keep(tcp_comm->Allreduce(half.data(), n, DType::kBF16, ReduceOp::kSum, kTimeout));
    });
    MORPH_RETURN_IF_ERROR(st) << "gloo bf16 allreduce";
    if (rank == 0) {
      Print("allreduce_bf16_sum_vs_mpi_f32", world, bytes / 2, gloo, mpi_allreduce, tcp);
    }

    // Point to point: rank 0 -> rank 1, the others idle.
    std::vector<uint8_t> p2p(bytes, 7);
    double gloo_p2p = Time(reps, iters, [&] {
      Status s;
      if (rank == 0) s = comm->SendRecv({{P2POp::Kind::kSend, 1, p2p.data(), bytes}}, kTimeout);
      if (rank == 1) s = comm->SendRecv({{P2POp::Kind::kRecv, 0, p2p.data(), bytes}}, kTimeout);
      keep(s);
    });
    MORPH_RETURN_IF_ERROR(st) << "gloo send/recv";
    double mpi_p2p = Time(reps, iters, [&] {
      if (rank == 0) MPI_Send(p2p.data(), static_cast<int>(bytes), MPI_BYTE, 1, 0, MPI_COMM_WORLD);
      if (rank == 1) {
        MPI_Recv(p2p.data(), static_cast<int>(bytes), MPI_BYTE, 0, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
      }
    });
    if (rank == 0) Print("send_recv", world, bytes, gloo_p2p, mpi_p2p);
  }
  comm.reset();
  tcp_comm.reset();
  MPI_Barrier(MPI_COMM_WORLD);
  store.reset();
  return MpiBootstrap::Finalize();
}

}  // namespace
}  // namespace morph

// Optional argument: the largest size to run (bytes), e.g. 65536 for the latency cases only.
int main(int argc, char** argv) {
  size_t max_bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : SIZE_MAX;
  morph::Status s = morph::Run(max_bytes);
  if (!s.ok()) {
    std::fprintf(stderr, "collectives_mpi_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
