// The Gloo communicator's same-host shared-memory path (shm_collectives.h) with ranks as forked
// processes (label multiproc): it is taken when every rank is here and enabled, its results are
// the reference ones and up to 64 KiB bit for bit the TCP path's, in the documented rank order
// at every size (larger ones through the staging slots, in chunks); Abort() wakes a waiter at
// once and stops a large operation, a SIGKILLed peer gives kUnavailable naming it, a silent or
// stopped one kDeadlineExceeded, a destroyed one kUnavailable; the segment's name is gone once
// created; disabled on any rank, everyone uses TCP; every receiver gets every broadcast bit for
// bit; ranks whose calls differ all fail, on shared memory and over TCP, and go on.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/shm/shm_collectives.h"
#include "collectives/store/tcp_store.h"
#include "collectives/testing/collective_checks.h"
#include "collectives/testing/rank_harness.h"

namespace morph {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "shm-token";
constexpr milliseconds kTimeout(20000);

StatusOr<std::unique_ptr<GlooCommunicator>> Build(Store& store, const std::string& name, int rank,
                                                  int world, bool shared_memory) {
  GlooOptions options;
  options.shared_memory = shared_memory;
  MORPH_ASSIGN_OR_RETURN(auto device, GlooDevice::Create(options));
  return GlooCommunicator::Create(store, name, rank, world, device, Deadline::AfterMs(20000));
}

// Runs fn(rank, store) in `world` forked ranks; the parent may act meanwhile (`parent`, given
// the store address) and returns the exit codes.
std::vector<int> RunForked(
    int world, const std::function<Status(int, TcpStoreClient&)>& fn,
    const std::function<void(ForkedRanks&, const std::string&)>& parent = nullptr) {
  ForkedRanks ranks = ForkedRanks::Fork(world, [&](int rank, const std::string& address) {
    Status s = [&]() -> Status {
      MORPH_ASSIGN_OR_RETURN(auto store,
                             TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
      return fn(rank, *store);
    }();
    return ExitCode(rank, s);
  });
  auto server = TcpStoreServer::Start("127.0.0.1", 0, kToken);
  server.status().CheckOk("store server");
  ranks.Release((*server)->address());
  if (parent) parent(ranks, (*server)->address());
  return ranks.Wait(Deadline::AfterMs(60000));
}

// Values whose floating-point sum depends on the order: mixed signs and magnitudes.
void Fill(DType t, void* buf, size_t n, int rank) {
  for (size_t i = 0; i < n; ++i) {
    const double v = ((i + rank) % 2 ? -1.0 : 1.0) *
                     std::ldexp(1.0 + 0.37 * static_cast<double>((i * 5 + rank * 3) % 11),
                                static_cast<int>((i * 7 + rank * 13) % 21) - 10);
    switch (t) {
      case DType::kF32:
        static_cast<float*>(buf)[i] = static_cast<float>(v);
        break;
      case DType::kF64:
        static_cast<double*>(buf)[i] = v;
        break;
      case DType::kF16:
        static_cast<uint16_t*>(buf)[i] = FloatToHalf(static_cast<float>(v));
        break;
      case DType::kBF16:
        static_cast<uint16_t*>(buf)[i] = FloatToBFloat16(static_cast<float>(v));
        break;
      case DType::kI32:
        static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v * 1000);
        break;
      case DType::kI64:
        static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v * 1e6);
        break;
      case DType::kI8:
        static_cast<int8_t*>(buf)[i] = static_cast<int8_t>(static_cast<int>(v * 7) % 100);
        break;
      case DType::kU8:
        static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>((i * 31 + rank * 17) & 0xff);
        break;
    }
  }
}

// out = in0 op in1 op ... in rank order, ((x0 op x1) op x2) ..., element by element in T.
template <typename T>
void ReferenceTyped(const std::vector<std::vector<uint8_t>>& in, size_t n, ReduceOp op,
                    uint8_t* out) {
  for (size_t i = 0; i < n; ++i) {
    T acc;
    std::memcpy(&acc, in[0].data() + i * sizeof(T), sizeof(T));
    for (size_t r = 1; r < in.size(); ++r) {
      T x;
      std::memcpy(&x, in[r].data() + i * sizeof(T), sizeof(T));
      acc = op == ReduceOp::kSum ? static_cast<T>(acc + x)
                                 : (op == ReduceOp::kMax ? std::max(acc, x) : std::min(acc, x));
    }
    std::memcpy(out + i * sizeof(T), &acc, sizeof(T));
  }
}

// The documented result of reducing `in` (one buffer of n elements per rank): rank order,
// f16/bf16 in f32 rounded once at the end.
std::vector<uint8_t> ReferenceReduce(DType t, const std::vector<std::vector<uint8_t>>& in, size_t n,
                                     ReduceOp op) {
  std::vector<uint8_t> out(n * DTypeSize(t));
  if (t == DType::kF16 || t == DType::kBF16) {
    const bool bf = t == DType::kBF16;
    std::vector<std::vector<uint8_t>> wide(in.size(), std::vector<uint8_t>(n * 4));
    for (size_t r = 0; r < in.size(); ++r) {
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, in[r].data() + 2 * i, 2);
        const float f = bf ? BFloat16ToFloat(h) : HalfToFloat(h);
        std::memcpy(wide[r].data() + 4 * i, &f, 4);
      }
    }
    std::vector<uint8_t> acc(n * 4);
    ReferenceTyped<float>(wide, n, op, acc.data());
    for (size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, acc.data() + 4 * i, 4);
      const uint16_t h = bf ? FloatToBFloat16(f) : FloatToHalf(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
    return out;
  }
  switch (t) {
    case DType::kF32:
      ReferenceTyped<float>(in, n, op, out.data());
      break;
    case DType::kF64:
      ReferenceTyped<double>(in, n, op, out.data());
      break;
    case DType::kI32:
      ReferenceTyped<int32_t>(in, n, op, out.data());
      break;
    case DType::kI64:
      ReferenceTyped<int64_t>(in, n, op, out.data());
      break;
    case DType::kI8:
      ReferenceTyped<int8_t>(in, n, op, out.data());
      break;
    case DType::kU8:
      ReferenceTyped<uint8_t>(in, n, op, out.data());
      break;
    case DType::kF16:
    case DType::kBF16:
      break;
  }
  return out;
}

