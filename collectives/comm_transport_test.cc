// CommTransport over Gloo between forked ranks (label multiproc): an all-to-all exchange in
// two groups, bitwise checked, then Abort.
#include "collectives/comm_transport.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/shm/shm_arena.h"
#include "collectives/store/tcp_store.h"
#include "reshard/strided_copy.h"

namespace morph {
namespace {

constexpr char kToken[] = "transport-token";

uint8_t Byte(int from, int to, int group, size_t i) {
  return static_cast<uint8_t>(from * 97 + to * 31 + group * 7 + i * 13);
}

uint64_t Tag(int from, int to, int group) {
  return (uint64_t{0x7a} << 56) | (uint64_t(from) << 32) | (uint64_t(to) << 16) | uint64_t(group);
}

Status Exchange(const std::string& address, int rank, int world) {
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "transport", rank, world,
                                                             nullptr, Deadline::AfterMs(20000)));
  CommTransport transport(comm.get(), std::chrono::seconds(20));
  if (transport.rank() != rank || transport.size() != world || transport.SupportsDeviceMemory()) {
    return InternalError("transport identity");
  }
  for (int group = 0; group < 2; ++group) {
    // Sizes differ per pair and are not multiples of anything in particular.
    auto bytes = [&](int from, int to) { return size_t(1000 * (from + 1) + 17 * to + group); };
    std::vector<std::vector<uint8_t>> out(world), in(world);
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    for (int peer = 0; peer < world; ++peer) {
      if (peer == rank) continue;
      out[peer].resize(bytes(rank, peer));
      for (size_t i = 0; i < out[peer].size(); ++i) out[peer][i] = Byte(rank, peer, group, i);
      in[peer].assign(bytes(peer, rank), 0);
      // Tags (transport.h) travel with the group and must match.
      sends.push_back({peer, out[peer].data(), out[peer].size(), nullptr, Tag(rank, peer, group)});
      recvs.push_back({peer, in[peer].data(), in[peer].size(), nullptr, Tag(peer, rank, group)});
    }
    MORPH_ASSIGN_OR_RETURN(auto work, transport.Start(sends, recvs));
    MORPH_RETURN_IF_ERROR(work->Wait(Deadline::AfterMs(20000)));
    for (int peer = 0; peer < world; ++peer) {
      for (size_t i = 0; i < in[peer].size(); ++i) {
        if (in[peer][i] != Byte(peer, rank, group, i)) {
          return InternalError("group " + std::to_string(group) + " from " + std::to_string(peer) +
                               " byte " + std::to_string(i));
        }
      }
    }
  }
  {
    // A ring (rank r sends to r+1) where rank 2 expects the wrong tag from rank 1.
    std::vector<char> out(64, 'a'), in(64);
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    std::vector<SendOp> s1{{next, out.data(), out.size(), nullptr, Tag(rank, next, 9)}};
    const uint64_t want = rank == 2 && prev == 1 ? 12345 : Tag(prev, rank, 9);
    std::vector<RecvOp> r1{{prev, in.data(), in.size(), nullptr, want}};
    MORPH_ASSIGN_OR_RETURN(auto work, transport.Start(s1, r1));
    Status st = work->Wait(Deadline::AfterMs(20000));
    if (rank == 2) {
      if (st.code() != StatusCode::kFailedPrecondition ||
          std::string(st.message()).find("tag mismatch: peer 1") == std::string::npos) {
        return InternalError("tag mismatch not detected: " + st.ToString());
      }
    } else {
      MORPH_RETURN_IF_ERROR(st) << "tagged ring";
    }
  }
  std::vector<SendOp> bad{{world, nullptr, 0}};
  if (transport.Start(bad, {}).status().code() != StatusCode::kInvalidArgument) {
    return InternalError("peer out of range accepted");
  }
  // Strided ops on host memory; a malformed layout is rejected before anything is posted.
  if (!transport.SupportsStridedOps()) return InternalError("no strided ops over Gloo");
  char byte = 0;
  StridedLayout no_geometry{nullptr, 1, 0, 1};
  std::vector<SendOp> strided_send{{(rank + 1) % world, &byte, 1, &no_geometry}};
  Status s = transport.Start(strided_send, {}).status();
  if (s.code() != StatusCode::kInvalidArgument ||
      s.message().find("without geometry") == std::string::npos) {
    return InternalError("strided send without geometry: " + s.ToString());
  }
  CopyGeometry g;
  g.num_elements = 4;
  StridedLayout too_long{&g, 2, 0, 4};  // 8 bytes, op says 1
  std::vector<RecvOp> strided_recv{{(rank + 1) % world, &byte, 1, &too_long}};
  s = transport.Start({}, strided_recv).status();
  if (s.code() != StatusCode::kInvalidArgument ||
      s.message().find("1 bytes but the layout holds 8") == std::string::npos) {
    return InternalError("strided receive of the wrong size: " + s.ToString());
  }
  transport.Abort();
  MORPH_ASSIGN_OR_RETURN(auto after, transport.Start({}, {}));
  if (after->Wait(Deadline::AfterMs(2000)).code() != StatusCode::kAborted) {
    return InternalError("not aborted");
  }
  return Status::Ok();
}

