// Gloo communicator vs Open MPI on the same ranks, sizes and run: allreduce (f32 sum; bf16
// against MPI's f32 of the same count), reduce-scatter and point to point, from 8 B (latency)
// to 64 MiB (bandwidth). Launch under mpirun; rank 0 prints one JSON object per case:
//   mpirun --allow-run-as-root --oversubscribe -np 4 build/bench/collectives_mpi_bench [max_bytes]
// ratio_vs_mpi = gloo seconds / MPI seconds (lower is better; 1.0 = parity). On one host the
// default communicator takes the shared-memory path (MORPH_GLOO_SHM: one round up to 64 KiB,
// chunks through staging slots above); a second one built with shared_memory = false times the
// TCP path in the same run: tcp_seconds and tcp_ratio_vs_mpi. Broadcast and allgather run up
// to 4 MiB, barrier once.
// Broadcast's seconds run from the root's start until every rank has the data, for MPI and
// Gloo alike; own_clock_* is the figure it printed before, the slowest rank's own clock, which
// for a broadcast shows the root's view (TimeBoth says why).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/mpi_check.h"  // <mpi.h> without the C++ bindings
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/mpi_bootstrap.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

constexpr char kToken[] = "bench-token";
constexpr auto kTimeout = std::chrono::seconds(120);

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Seconds per call of fn(), two ways, from the same timings: `iters` back-to-back calls,
// each timing started after an MPI barrier, median over `reps`. Back-to-back calls keep Open
// MPI's busy-polling (in the barrier and the timing allreduce) from competing for the cores
// with the Gloo threads of a rank that is still working.
//  - own: each rank times its own loop, the slowest rank's time counts. Fine when no rank can
//    finish before every rank started (allreduce, allgather, reduce-scatter, barrier).
//  - all_ranks: from the moment `root` started its loop (the earliest rank's start when
//    root < 0) until the last rank finished its own: the time until every rank has every
//    result. A broadcast needs it: its root may return before anyone received (MPI's eager
//    root: 0.3 us), and a receiver that a scheduler or a sleep kept off a core starts its
//    clock late, finds the data long queued and times only its copies, so `own` misses the
//    time between the root's start and the last receiver's (measured: 0.8 against 3.3 us for
//    the Gloo communicator at 4 ranks on 2 cores; MPI's busy-polling ranks differ less).
//    The clocks are comparable because every rank reads CLOCK_MONOTONIC of the same host
//    (steady_clock); -1 when the ranks are not all on one host.
// Both figures are taken alike for MPI and the Gloo communicator.
struct Timing {
  double own = 0;
  double all_ranks = 0;
};