// Every small collective on `shm` and on `tcp` with the same inputs: the same bytes.
Status CompareWithTcp(GlooCommunicator& shm, GlooCommunicator& tcp) {
  const int rank = shm.rank(), world = shm.size();
  for (DType t : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16, DType::kI32, DType::kI64,
                  DType::kI8, DType::kU8}) {
    const size_t es = DTypeSize(t);
    for (size_t count : {size_t{1}, size_t{7}, size_t{1001}, (size_t{64} << 10) / es}) {
      const std::string what = std::string(DTypeName(t)) + " count " + std::to_string(count) + ": ";
      std::vector<uint8_t> in(count * es * world), a, b;
      Fill(t, in.data(), count * world, rank);
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        a.assign(in.begin(), in.begin() + count * es);
        b = a;
        MORPH_RETURN_IF_ERROR(shm.Allreduce(a.data(), count, t, op, kTimeout));
        MORPH_RETURN_IF_ERROR(tcp.Allreduce(b.data(), count, t, op, kTimeout));
        if (a != b) {
          return InternalError(what + "allreduce " + std::string(ReduceOpName(op)) +
                               " differs from the TCP path's");
        }
        if (count * es * world <= (size_t{64} << 10)) {
          a.assign(count * es, 0);
          b = a;
          MORPH_RETURN_IF_ERROR(shm.ReduceScatter(in.data(), a.data(), count, t, op, kTimeout));
          MORPH_RETURN_IF_ERROR(tcp.ReduceScatter(in.data(), b.data(), count, t, op, kTimeout));
          if (a != b) return InternalError(what + "reduce_scatter differs from the TCP path's");
        }
      }
      a.assign(count * es * world, 0);
      b = a;
      MORPH_RETURN_IF_ERROR(shm.Allgather(in.data(), a.data(), count, t, kTimeout));
      MORPH_RETURN_IF_ERROR(tcp.Allgather(in.data(), b.data(), count, t, kTimeout));
      if (a != b) return InternalError(what + "allgather differs from the TCP path's");
      const int root = world - 1;
      a.assign(in.begin(), in.begin() + count * es);
      b = a;
      MORPH_RETURN_IF_ERROR(shm.Broadcast(a.data(), count, t, root, kTimeout));
      MORPH_RETURN_IF_ERROR(tcp.Broadcast(b.data(), count, t, root, kTimeout));
      if (a != b) return InternalError(what + "broadcast differs from the TCP path's");
    }
  }
  return Status::Ok();
}

// Names in /dev/shm that this process's segments would have.
int SegmentsOfThisProcess() {
  const std::string prefix = "morph-coll-" + std::to_string(getpid()) + "-";
  int n = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) ++n;
    }
    closedir(d);
  }
  return n;
}

// `peer` published an allreduce and then left (aborted, timed out): this rank's allreduce
// still completes with every contribution (the peer's was in), and the next one fails at once
// with kUnavailable naming the peer rather than at its timeout.
Status ExpectPeerLeft(GlooCommunicator& comm, int peer) {
  int32_t v = comm.rank() + 1;
  Status first = comm.Allreduce(&v, 1, DType::kI32, ReduceOp::kSum, kTimeout);
  if (!first.ok()) return first.WithContext("the operation the peer had published");
  if (v != 3) return InternalError("allreduce with the peer's contribution: " + std::to_string(v));
  const Clock::time_point start = Clock::now();
  Status s = comm.Allreduce(&v, 1, DType::kI32, ReduceOp::kSum, kTimeout);
  if (s.code() != StatusCode::kUnavailable ||
      std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()) !=
          std::vector<int>{peer} ||
      Clock::now() - start > std::chrono::seconds(2)) {
    return InternalError("allreduce after rank " + std::to_string(peer) + " left: " + s.ToString());
  }
  return Status::Ok();
}

// Allreduces of 16 MiB (f32, rank + 1 everywhere: the staging path, 64 chunks each), checked,
// until one fails: its Status (kInternal for a wrong sum or when none failed in 2000). Sets
// `key` in the store after the first.
Status LoopLargeAllreduces(GlooCommunicator& comm, TcpStoreClient& store, const std::string& key,
                           milliseconds timeout) {
  std::vector<float> buf(size_t{4} << 20);
  const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
  for (int i = 0; i < 2000; ++i) {
    std::fill(buf.begin(), buf.end(), static_cast<float>(comm.rank() + 1));
    Status s = comm.Allreduce(buf.data(), buf.size(), DType::kF32, ReduceOp::kSum, timeout);
    if (!s.ok()) return s;
    if (buf.front() != want || buf[buf.size() / 2] != want || buf.back() != want) {
      return InternalError("large allreduce " + std::to_string(i) + ": wrong sum");
    }
    if (i == 0) {
      MORPH_RETURN_IF_ERROR(store.Set(key, "1", Deadline::AfterMs(5000)));
    }
  }
  return InternalError("no large allreduce failed");
}

// Broadcast i's bytes: a pattern of i, so that a receiver reading bytes of another broadcast
// sees the wrong ones.
std::vector<uint8_t> Pattern(int i, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (size_t j = 0; j < bytes; ++j) {
    v[j] = static_cast<uint8_t>((i * 151 + j * 7 + (j >> 9)) ^ (i >> 3));
  }
  return v;
}

// Broadcast i's size: from 1 B to the 64 KiB buffer.
size_t BroadcastBytes(int i) {
  constexpr size_t kAny[] = {1, 4097, 8, ShmCollectives::kSlotBytes, 3, 4096, 5000, 100};
  return kAny[i % 8];
}