TEST(CommTransportTest, ExchangeBetweenForkedRanks) {
  constexpr int kWorld = 3;
  ForkedRanks ranks = ForkedRanks::Fork(kWorld, [&](int rank, const std::string& address) {
    return ExitCode(rank, Exchange(address, rank, kWorld));
  });
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  ranks.Release(server->address());
  std::vector<int> codes = ranks.Wait(Deadline::AfterMs(60000));
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Cross-memory attach is expected to work here unless Yama restricts ptrace.
bool ShmExpected() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  return !(f >> scope) || scope == 0;
}

uint16_t Elem(int from, int64_t i, int64_t j) {
  return static_cast<uint16_t>(from * 4099 + i * 131 + j * 7 + 1);
}

// Every rank holds a [R, K] u16 matrix (row stride K + 3) and sends column block d (W wide) to
// rank d; rank d lands sender s's block at rows [s R, (s + 1) R) of a [world R, W] matrix (row
// stride W + 5). Both sides strided, each message split in two (elements [0, h) and [h, R W)) over
// two groups; pairs with (s + d) % 3 == 0 send contiguously from a packed copy instead. Padding
// must stay untouched. With `arena`, the send buffers are ShmArena segments: same-host receivers
// must map them (every shared-memory message), else read them by process_vm_readv.
Status StridedExchange(const std::string& address, int rank, int world, bool shm, bool arena) {
  constexpr int64_t R = 37, W = 53;
  const int64_t K = W * world, src_stride = K + 3, dst_stride = W + 5;
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "strided", rank, world,
                                                             nullptr, Deadline::AfterMs(20000)));
  // TCP: Create with shared memory off (no handshake), as MORPH_RESHARD_SHM=0 does.
  ShmArena shm_arena;
  MORPH_ASSIGN_OR_RETURN(
      auto transport,
      CommTransport::Create(
          comm.get(), std::chrono::seconds(20),
          CommTransportOptions{.shared_memory = shm, .arena = arena ? &shm_arena : nullptr},
          Deadline::AfterMs(20000)));
  // Send-side memory: arena segments or plain vectors.
  std::vector<Buffer> segments;
  std::vector<std::vector<uint16_t>> vectors;
  auto alloc = [&](size_t n, uint16_t fill) -> StatusOr<uint16_t*> {
    uint16_t* p = nullptr;
    if (arena) {
      MORPH_ASSIGN_OR_RETURN(Buffer b, shm_arena.Allocate(n * sizeof(uint16_t)));
      p = static_cast<uint16_t*>(b.data());
      segments.push_back(std::move(b));
    } else {
      vectors.emplace_back(n);
      p = vectors.back().data();
    }
    std::fill(p, p + n, fill);
    return p;
  };
  for (int peer = 0; peer < world; ++peer) {
    if (peer == rank) continue;
    if (transport->IsSharedMemoryPeer(peer) != (shm && ShmExpected())) {
      return InternalError("peer " + std::to_string(peer) + " shared memory: " +
                           std::to_string(transport->IsSharedMemoryPeer(peer)));
    }
  }
  MORPH_ASSIGN_OR_RETURN(uint16_t* const src, alloc(static_cast<size_t>(R * src_stride), 0xEEEE));
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t j = 0; j < K; ++j) src[static_cast<size_t>(i * src_stride + j)] = Elem(rank, i, j);
  }
  std::vector<uint16_t> dst(static_cast<size_t>(world * R * dst_stride), 0xEEEE);
  const StridedView dense = ContiguousView({R, W});
  std::vector<CopyGeometry> send_g(world), recv_g(world);
  std::vector<uint16_t*> packed(world);
  for (int peer = 0; peer < world; ++peer) {
    MORPH_ASSIGN_OR_RETURN(send_g[peer],
                           MakeCopyGeometry(dense, StridedView{peer * W, {R, W}, {src_stride, 1}}));
    MORPH_ASSIGN_OR_RETURN(
        recv_g[peer],
        MakeCopyGeometry(StridedView{peer * R * dst_stride, {R, W}, {dst_stride, 1}}, dense));
    MORPH_ASSIGN_OR_RETURN(packed[peer], alloc(static_cast<size_t>(R * W), 0));
    HostStridedCopy(send_g[peer], packed[peer], src, 2, 0, R * W);
  }
  const int64_t half = R * W / 2 + 3;
  for (int group = 0; group < 2; ++group) {
    const int64_t b = group == 0 ? 0 : half, e = group == 0 ? half : R * W;
    const size_t bytes = static_cast<size_t>((e - b) * 2);
    std::vector<StridedLayout> layouts;
    layouts.reserve(2 * world);
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    for (int peer = 0; peer < world; ++peer) {
      if (peer == rank) continue;
      if ((rank + peer) % 3 == 0) {
        sends.push_back({peer, packed[peer] + b, bytes});
      } else {
        layouts.push_back({&send_g[peer], 2, b, e});
        sends.push_back({peer, src, bytes, &layouts.back()});
      }
      layouts.push_back({&recv_g[peer], 2, b, e});
      recvs.push_back({peer, dst.data(), bytes, &layouts.back()});
    }
    MORPH_ASSIGN_OR_RETURN(auto work, transport->Start(sends, recvs));
    MORPH_RETURN_IF_ERROR(work->Wait(Deadline::AfterMs(20000)));
  }
  for (int s = 0; s < world; ++s) {
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t j = 0; j < dst_stride; ++j) {
        const uint16_t want = s == rank || j >= W ? 0xEEEE : Elem(s, i, rank * W + j);
        if (dst[static_cast<size_t>((s * R + i) * dst_stride + j)] != want) {
          return InternalError("from rank " + std::to_string(s) + " element (" + std::to_string(i) +
                               ", " + std::to_string(j) + ") wrong");
        }
      }
    }
  }
  // Which path carried the shared-memory messages: two per peer.
  const ShmChannel::Stats st = transport->shm_stats();
  const uint64_t want = shm && ShmExpected() ? 2 * static_cast<uint64_t>(world - 1) : 0;
  if (st.mapped_messages != (arena ? want : 0) || st.vm_readv_messages != (arena ? 0 : want)) {
    return InternalError("shared-memory messages: " + std::to_string(st.mapped_messages) +
                         " mapped, " + std::to_string(st.vm_readv_messages) +
                         " by process_vm_readv; want " + std::to_string(want) +
                         (arena ? " mapped" : " by process_vm_readv"));
  }
  MORPH_RETURN_IF_ERROR(comm->Barrier(std::chrono::seconds(20)));
  // Every segment is freed with its buffer (receivers unmapped theirs at the end of their Wait).
  segments.clear();
  if (shm_arena.num_segments() != 0) return InternalError("segments left in the arena");
  return Status::Ok();
}