// Whether every rank runs on this host (the all_ranks figure needs one clock).
bool OneHost() {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  uint64_t h = 14695981039346656037ull, lo = 0, hi = 0;  // FNV-1a of the name
  for (int i = 0; i < len; ++i) h = (h ^ static_cast<unsigned char>(name[i])) * 1099511628211ull;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

template <typename Fn>
Timing TimeBoth(int reps, int iters, Fn&& fn, int root = -1) {
  static const bool one_host = OneHost();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<double> own, all;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = Now();
    for (int k = 0; k < iters; ++k) fn();
    const double t1 = Now();
    // Maxima of: own time, -start (of the root only, or of every rank), end.
    double in[3] = {(t1 - t0) / iters, root < 0 || rank == root ? -t0 : -1e300, t1}, out[3];
    MPI_Allreduce(in, out, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    own.push_back(out[0]);
    all.push_back((out[2] + out[1]) / iters);
  }
  auto median = [](std::vector<double>& t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  return {median(own), one_host ? median(all) : -1.0};
}

// The `own` figure: what every case but broadcast reports.
template <typename Fn>
double Time(int reps, int iters, Fn&& fn) {
  return TimeBoth(reps, iters, fn).own;
}

// `tcp` < 0: not measured. `extra`: more JSON fields, each starting with a comma.
void Print(const char* name, int world, size_t bytes, double gloo, double mpi, double tcp = -1,
           const std::string& extra = "") {
  char tcp_fields[128] = "";
  if (tcp >= 0) {
    std::snprintf(tcp_fields, sizeof(tcp_fields), ",\"tcp_seconds\":%.9f,\"tcp_ratio_vs_mpi\":%.3f",
                  tcp, tcp / mpi);
  }
  std::printf(
      "{\"name\":\"%s\",\"ranks\":%d,\"bytes\":%zu,\"seconds\":%.9f,"
      "\"mpi_seconds\":%.9f,\"ratio_vs_mpi\":%.3f,\"gloo_algbw_GBps\":%.3f,"
      "\"mpi_algbw_GBps\":%.3f%s%s}\n",
      name, world, bytes, gloo, mpi, gloo / mpi, bytes / gloo / 1e9, bytes / mpi / 1e9, tcp_fields,
      extra.c_str());
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
  constexpr size_t kMidSize = size_t{4} << 20;  // broadcast and allgather up to here
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
    // The same calls on the TCP-only communicator.
    auto tcp_time = [&](auto&& fn) { return Time(reps, iters, fn); };
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

    if (bytes <= kMidSize) {
      // From root 0's start until the last rank has the data (TimeBoth); the slowest rank's
      // own clock, the figure this case reported before, as own_clock_*.
      const Timing gloo_b = TimeBoth(
          reps, iters, [&] { keep(comm->Broadcast(buf.data(), n, DType::kF32, 0, kTimeout)); }, 0);
      const Timing tcp_b = TimeBoth(
          reps, iters, [&] { keep(tcp_comm->Broadcast(buf.data(), n, DType::kF32, 0, kTimeout)); },
          0);
      MORPH_RETURN_IF_ERROR(st) << "gloo broadcast";
      const Timing mpi_b = TimeBoth(
          reps, iters,
          [&] { MPI_Bcast(buf.data(), static_cast<int>(n), MPI_FLOAT, 0, MPI_COMM_WORLD); }, 0);
      if (rank == 0) {
        const bool all = mpi_b.all_ranks >= 0;  // one host: one clock
        auto fair = [&](const Timing& t) { return all ? t.all_ranks : t.own; };
        char own[200];
        std::snprintf(own, sizeof(own),
                      ",\"measure\":\"%s\",\"own_clock_seconds\":%.9f,"
                      "\"mpi_own_clock_seconds\":%.9f,\"own_clock_ratio_vs_mpi\":%.3f",
                      all ? "all_ranks" : "own_clock", gloo_b.own, mpi_b.own,
                      gloo_b.own / mpi_b.own);
        Print("broadcast_f32", world, bytes, fair(gloo_b), fair(mpi_b), fair(tcp_b), own);
      }

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
    // The same over the TCP-only communicator (what ranks on other hosts use).
    double tcp_p2p = Time(reps, iters, [&] {
      Status s;
      if (rank == 0) s = tcp_comm->SendRecv({{P2POp::Kind::kSend, 1, p2p.data(), bytes}}, kTimeout);
      if (rank == 1) s = tcp_comm->SendRecv({{P2POp::Kind::kRecv, 0, p2p.data(), bytes}}, kTimeout);
      keep(s);
    });
    MORPH_RETURN_IF_ERROR(st) << "gloo send/recv over TCP";
    double mpi_p2p = Time(reps, iters, [&] {
      if (rank == 0) MPI_Send(p2p.data(), static_cast<int>(bytes), MPI_BYTE, 1, 0, MPI_COMM_WORLD);
      if (rank == 1) {
        MPI_Recv(p2p.data(), static_cast<int>(bytes), MPI_BYTE, 0, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
      }
    });
    if (rank == 0) Print("send_recv", world, bytes, gloo_p2p, mpi_p2p, tcp_p2p);
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
