// CommTransport over Gloo between forked ranks (label multiproc): an all-to-all exchange in
// two groups, bitwise checked, then Abort.
#include "collectives/comm_transport.h"

#include <gtest/gtest.h>

#include "base/testing.h"
#include "collectives/gloo_communicator.h"
#include "collectives/rank_harness.h"
#include "collectives/tcp_store.h"

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
  // No strided ops (SupportsStridedOps() is false): rejected before anything is posted.
  if (transport.SupportsStridedOps()) return InternalError("claims strided ops");
  char byte = 0;
  StridedLayout layout{nullptr, 1, 0, 1};
  std::vector<SendOp> strided_send{{(rank + 1) % world, &byte, 1, &layout}};
  std::vector<RecvOp> strided_recv{{(rank + 1) % world, &byte, 1, &layout}};
  if (transport.Start(strided_send, {}).status().code() != StatusCode::kInvalidArgument ||
      transport.Start({}, strided_recv).status().code() != StatusCode::kInvalidArgument) {
    return InternalError("strided op accepted");
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

}  // namespace
}  // namespace morph