void RunStrided(bool shm, bool arena = false) {
  constexpr int kWorld = 4;
  ForkedRanks ranks = ForkedRanks::Fork(kWorld, [&](int rank, const std::string& address) {
    return ExitCode(rank, StridedExchange(address, rank, kWorld, shm, arena));
  });
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  ranks.Release(server->address());
  std::vector<int> codes = ranks.Wait(Deadline::AfterMs(60000));
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(CommTransportTest, StridedOpsOverTcpBitwise) { RunStrided(false); }
TEST(CommTransportTest, StridedOpsOverSharedMemoryBitwise) { RunStrided(true); }
TEST(CommTransportTest, StridedOpsFromShmArenaSegmentsBitwise) { RunStrided(true, true); }

// Over shared memory, rank 1 dies (SIGKILL) or aborts while rank 0 waits to send to it and
// rank 2 waits to receive from it: both fail promptly (not at the 20 s deadline) with
// kUnavailable / kAborted naming rank 1.
Status PeerGone(const std::string& address, int rank, bool kill) {
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "gone", rank, 3, nullptr,
                                                             Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto transport,
                         CommTransport::Create(comm.get(), std::chrono::seconds(20),
                                               CommTransportOptions{}, Deadline::AfterMs(20000)));
  if (!transport->IsSharedMemoryPeer((rank + 1) % 3)) {
    return ShmExpected() ? InternalError("no shared-memory peer") : Status::Ok();
  }
  std::vector<char> buf(1 << 20, 'x');
  if (rank == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others are waiting
    if (kill) raise(SIGKILL);
    transport->Abort();
    return Status::Ok();
  }
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  if (rank == 0) sends.push_back({1, buf.data(), buf.size()});
  if (rank == 2) recvs.push_back({1, buf.data(), buf.size()});
  MORPH_ASSIGN_OR_RETURN(auto work, transport->Start(sends, recvs));
  const auto start = std::chrono::steady_clock::now();
  Status s = work->Wait(Deadline::AfterMs(20000));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const StatusCode want = kill ? StatusCode::kUnavailable : StatusCode::kAborted;
  if (s.code() != want || s.message().find("peer rank 1") == std::string::npos) {
    return InternalError("rank " + std::to_string(rank) + " got " + s.ToString());
  }
  if (seconds > 3) return InternalError("took " + std::to_string(seconds) + " s to fail");
  return Status::Ok();
}