// Broadcast i (of `bytes`, or BroadcastBytes(i) if 0) from `root`, checked bit for bit on the
// others.
Status BroadcastAndCheck(GlooCommunicator& comm, int root, int i, milliseconds timeout,
                         size_t bytes = 0) {
  if (bytes == 0) bytes = BroadcastBytes(i);
  const std::vector<uint8_t> expected = Pattern(i, bytes);
  std::vector<uint8_t> buf = comm.rank() == root ? expected : std::vector<uint8_t>(bytes, 0xee);
  Status s = comm.Broadcast(buf.data(), bytes, DType::kU8, root, timeout);
  if (!s.ok()) return s.WithContext("broadcast " + std::to_string(i));
  if (buf != expected) {
    return InternalError("broadcast " + std::to_string(i) + " (" + std::to_string(bytes) +
                         " B) differs from the root's bytes");
  }
  return Status::Ok();
}

class GlooShmWorldTest : public ::testing::TestWithParam<int> {};

// Failed before the shared-memory path existed (no GlooCommunicator::shared_memory()).
TEST_P(GlooShmWorldTest, SmallCollectivesTakeSharedMemoryAndMatchTcpBitForBit) {
  const int world = GetParam();
  std::vector<int> codes = RunForked(world, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto shm, Build(store, "shm", rank, world, true));
    MORPH_ASSIGN_OR_RETURN(auto tcp, Build(store, "tcp", rank, world, false));
    if (world > 1 && !shm->shared_memory()) {
      return InternalError("every rank is on this host, yet no shared memory");
    }
    if (tcp->shared_memory()) return InternalError("shared_memory = false, yet shared memory");
    if (SegmentsOfThisProcess() != 0) {
      return InternalError("the segment's name is still in /dev/shm after Create");
    }
    MORPH_RETURN_IF_ERROR(CheckAllCollectives(*shm, kTimeout));
    // Rank order at every size (above 64 KiB through the staging slots).
    MORPH_RETURN_IF_ERROR(CheckReductionOrder(*shm, SIZE_MAX, kTimeout));
    return CompareWithTcp(*shm, *tcp);
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Collectives beyond the 64 KiB buffers go through the staging slots in chunks: for every type
// and op, at sizes just above 64 KiB, across chunk boundaries (a last chunk of one element, of
// fewer elements than ranks) and of several MiB, allreduce and reduce-scatter equal a local
// reduction in rank order bit for bit, allgather and broadcast the inputs byte for byte, and
// every rank holds the same bytes (gathered over the TCP communicator). Failed before the
// staging path: above 64 KiB the TCP path reduces in ring order (or Gloo's).
TEST_P(GlooShmWorldTest, LargeCollectivesReduceInRankOrderAndEveryRankGetsTheSameBytes) {
  const int world = GetParam();
  if (world < 2) GTEST_SKIP() << "one rank takes no shared memory";
  std::vector<int> codes = RunForked(world, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto shm, Build(store, "large", rank, world, true));
    MORPH_ASSIGN_OR_RETURN(auto tcp, Build(store, "large-tcp", rank, world, false));
    if (!shm->shared_memory()) return InternalError("no shared memory");
    const size_t w = static_cast<size_t>(world);
    const size_t chunk = ShmCollectives::ChunkBytes(world);
    // Every rank's bytes of `mine` equal rank 0's.
    auto same_everywhere = [&](const std::vector<uint8_t>& mine,
                               const std::string& what) -> Status {
      std::vector<uint8_t> all(mine.size() * w);
      MORPH_RETURN_IF_ERROR(
          tcp->Allgather(mine.data(), all.data(), mine.size(), DType::kU8, kTimeout));
      for (size_t r = 1; r < w; ++r) {
        if (!std::equal(mine.begin(), mine.end(), all.begin() + r * mine.size())) {
          return InternalError(what + ": rank " + std::to_string(r) +
                               "'s bytes differ from rank 0's");
        }
      }
      return Status::Ok();
    };
    for (DType t : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16, DType::kI32, DType::kI64,
                    DType::kI8, DType::kU8}) {
      const size_t es = DTypeSize(t);
      std::vector<size_t> counts = {ShmCollectives::kSlotBytes / es + 1,
                                    chunk / (es * w) + 1,  // a reduce-scatter chunk + 1
                                    chunk / es + 1,        // an allreduce chunk + 1
                                    2 * chunk / es + chunk / (2 * es) + 3};
      if (t == DType::kF32 || t == DType::kBF16) counts.push_back((size_t{5} << 20) / es + 3);
      for (size_t count : counts) {
        const std::string what = std::string(DTypeName(t)) + " count " + std::to_string(count);
        // Every rank's reduce-scatter input (count * world elements), its first count elements
        // the allreduce, allgather and broadcast input.
        std::vector<std::vector<uint8_t>> in(w, std::vector<uint8_t>(count * es * w));
        for (size_t r = 0; r < w; ++r) Fill(t, in[r].data(), count * w, static_cast<int>(r));
        const bool large_only = count * es > (size_t{1} << 20);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
          if (large_only && op != ReduceOp::kSum) continue;
          std::vector<std::vector<uint8_t>> firsts(w);
          for (size_t r = 0; r < w; ++r) {
            firsts[r].assign(in[r].begin(), in[r].begin() + count * es);
          }
          std::vector<uint8_t> buf = firsts[rank];
          MORPH_RETURN_IF_ERROR(shm->Allreduce(buf.data(), count, t, op, kTimeout)) << what;
          if (buf != ReferenceReduce(t, firsts, count, op)) {
            return InternalError(what + ": allreduce " + std::string(ReduceOpName(op)) +
                                 " differs from the reduction in rank order");
          }
          MORPH_RETURN_IF_ERROR(same_everywhere(buf, what + ": allreduce"));
          // Reduce-scatter: this rank's piece of every rank's input.
          std::vector<std::vector<uint8_t>> pieces(w);
          for (size_t r = 0; r < w; ++r) {
            pieces[r].assign(in[r].begin() + rank * count * es,
                             in[r].begin() + (rank + 1) * count * es);
          }
          std::vector<uint8_t> out(count * es, 0xee);
          MORPH_RETURN_IF_ERROR(
              shm->ReduceScatter(in[rank].data(), out.data(), count, t, op, kTimeout))
              << what;
          if (out != ReferenceReduce(t, pieces, count, op)) {
            return InternalError(what + ": reduce_scatter " + std::string(ReduceOpName(op)) +
                                 " differs from the reduction in rank order");
          }
        }
        std::vector<uint8_t> gathered(count * es * w, 0xee), want;
        MORPH_RETURN_IF_ERROR(shm->Allgather(in[rank].data(), gathered.data(), count, t, kTimeout))
            << what;
        for (size_t r = 0; r < w; ++r) {
          want.insert(want.end(), in[r].begin(), in[r].begin() + count * es);
        }
        if (gathered != want) return InternalError(what + ": allgather differs from the inputs");
        for (int root : {0, world - 1}) {
          std::vector<uint8_t> buf(in[rank].begin(), in[rank].begin() + count * es);
          MORPH_RETURN_IF_ERROR(shm->Broadcast(buf.data(), count, t, root, kTimeout)) << what;
          if (!std::equal(buf.begin(), buf.end(), in[root].begin())) {
            return InternalError(what + ": broadcast from " + std::to_string(root) +
                                 " differs from the root's bytes");
          }
        }
      }
    }
    // Small and large operations interleaved keep their order and their bytes.
    std::vector<float> big(3 * chunk / 4 + 5), small(3);
    for (int i = 0; i < 6; ++i) {
      std::fill(big.begin(), big.end(), static_cast<float>(rank + i));
      std::fill(small.begin(), small.end(), static_cast<float>(rank * i));
      MORPH_RETURN_IF_ERROR(
          shm->Allreduce(big.data(), big.size(), DType::kF32, ReduceOp::kSum, kTimeout));
      MORPH_RETURN_IF_ERROR(
          shm->Allreduce(small.data(), small.size(), DType::kF32, ReduceOp::kSum, kTimeout));
      const float want_big = static_cast<float>(world * (world - 1) / 2 + world * i);
      const float want_small = static_cast<float>(i * world * (world - 1) / 2);
      if (big.front() != want_big || big.back() != want_big || small[2] != want_small) {
        return InternalError("interleaved operation " + std::to_string(i) + ": wrong sums");
      }
    }
    return Status::Ok();
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooShmWorldTest, ::testing::Values(1, 2, 3, 4));

