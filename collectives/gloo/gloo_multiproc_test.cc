// Gloo backend with ranks as forked processes over the TCP store (label multiproc): every
// collective against reference results for world sizes 1 to 8, and the documented reduction
// order bit for bit.
#include <gtest/gtest.h>

#include <cstdint>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/store/tcp_store.h"
#include "collectives/testing/collective_checks.h"
#include "collectives/testing/rank_harness.h"

namespace morph {
namespace {

constexpr char kToken[] = "multiproc-token";

class GlooForkedTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooForkedTest, EveryCollectiveMatchesTheReference) {
  const int world = GetParam();
  // Fork first, start the server's thread after (see ForkedRanks::Fork).
  ForkedRanks ranks = ForkedRanks::Fork(world, [&](int rank, const std::string& address) {
    Status s = [&]() -> Status {
      MORPH_ASSIGN_OR_RETURN(auto store,
                             TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
      MORPH_ASSIGN_OR_RETURN(auto comm,
                             GlooCommunicator::Create(*store, "world", rank, world, nullptr,
                                                      Deadline::AfterMs(20000)));
      MORPH_RETURN_IF_ERROR(CheckAllCollectives(*comm, std::chrono::seconds(20)));
      // On one host every size reduces in rank order (shared memory).
      return CheckReductionOrder(
          *comm, comm->shared_memory() ? SIZE_MAX : GlooCommunicator::kOneShotMaxBytes,
          std::chrono::seconds(20));
    }();
    return ExitCode(rank, s);
  });
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  ranks.Release(server->address());
  std::vector<int> codes = ranks.Wait(Deadline::AfterMs(60000));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooForkedTest, ::testing::Range(1, 9));

}  // namespace
}  // namespace morph