// Over shared memory, a receive of another size than the send: the receiver fails with
// kInternal naming both sizes, and the sender (whose receiver raised its abort flag) with
// kAborted naming the receiver.
Status SizeMismatch(const std::string& address, int rank) {
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "mismatch", rank, 2, nullptr,
                                                             Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto transport,
                         CommTransport::Create(comm.get(), std::chrono::seconds(20),
                                               CommTransportOptions{}, Deadline::AfterMs(20000)));
  if (!transport->IsSharedMemoryPeer(1 - rank)) {
    return ShmExpected() ? InternalError("no shared-memory peer") : Status::Ok();
  }
  std::vector<char> buf(200, 'x');
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  if (rank == 0) sends.push_back({1, buf.data(), 100});
  if (rank == 1) recvs.push_back({0, buf.data(), 200});
  MORPH_ASSIGN_OR_RETURN(auto work, transport->Start(sends, recvs));
  Status s = work->Wait(Deadline::AfterMs(20000));
  const bool ok = rank == 1
                      ? s.code() == StatusCode::kInternal &&
                            s.message().find("peer sends 100 bytes, this rank receives 200") !=
                                std::string::npos
                      : s.code() == StatusCode::kAborted &&
                            s.message().find("peer rank 1 aborted") != std::string::npos;
  return ok ? Status::Ok() : InternalError("rank " + std::to_string(rank) + " got " + s.ToString());
}

// Forks `n` ranks running fn(address, rank) against a fresh store server; their exit codes.
std::vector<int> RunForked(int n, const std::function<Status(const std::string&, int)>& fn,
                           int64_t timeout_ms) {
  ForkedRanks ranks = ForkedRanks::Fork(
      n, [&](int rank, const std::string& address) { return ExitCode(rank, fn(address, rank)); });
  auto server = TcpStoreServer::Start("127.0.0.1", 0, kToken);
  EXPECT_TRUE(server.ok()) << server.status();
  ranks.Release(server.ok() ? (*server)->address() : std::string());
  return ranks.Wait(Deadline::AfterMs(timeout_ms));
}