TEST(GlooShmTest, DisabledOnOneRankMeansTcpOnAll) {
  std::vector<int> codes = RunForked(3, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "mixed", rank, 3, rank != 1));
    if (comm->shared_memory()) return InternalError("rank 1 disabled it, yet shared memory");
    return CheckAllCollectives(*comm, kTimeout);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Rank 1 never joins; rank 0's allreduce sleeps in shared memory until another thread aborts.
TEST(GlooShmTest, AbortFromAnotherThreadWakesASharedMemoryWait) {
  std::vector<int> codes = RunForked(2, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "abort", rank, 2, true));
    if (!comm->shared_memory()) return InternalError("no shared memory");
    if (rank == 1) {
      MORPH_RETURN_IF_ERROR(
          store.Wait(std::vector<std::string>{"aborted"}, Deadline::AfterMs(20000)));
      return ExpectPeerLeft(*comm, 0);
    }
    Clock::time_point aborted_at;
    std::thread aborter([&] {
      std::this_thread::sleep_for(milliseconds(300));
      aborted_at = Clock::now();
      comm->Abort();
    });
    int32_t v = 1;  // what ExpectPeerLeft expects of rank 0
    Status s = comm->Allreduce(&v, 1, DType::kI32, ReduceOp::kSum, kTimeout);
    const Clock::time_point returned_at = Clock::now();
    aborter.join();
    MORPH_RETURN_IF_ERROR(store.Set("aborted", "1", Deadline::AfterMs(5000)));
    if (s.code() != StatusCode::kAborted || s.collective_failure() == nullptr ||
        s.collective_failure()->kind != CollectiveFailure::Kind::kAborted) {
      return InternalError("aborted allreduce: " + s.ToString());
    }
    const double ms = std::chrono::duration<double, std::milli>(returned_at - aborted_at).count();
    std::fprintf(stderr, "rank 0: allreduce returned %.3f ms after Abort()\n", ms);
    if (ms > 100) return InternalError("Abort() took " + std::to_string(ms) + " ms to wake it");
    if (!comm->broken()) return InternalError("not broken after Abort()");
    return Status::Ok();
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Ranks 0 and 2 wait in a shared-memory allreduce for rank 1, which the test SIGKILLs.
TEST(GlooShmTest, SigkilledPeerMidWaitIsUnavailableNamingIt) {
  constexpr int kWorld = 3, kVictim = 1;
  std::vector<int> codes = RunForked(
      kWorld,
      [&](int rank, TcpStoreClient& store) -> Status {
        MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "kill", rank, kWorld, true));
        if (!comm->shared_memory()) return InternalError("no shared memory");
        MORPH_RETURN_IF_ERROR(
            store.Set("waiting/" + std::to_string(rank), "1", Deadline::AfterMs(5000)));
        if (rank == kVictim) {
          std::this_thread::sleep_for(std::chrono::seconds(60));
          return InternalError("the victim was not killed");
        }
        std::vector<double> v(1000, 1.0);
        Status s = comm->Allreduce(v.data(), v.size(), DType::kF64, ReduceOp::kSum, kTimeout);
        const Clock::time_point failed_at = Clock::now();
        MORPH_ASSIGN_OR_RETURN(std::string killed_at,
                               store.Get("killed_at", Deadline::AfterMs(10000)));
        const double ms =
            std::chrono::duration<double, std::milli>(
                failed_at.time_since_epoch() - std::chrono::nanoseconds(std::stoll(killed_at)))
                .count();
        std::fprintf(stderr, "rank %d: failed %.1f ms after the kill: %s\n", rank, ms,
                     s.ToString().c_str());
        if (s.code() != StatusCode::kUnavailable ||
            std::string(s.message()).find("exited") == std::string::npos) {
          return InternalError("wrong failure: " + s.ToString());
        }
        if (std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()) !=
            std::vector<int>{kVictim}) {
          return InternalError("failed_peers does not name exactly rank 1: " + s.ToString());
        }
        if (ms > 2000) return InternalError("noticed only " + std::to_string(ms) + " ms later");
        // Later operations return the same error; nothing hangs.
        Status again = comm->Barrier(kTimeout);
        if (again.code() != StatusCode::kUnavailable || again.failed_peers().size() != 1) {
          return InternalError("later barrier: " + again.ToString());
        }
        return Status::Ok();
      },
      [&](ForkedRanks& ranks, const std::string& address) {
        auto store = TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(5000));
        store.status().CheckOk("parent store");
        (*store)
            ->Wait(std::vector<std::string>{"waiting/0", "waiting/1", "waiting/2"},
                   Deadline::AfterMs(30000))
            .CheckOk("ranks ready");
        std::this_thread::sleep_for(milliseconds(300));  // the survivors sleep on the futex
        const auto killed_at = Clock::now().time_since_epoch();
        ranks.Kill(kVictim);
        (*store)
            ->Set("killed_at",
                  std::to_string(
                      std::chrono::duration_cast<std::chrono::nanoseconds>(killed_at).count()),
                  Deadline::AfterMs(5000))
            .CheckOk("killed_at");
      });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[kVictim], 128 + SIGKILL);
  EXPECT_EQ(codes[2], 0);
}