TEST(CommTransportTest, SharedMemorySizeMismatchIsInternal) {
  std::vector<int> codes = RunForked(2, SizeMismatch, 30000);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(CommTransportTest, SharedMemoryPeerKilledOrAbortedFailsOthersPromptly) {
  for (bool kill : {true, false}) {
    SCOPED_TRACE(kill ? "killed" : "aborted");
    ForkedRanks ranks = ForkedRanks::Fork(3, [&](int rank, const std::string& address) {
      return ExitCode(rank, PeerGone(address, rank, kill));
    });
    MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
    ranks.Release(server->address());
    std::vector<int> codes = ranks.Wait(Deadline::AfterMs(30000));
    EXPECT_EQ(codes[0], 0);
    EXPECT_EQ(codes[1], kill ? 128 + SIGKILL : 0);
    EXPECT_EQ(codes[2], 0);
  }
}

// A sender whose message lies in its ShmArena dies (SIGKILL) right after posting it: the
// receiver gets that message intact (its mapping holds the pages; or, if the sender was gone
// before the receiver mapped the segment, kUnavailable), and its next receive fails promptly with
// kUnavailable naming the sender. Under ASan this also shows the receiver never touches freed
// memory.
Status SegmentSenderKilled(const std::string& address, int rank) {
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "segkill", rank, 2, nullptr,
                                                             Deadline::AfterMs(20000)));
  ShmArena arena;
  MORPH_ASSIGN_OR_RETURN(
      auto transport,
      CommTransport::Create(comm.get(), std::chrono::seconds(20),
                            CommTransportOptions{.arena = &arena}, Deadline::AfterMs(20000)));
  if (!transport->IsSharedMemoryPeer(1 - rank)) {
    return ShmExpected() ? InternalError("no shared-memory peer") : Status::Ok();
  }
  constexpr size_t kBytes = size_t{16} << 20;
  if (rank == 1) {
    MORPH_ASSIGN_OR_RETURN(Buffer b, arena.Allocate(kBytes));
    auto* p = static_cast<uint8_t*>(b.data());
    for (size_t i = 0; i < kBytes; ++i) p[i] = Byte(1, 0, 0, i);
    std::vector<SendOp> sends{{0, b.data(), kBytes}};
    MORPH_ASSIGN_OR_RETURN(auto work, transport->Start(sends, {}));
    raise(SIGKILL);
  }
  std::vector<uint8_t> first(kBytes, 0), second(1 << 20, 0);
  std::vector<RecvOp> r1{{1, first.data(), kBytes}}, r2{{1, second.data(), second.size()}};
  MORPH_ASSIGN_OR_RETURN(auto w1, transport->Start({}, r1));
  MORPH_ASSIGN_OR_RETURN(auto w2, transport->Start({}, r2));
  const auto start = std::chrono::steady_clock::now();
  Status s1 = w1->Wait(Deadline::AfterMs(20000));
  auto gone = [](const Status& s) {
    return s.code() == StatusCode::kUnavailable && s.message().find("rank 1") != std::string::npos;
  };
  if (s1.ok()) {
    for (size_t i = 0; i < kBytes; ++i) {
      if (first[i] != Byte(1, 0, 0, i))
        return InternalError("byte " + std::to_string(i) + " wrong");
    }
    Status s2 = w2->Wait(Deadline::AfterMs(20000));
    if (!gone(s2)) return InternalError("second receive: " + s2.ToString());
  } else if (!gone(s1)) {
    return InternalError("first receive: " + s1.ToString());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (seconds > 3) return InternalError("took " + std::to_string(seconds) + " s to fail");
  return Status::Ok();
}

TEST(CommTransportTest, ShmArenaSenderKilledAfterPostingFailsReceiverPromptly) {
  for (int round = 0; round < 3; ++round) {
    ForkedRanks ranks = ForkedRanks::Fork(2, [&](int rank, const std::string& address) {
      return ExitCode(rank, SegmentSenderKilled(address, rank));
    });
    MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
    ranks.Release(server->address());
    std::vector<int> codes = ranks.Wait(Deadline::AfterMs(30000));
    EXPECT_EQ(codes[0], 0) << "round " << round;
    EXPECT_EQ(codes[1], 128 + SIGKILL) << "round " << round;
  }
}

// Segments of 2 MiB pages (ShmArena::Options::huge_pages): a receiver maps them at a 2 MiB
// boundary and copies each message bitwise, from any offset of the segment.
Status HugeSegmentExchange(const std::string& address, int rank) {
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(*store, "huge", rank, 2, nullptr,
                                                             Deadline::AfterMs(20000)));
  ShmArena arena(ShmArena::Options{.huge_pages = true});
  MORPH_ASSIGN_OR_RETURN(
      auto transport,
      CommTransport::Create(comm.get(), std::chrono::seconds(20),
                            CommTransportOptions{.arena = &arena}, Deadline::AfterMs(20000)));
  if (!transport->IsSharedMemoryPeer(1 - rank)) {
    return ShmExpected() ? InternalError("no shared-memory peer") : Status::Ok();
  }
  constexpr size_t kBytes = (size_t{5} << 20) + 12345;  // not a whole number of huge pages
  constexpr size_t kSplit = (size_t{3} << 20) + 77;
  if (rank == 1) {
    MORPH_ASSIGN_OR_RETURN(Buffer b, arena.Allocate(kBytes));
    auto* p = static_cast<uint8_t*>(b.data());
    for (size_t i = 0; i < kBytes; ++i) {
      if (p[i] != 0) return InternalError("segment not zero-filled at byte " + std::to_string(i));
      p[i] = Byte(1, 0, 0, i);
    }
    std::vector<SendOp> sends{{0, p, kSplit}, {0, p + kSplit, kBytes - kSplit}};
    MORPH_ASSIGN_OR_RETURN(auto work, transport->Start(sends, {}));
    MORPH_RETURN_IF_ERROR(work->Wait(Deadline::AfterMs(20000)));
  } else {
    std::vector<uint8_t> got(kBytes, 0);
    std::vector<RecvOp> recvs{{1, got.data(), kSplit}, {1, got.data() + kSplit, kBytes - kSplit}};
    MORPH_ASSIGN_OR_RETURN(auto work, transport->Start({}, recvs));
    MORPH_RETURN_IF_ERROR(work->Wait(Deadline::AfterMs(20000)));
    for (size_t i = 0; i < kBytes; ++i) {
      if (got[i] != Byte(1, 0, 0, i)) return InternalError("byte " + std::to_string(i) + " wrong");
    }
    if (transport->shm_stats().mapped_messages != 2) return InternalError("not mapped");
  }
  return comm->Barrier(std::chrono::seconds(20));
}

TEST(CommTransportTest, ShmArenaHugePageSegmentsBitwise) {
  std::vector<int> codes = RunForked(2, HugeSegmentExchange, 60000);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

// ShmArena::Options::huge_pages: a segment of 5 MiB + 1 B spans three 2 MiB pages, is zero-filled
// and writable, found by any interior address (its size the one asked for), and the collapsed
// bytes are counted while it lives. Where the kernel refuses MADV_COLLAPSE (before 6.1) the
// segment keeps 4 KiB pages and nothing is counted.
TEST(ShmArenaTest, HugePageSegments) {
  ShmArena arena(ShmArena::Options{.huge_pages = true});
  constexpr size_t kBytes = (size_t{5} << 20) + 1;
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer a, arena.Allocate(kBytes));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer small, arena.Allocate(4096));  // below 2 MiB: 4 KiB pages
  const auto* pa = static_cast<const uint8_t*>(a.data());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pa) % (size_t{2} << 20), 0u);
  EXPECT_TRUE(std::all_of(pa, pa + kBytes, [](uint8_t b) { return b == 0; }));
  std::memset(a.data(), 9, kBytes);
  auto seg = arena.Find(pa + kBytes - 1);
  ASSERT_TRUE(seg.has_value());
  EXPECT_EQ(seg->size, kBytes);
  if (arena.huge_bytes() == 0) {
    GTEST_SKIP() << "the kernel did not collapse the segment (MADV_COLLAPSE); 4 KiB pages";
  }
  EXPECT_EQ(arena.huge_bytes(), uint64_t{6} << 20);
  a = Buffer();
  EXPECT_EQ(arena.huge_bytes(), 0u);
  EXPECT_EQ(arena.num_segments(), 1u);
}

// ShmArena alone: segments are found by any interior address, and forgotten when freed.
TEST(ShmArenaTest, FindsLiveSegmentsOnly) {
  ShmArena arena;
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer a, arena.Allocate(3 << 20));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer b, arena.allocator()(4096));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer empty, arena.Allocate(0));
  EXPECT_EQ(empty.data(), nullptr);
  const char* pa = static_cast<const char*>(a.data());
  auto sa = arena.Find(pa + 12345);
  ASSERT_TRUE(sa.has_value());
  EXPECT_EQ(sa->base, reinterpret_cast<uint64_t>(pa));
  EXPECT_EQ(sa->size, uint64_t{3} << 20);
  const auto past_end = arena.Find(pa + (3 << 20));  // the next segment, if any, not this one
  EXPECT_TRUE(!past_end.has_value() || past_end->base != sa->base);
  EXPECT_TRUE(arena.Find(b.data()).has_value());
  EXPECT_FALSE(arena.Find(&arena).has_value());
  EXPECT_EQ(arena.num_segments(), 2u);
  std::memset(a.data(), 7, a.size());  // writable, zero-filled before
  a = Buffer();
  EXPECT_FALSE(arena.Find(pa + 12345).has_value());
  EXPECT_EQ(arena.num_segments(), 1u);
}

}  // namespace
}  // namespace morph