// Rank 1 is SIGKILLed while every rank runs large allreduces (64 chunks each, so the kill lands
// inside one): the survivors get kUnavailable naming it, through its pidfd, within a poll slice
// or so. Failed before the staging path (over TCP: "Connection closed by peer", no pidfd).
TEST(GlooShmTest, SigkilledPeerMidLargeOperationIsUnavailableNamingIt) {
  constexpr int kWorld = 3, kVictim = 1;
  std::vector<int> codes = RunForked(
      kWorld,
      [&](int rank, TcpStoreClient& store) -> Status {
        MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "kill-large", rank, kWorld, true));
        if (!comm->shared_memory()) return InternalError("no shared memory");
        Status s = LoopLargeAllreduces(*comm, store, "looping/" + std::to_string(rank), kTimeout);
        const Clock::time_point failed_at = Clock::now();
        if (rank == kVictim) return InternalError("the victim was not killed: " + s.ToString());
        MORPH_ASSIGN_OR_RETURN(std::string killed_at,
                               store.Get("killed_at", Deadline::AfterMs(10000)));
        const double ms =
            std::chrono::duration<double, std::milli>(
                failed_at.time_since_epoch() - std::chrono::nanoseconds(std::stoll(killed_at)))
                .count();
        std::fprintf(stderr, "rank %d: failed %.1f ms after the kill: %s\n", rank, ms,
                     s.ToString().c_str());
        if (s.code() != StatusCode::kUnavailable ||
            std::string(s.message()).find("exited (shared memory)") == std::string::npos ||
            std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()) !=
                std::vector<int>{kVictim}) {
          return InternalError("wrong failure: " + s.ToString());
        }
        if (ms > 2000) return InternalError("noticed only " + std::to_string(ms) + " ms later");
        return Status::Ok();
      },
      [&](ForkedRanks& ranks, const std::string& address) {
        auto store = TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(5000));
        store.status().CheckOk("parent store");
        (*store)
            ->Wait(std::vector<std::string>{"looping/0", "looping/1", "looping/2"},
                   Deadline::AfterMs(30000))
            .CheckOk("ranks looping");
        std::this_thread::sleep_for(milliseconds(200));
        const auto killed_at = Clock::now().time_since_epoch();
        ranks.Kill(kVictim);
        (*store)
            ->Set("killed_at",
                  std::to_string(
                      std::chrono::duration_cast<std::chrono::nanoseconds>(killed_at).count()),
                  Deadline::AfterMs(5000))
            .CheckOk("killed_at");
      });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[kVictim], 128 + SIGKILL);
  EXPECT_EQ(codes[2], 0);
}

// Both ranks run large allreduces; another thread of rank 0 aborts it meanwhile: rank 0's call
// returns kAborted within 100 ms (at its next chunk, though its peer keeps up), rank 1's
// kUnavailable naming rank 0, in shared memory. Failed before the staging path (rank 1's
// failure came from the TCP pair).
TEST(GlooShmTest, AbortFromAnotherThreadStopsALargeOperation) {
  std::vector<int> codes = RunForked(2, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "abort-large", rank, 2, true));
    if (!comm->shared_memory()) return InternalError("no shared memory");
    std::atomic<int64_t> aborted_at{0};
    std::thread aborter;
    if (rank == 0) {
      aborter = std::thread([&] {
        store.Wait(std::vector<std::string>{"looping/0", "looping/1"}, Deadline::AfterMs(30000))
            .CheckOk("ranks looping");
        std::this_thread::sleep_for(milliseconds(150));
        aborted_at = Clock::now().time_since_epoch().count();
        comm->Abort();
      });
    }
    Status s = LoopLargeAllreduces(*comm, store, "looping/" + std::to_string(rank), kTimeout);
    const int64_t returned_at = Clock::now().time_since_epoch().count();
    if (rank == 1) {
      if (s.code() != StatusCode::kUnavailable ||
          std::string(s.message()).find("(shared memory)") == std::string::npos ||
          std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()) !=
              std::vector<int>{0}) {
        return InternalError("rank 1, its peer aborted: " + s.ToString());
      }
      return Status::Ok();
    }
    aborter.join();
    const double ms = static_cast<double>(returned_at - aborted_at.load()) / 1e6;
    std::fprintf(stderr, "rank 0: large allreduce returned %.3f ms after Abort(): %s\n", ms,
                 s.ToString().c_str());
    if (s.code() != StatusCode::kAborted || s.collective_failure() == nullptr ||
        s.collective_failure()->kind != CollectiveFailure::Kind::kAborted) {
      return InternalError("aborted large allreduce: " + s.ToString());
    }
    if (ms > 100) return InternalError("Abort() took " + std::to_string(ms) + " ms to stop it");
    return Status::Ok();
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Both ranks run large allreduces with a 500 ms timeout; the test SIGSTOPs rank 1 inside one.
// Rank 0 gets kDeadlineExceeded naming rank 1 at its timeout; once rank 1 runs again (SIGCONT)
// it gets kUnavailable naming rank 0, which left. Failed before the staging path (Gloo's
// "Timed out" over TCP, naming no rank).
TEST(GlooShmTest, StoppedPeerMidLargeOperationTimesOutNamingIt) {
  constexpr milliseconds kShort(500);
  std::vector<int> codes = RunForked(
      2,
      [&](int rank, TcpStoreClient& store) -> Status {
        MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "stop-large", rank, 2, true));
        if (!comm->shared_memory()) return InternalError("no shared memory");
        const Clock::time_point start = Clock::now();
        Status s = LoopLargeAllreduces(*comm, store, "looping/" + std::to_string(rank), kShort);
        std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
        if (rank == 1) {
          if (s.code() != StatusCode::kUnavailable ||
              std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()) !=
                  std::vector<int>{0}) {
            return InternalError("rank 1 after it ran again: " + s.ToString());
          }
          return Status::Ok();
        }
        MORPH_RETURN_IF_ERROR(store.Set("timed_out", "1", Deadline::AfterMs(5000)));
        if (s.code() != StatusCode::kDeadlineExceeded ||
            std::string(s.message()).find("rank(s) 1 had not arrived (shared memory)") ==
                std::string::npos ||
            s.collective_failure() == nullptr ||
            s.collective_failure()->kind != CollectiveFailure::Kind::kTimeout) {
          return InternalError("rank 0, its peer stopped: " + s.ToString());
        }
        if (Clock::now() - start > std::chrono::seconds(20)) return InternalError("late");
        return Status::Ok();
      },
      [&](ForkedRanks& ranks, const std::string& address) {
        auto store = TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(5000));
        store.status().CheckOk("parent store");
        (*store)
            ->Wait(std::vector<std::string>{"looping/0", "looping/1"}, Deadline::AfterMs(30000))
            .CheckOk("ranks looping");
        std::this_thread::sleep_for(milliseconds(100));
        kill(ranks.pid(1), SIGSTOP);
        (*store)
            ->Wait(std::vector<std::string>{"timed_out"}, Deadline::AfterMs(30000))
            .CheckOk("rank 0 timed out");
        kill(ranks.pid(1), SIGCONT);
      });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// A silent peer: kDeadlineExceeded at the timeout, naming the late rank in the message; the late
// rank then fails at once (rank 0 left) instead of waiting for its own timeout. A peer that
// destroyed its communicator fails a wait for it at once too.
TEST(GlooShmTest, TimeoutAndDestroyedPeer) {
  std::vector<int> codes = RunForked(2, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "timeout", rank, 2, true));
    MORPH_ASSIGN_OR_RETURN(auto other, Build(store, "destroyed", rank, 2, true));
    if (!comm->shared_memory() || !other->shared_memory()) return InternalError("no shm");
    int32_t v = rank + 1;  // what ExpectPeerLeft expects of rank 0
    if (rank == 0) {
      const Clock::time_point start = Clock::now();
      Status s = comm->Allreduce(&v, 1, DType::kI32, ReduceOp::kSum, milliseconds(300));
      if (s.code() != StatusCode::kDeadlineExceeded ||
          std::string(s.message()).find("rank(s) 1 had not arrived") == std::string::npos ||
          s.collective_failure() == nullptr ||
          s.collective_failure()->kind != CollectiveFailure::Kind::kTimeout) {
        return InternalError("timed-out allreduce: " + s.ToString());
      }
      if (Clock::now() - start > std::chrono::seconds(2)) return InternalError("late timeout");
      MORPH_RETURN_IF_ERROR(store.Set("timed_out", "1", Deadline::AfterMs(5000)));
      other.reset();  // rank 1 waits for it below
      return Status::Ok();
    }
    MORPH_RETURN_IF_ERROR(
        store.Wait(std::vector<std::string>{"timed_out"}, Deadline::AfterMs(20000)));
    MORPH_RETURN_IF_ERROR(ExpectPeerLeft(*comm, 0));
    const Clock::time_point start = Clock::now();
    Status s = other->Barrier(kTimeout);
    if (s.code() != StatusCode::kUnavailable || s.failed_peers().size() != 1 ||
        s.failed_peers()[0] != 0 || Clock::now() - start > std::chrono::seconds(2)) {
      return InternalError("barrier with a destroyed peer: " + s.ToString());
    }
    return Status::Ok();
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Broadcasts of every size from 1 B to the 64 KiB buffer, the receivers lagging now and then,
// allreduces in between: every receiver gets every broadcast's bytes.
TEST(GlooShmTest, EveryReceiverGetsEveryBroadcast) {
  constexpr int kWorld = 4, kRoot = 2, kTotal = 200;
  std::vector<int> codes = RunForked(kWorld, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "broadcasts", rank, kWorld, true));
    if (!comm->shared_memory()) return InternalError("no shared memory");
    for (int i = 0; i < kTotal; ++i) {
      if (rank != kRoot && i % 16 == rank) std::this_thread::sleep_for(milliseconds(2));
      MORPH_RETURN_IF_ERROR(BroadcastAndCheck(*comm, kRoot, i, kTimeout));
      if (i % 50 == 49) {
        int64_t v = rank + i;
        MORPH_RETURN_IF_ERROR(comm->Allreduce(&v, 1, DType::kI64, ReduceOp::kSum, kTimeout));
        if (v != int64_t{kWorld} * i + kWorld * (kWorld - 1) / 2) {
          return InternalError("allreduce after broadcast " + std::to_string(i) + ": " +
                               std::to_string(v));
        }
      }
    }
    return Status::Ok();
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Point-to-point through the pair rings, against the same exchanges over TCP: a ring exchange
// (each rank sends to r+1 and receives from r-1 in one operation) of every size from 0 B across
// the slot size to 1 MiB + 3, three messages to one peer in one operation, and an operation's
// messages matched in order across operations. Failed before the rings existed (send/recv went
// over TCP even on one host: 356 us for 8 B at 2 ranks).
TEST_P(GlooShmWorldTest, PointToPointThroughSharedMemoryMatchesTcp) {
  const int world = GetParam();
  if (world < 2) GTEST_SKIP() << "point-to-point needs two ranks";
  std::vector<int> codes = RunForked(world, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto shm, Build(store, "p2p-shm", rank, world, true));
    MORPH_ASSIGN_OR_RETURN(auto tcp, Build(store, "p2p-tcp", rank, world, false));
    if (!shm->shared_memory() || tcp->shared_memory()) return InternalError("paths");
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    const size_t sizes[] = {0, 1, 8, 4097, ShmCollectives::kP2PSlotBytes,
                            ShmCollectives::kP2PSlotBytes + 1, (size_t{1} << 20) + 3};
    int round = 0;
    for (size_t bytes : sizes) {
      for (GlooCommunicator* c : {shm.get(), tcp.get()}) {
        // Three messages to `next` (sizes bytes, 1, bytes / 2), three from `prev`.
        std::vector<std::vector<uint8_t>> out = {Pattern(rank * 7 + round, bytes),
                                                 Pattern(rank * 7 + round + 1, 1),
                                                 Pattern(rank * 7 + round + 2, bytes / 2)};
        std::vector<std::vector<uint8_t>> in = {std::vector<uint8_t>(bytes, 0xee),
                                                std::vector<uint8_t>(1, 0xee),
                                                std::vector<uint8_t>(bytes / 2, 0xee)};
        std::vector<P2POp> ops;
        for (size_t i = 0; i < 3; ++i) {
          ops.push_back({P2POp::Kind::kRecv, prev, in[i].data(), in[i].size()});
          ops.push_back({P2POp::Kind::kSend, next, out[i].data(), out[i].size()});
        }
        MORPH_RETURN_IF_ERROR(c->SendRecv(ops, kTimeout)) << "size " << bytes;
        if (in[0] != Pattern(prev * 7 + round, bytes) || in[1] != Pattern(prev * 7 + round + 1, 1) ||
            in[2] != Pattern(prev * 7 + round + 2, bytes / 2)) {
          return InternalError("size " + std::to_string(bytes) + " on " +
                               (c == shm.get() ? "shared memory" : "TCP") + ": wrong bytes");
        }
      }
      ++round;
    }
    // Sends of one operation matched by receives of two (in order, across operations).
    std::vector<uint8_t> a = Pattern(100 + rank, 5000), b = Pattern(200 + rank, 70000);
    std::vector<uint8_t> ra(5000), rb(70000);
    if (rank == 0) {
      MORPH_RETURN_IF_ERROR(shm->SendRecv({{P2POp::Kind::kSend, 1, a.data(), a.size()}}, kTimeout));
      MORPH_RETURN_IF_ERROR(shm->SendRecv({{P2POp::Kind::kSend, 1, b.data(), b.size()}}, kTimeout));
    } else if (rank == 1) {
      MORPH_RETURN_IF_ERROR(shm->SendRecv({{P2POp::Kind::kRecv, 0, ra.data(), ra.size()}}, kTimeout));
      MORPH_RETURN_IF_ERROR(shm->SendRecv({{P2POp::Kind::kRecv, 0, rb.data(), rb.size()}}, kTimeout));
      if (ra != Pattern(100, 5000) || rb != Pattern(200, 70000)) {
        return InternalError("messages across operations out of order");
      }
    }
    return shm->Barrier(kTimeout);
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// A receiver that expects other counts than its sender sends gets kInternal naming them, before
// it copies anything.
TEST(GlooShmTest, PointToPointCountMismatchIsNamed) {
  std::vector<int> codes = RunForked(2, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "p2p-counts", rank, 2, true));
    if (!comm->shared_memory()) return InternalError("no shared memory");
    std::vector<uint8_t> buf(8, 1);
    if (rank == 0) {  // two messages to rank 1, which expects one (eager: this call returns)
      return comm->SendRecv({{P2POp::Kind::kSend, 1, buf.data(), 8},
                             {P2POp::Kind::kSend, 1, buf.data(), 8}},
                            kTimeout);
    }
    std::vector<uint8_t> in(8, 0xee);
    Status s = comm->SendRecv({{P2POp::Kind::kRecv, 0, in.data(), 8}}, kTimeout);
    if (s.code() != StatusCode::kInternal ||
        std::string(s.message()).find("peer 0 sends 2 messages, this rank receives 1") ==
            std::string::npos) {
      return InternalError("count mismatch: " + s.ToString());
    }
    if (in != std::vector<uint8_t>(8, 0xee)) return InternalError("bytes copied");
    return Status::Ok();
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

// A receiver whose sender is SIGKILLed while it sleeps waiting gets kUnavailable naming it.
TEST(GlooShmTest, PointToPointFromAKilledSenderIsUnavailable) {
  std::vector<int> codes = RunForked(
      2,
      [&](int rank, TcpStoreClient& store) -> Status {
        MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "p2p-kill", rank, 2, true));
        if (!comm->shared_memory()) return InternalError("no shared memory");
        if (rank == 0) {
          std::this_thread::sleep_for(std::chrono::seconds(30));  // killed meanwhile
          return InternalError("rank 0 was not killed");
        }
        std::vector<uint8_t> buf(8);
        MORPH_RETURN_IF_ERROR(store.Set("waiting", "1", Deadline::AfterMs(5000)));
        const Clock::time_point start = Clock::now();
        Status s = comm->SendRecv({{P2POp::Kind::kRecv, 0, buf.data(), 8}}, kTimeout);
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
        std::fprintf(stderr, "rank 1: %s after %.0f ms\n", s.ToString().c_str(), ms);
        if (s.code() != StatusCode::kUnavailable ||
            std::vector<int>(s.failed_peers().begin(), s.failed_peers().end()) !=
                std::vector<int>{0}) {
          return InternalError("receive from a killed sender: " + s.ToString());
        }
        if (ms > 5000) return InternalError("noticed after " + std::to_string(ms) + " ms");
        return Status::Ok();
      },
      [&](ForkedRanks& ranks, const std::string& address) {
        auto store = TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(5000));
        store.status().CheckOk("parent store");
        (*store)->Wait(std::vector<std::string>{"waiting"}, Deadline::AfterMs(30000))
            .CheckOk("rank 1 ready");
        std::this_thread::sleep_for(milliseconds(300));  // rank 1 sleeps on its doorbell
        ranks.Kill(0);
      });
  EXPECT_EQ(codes[0], 128 + SIGKILL);
  EXPECT_EQ(codes[1], 0);
}

// Ranks whose calls differ (a program's mistake): every rank gets kInvalidArgument naming both
// calls, nothing is read, and the communicator goes on (the next call is right on every rank).
// On shared memory and over TCP; sizes within and beyond the shared-memory slot (ranks that
// take different paths for their calls meet in the same operation). Failed before the
// comparison: wrong sums on every rank, or Gloo's EnforceNotMet ending the process.
class GlooDisagreementTest : public ::testing::TestWithParam<bool> {};

TEST_P(GlooDisagreementTest, CallsThatDifferFailOnEveryRankAndTheCommunicatorGoesOn) {
  const bool shm = GetParam();
  constexpr int kWorld = 3;
  std::vector<int> codes = RunForked(kWorld, [&](int rank, TcpStoreClient& store) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto comm, Build(store, "differ", rank, kWorld, shm));
    if (comm->shared_memory() != shm) return InternalError("shared memory not as asked");
    std::vector<float> big(size_t{1} << 20, 1.0f);  // 4 MiB: beyond the slot
    std::vector<double> d(8, 1.0);
    struct Case {
      const char* name;
      std::function<Status()> call;
    };
    const bool odd = rank == 1;
    const std::vector<Case> cases = {
        {"sizes",
         [&] {
           return comm->Allreduce(big.data(), odd ? 8 : 4, DType::kF32, ReduceOp::kSum, kTimeout);
         }},
        {"large sizes",
         [&] {
           return comm->Allreduce(big.data(), odd ? big.size() : big.size() / 2, DType::kF32,
                                  ReduceOp::kSum, kTimeout);
         }},
        {"large kinds",
         [&] {
           return odd ? comm->Allgather(big.data(), big.data() + big.size() / 2, big.size() / 8,
                                        DType::kF32, kTimeout)
                      : comm->ReduceScatter(big.data(), big.data() + big.size() / 2, big.size() / 8,
                                            DType::kF32, ReduceOp::kSum, kTimeout);
         }},
        {"small against large",
         [&] {
           return comm->Allreduce(big.data(), odd ? big.size() : 8, DType::kF32, ReduceOp::kSum,
                                  kTimeout);
         }},
        {"types",
         [&] {
           return comm->Allreduce(odd ? static_cast<void*>(d.data()) : big.data(), 4,
                                  odd ? DType::kF64 : DType::kF32, ReduceOp::kSum, kTimeout);
         }},
        {"reductions",
         [&] {
           return comm->Allreduce(big.data(), 4, DType::kF32, odd ? ReduceOp::kMax : ReduceOp::kSum,
                                  kTimeout);
         }},
        {"kinds",
         [&] {
           return odd ? comm->Broadcast(big.data(), 4, DType::kF32, 0, kTimeout)
                      : comm->Allreduce(big.data(), 4, DType::kF32, ReduceOp::kSum, kTimeout);
         }},
        {"roots",
         [&] { return comm->Broadcast(big.data(), 4, DType::kF32, odd ? 1 : 0, kTimeout); }},
        {"allgather sizes",
         [&] { return comm->Allgather(d.data(), big.data(), odd ? 2 : 1, DType::kF64, kTimeout); }},
    };
    for (const Case& c : cases) {
      const std::vector<float> before(big.begin(), big.begin() + 16);
      Status s = c.call();
      if (s.code() != StatusCode::kInvalidArgument ||
          std::string(s.message()).find("the ranks' calls differ: rank ") == std::string::npos) {
        return InternalError(std::string(c.name) + ": not kInvalidArgument naming the calls: " +
                             s.ToString());
      }
      if (!std::equal(before.begin(), before.end(), big.begin())) {
        return InternalError(std::string(c.name) + ": the buffer changed");
      }
      if (comm->broken()) return InternalError(std::string(c.name) + ": broken");
    }
    int64_t v = rank + 1;
    MORPH_RETURN_IF_ERROR(comm->Allreduce(&v, 1, DType::kI64, ReduceOp::kSum, kTimeout));
    if (v != kWorld * (kWorld + 1) / 2) return InternalError("after: " + std::to_string(v));
    return Status::Ok();
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(SharedMemoryAndTcp, GlooDisagreementTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "shm" : "tcp";
                         });

}  // namespace
}  // namespace morph
