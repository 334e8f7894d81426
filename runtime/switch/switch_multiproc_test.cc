// The switch engine across OS processes (labels multiproc, fault): forked workers switch
// dp 2 -> 4 over Gloo through a TCP store, and one old rank SIGKILLs itself after the first
// batch (a crash mid-transfer: no abort, no goodbye, the kernel closes its sockets). Every other
// worker must fail within its timeouts, at least one naming the dead worker, and keep what the
// switch documents: its old config and rank, and the old shards not yet released bitwise intact.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/store/tcp_store.h"
#include "reshard/reshard_testutil.h"
#include "runtime/switch/switch.h"
#include "runtime/plan/plan_input.h"

namespace morph {
namespace {

constexpr char kToken[] = "switch-multiproc-token";
using Clock = std::chrono::steady_clock;

ParallelConfig Dp(int dp) {
  return ParallelConfig{.dp = dp, .tp = 1, .pp = 1, .stage_of_layer = {0, 0}, .zero_stage = 1};
}

JobManifest Manifest() {
  JobManifest m;
  m.model.num_layers = 2;
  m.tensors = {
      {"w", DType::kF32, {64, 48}, Layout::Layer(0)},
      {"w.exp_avg", DType::kF32, {64, 48}, Layout::Layer(0).ZeroShard()},
      {"v", DType::kBF16, {96, 40}, Layout::Layer(1)},
      {"v.exp_avg", DType::kF32, {96, 40}, Layout::Layer(1).ZeroShard()},
      {"ln.exp_avg", DType::kF32, {77}, Layout::Layer(1).ZeroShard()},
  };
  m.scalars = {{"step", 8}};
  m.chunk_bytes = 4096;
  m.staging_bytes = 16384;
  return m;
}

std::vector<char> Slice(const JobManifest& m, size_t t, const Shard& s) {
  const TensorSpec& spec = m.tensors[t];
  const TensorInfo info{spec.name, spec.dtype, spec.shape};
  return testutil::ExtractShard(info, s, testutil::ReferenceTensor(info, static_cast<int>(t)));
}

void SwitchWithACrash(bool shared_memory) {
  constexpr WorkerId kVictim = 11;
  const JobManifest m = Manifest();
  const Generation from{.id = 1, .start_step = 10, .config = Dp(2), .ranks = {10, 11}};
  PrepareMsg p{.from_generation = 1, .from = from};
  p.next.id = 2;
  p.next.config = Dp(4);
  const std::vector<WorkerId> workers = {10, 11, 12, 13};
  MORPH_ASSERT_OK_AND_ASSIGN(p.next.ranks, AssignRanks(m, from, {}, workers, p.next.config));
  p.change.participants = ParticipantOrder(from, {}, p.next.ranks);
  MORPH_ASSERT_OK_AND_ASSIGN(ChangePlan plan, PlanForChange(m, from, p.next, p.change));
  p.next.plan_digest = plan.digest;
  const CommitMsg commit{p.next, p.from_generation, p.from, p.change};

  ForkedRanks ranks = ForkedRanks::Fork(4, [&](int i, const std::string& address) {
    const WorkerId me = workers[static_cast<size_t>(i)];
    Status s = [&]() -> Status {
      StateStore state;
      for (const TensorSpec& t : m.tensors) {
        MORPH_RETURN_IF_ERROR(state.AddTensor(t.name, t.shape, t.dtype, t.layout));
      }
      MORPH_RETURN_IF_ERROR(state.AddScalar("step", 8));
      const int old_rank = from.RankOf(me);
      if (old_rank >= 0) {
        MORPH_RETURN_IF_ERROR(state.Materialize(from.config, old_rank));
        for (size_t t = 0; t < m.tensors.size(); ++t) {
          State::TensorRef r = state.TensorAt(t);
          const std::vector<char> want = Slice(m, t, r.shard);
          if (!want.empty()) std::memcpy(r.data.data, want.data(), want.size());
        }
      }
      MORPH_ASSIGN_OR_RETURN(auto store,
                             TcpStoreClient::Connect(address, kToken, 2, Deadline::AfterMs(20000)));
      SwitchOptions o;
      o.batch_bytes = 0;  // one tensor per batch: the crash lands between batches
      o.timeout = std::chrono::seconds(5);
      o.transport.shared_memory = shared_memory;
      if (me == kVictim) {
        o.after_batch = [](int batch) {
          if (batch == 0) raise(SIGKILL);
        };
      }
      MORPH_ASSIGN_OR_RETURN(auto device, GlooDevice::Create(GlooOptions{}));
      MORPH_ASSIGN_OR_RETURN(auto sw, PrepareSwitch(m, me, p, *store, GlooFactory(device), o,
                                                    Deadline::AfterMs(20000)));
      // As the protocol does: the commit (here: everyone's "prepared" key) comes only once every
      // participant finished its prepare, so the victim cannot die while a peer still builds
      // its groups (that would be a failure of the prepare, not of the transfer under test).
      MORPH_RETURN_IF_ERROR(
          store->Set("prepared/" + std::to_string(me), "1", Deadline::AfterMs(5000)));
      std::vector<std::string> prepared;
      for (WorkerId w : workers) prepared.push_back("prepared/" + std::to_string(w));
      MORPH_RETURN_IF_ERROR(store->Wait(prepared, Deadline::AfterMs(20000)));
      const auto start = Clock::now();
      Status r = ExecuteSwitch(*sw, commit, state, Deadline::AfterMs(20000)).status();
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      std::fprintf(stderr, "worker %lld: switch returned after %.3f s: %s\n",
                   static_cast<long long>(me), seconds, r.ToString().c_str());
      char head[64];
      std::snprintf(head, sizeof(head), "%d %.6f ", static_cast<int>(r.code()), seconds);
      MORPH_RETURN_IF_ERROR(store->Set("result/" + std::to_string(me),
                                       head + std::string(r.message()), Deadline::AfterMs(5000)));
      if (r.ok()) return InternalError("the switch succeeded without the victim");
      // What the State holds after a failed switch (switch.h, "Failure").
      if (state.rank() != old_rank) return InternalError("rank changed");
      if (old_rank >= 0 && !(state.config() && *state.config() == from.config)) {
        return InternalError("config changed");
      }
      for (size_t t = 0; t < m.tensors.size(); ++t) {
        State::TensorRef ref = state.TensorAt(t);
        if (ref.data.bytes == 0) continue;  // released by a batch that completed
        const std::vector<char> want = Slice(m, t, ref.shard);
        if (want.size() != ref.data.bytes || std::memcmp(want.data(), ref.data.data, want.size())) {
          return InternalError("old shard of " + m.tensors[t].name + " was modified");
        }
      }
      return Status::Ok();
    }();
    return ExitCode(static_cast<int>(me), s);
  });
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  ranks.Release(server->address());
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto client, TcpStoreClient::Connect(server->address(), kToken, 2, Deadline::AfterMs(5000)));
  int named = 0;
  for (WorkerId w : workers) {
    if (w == kVictim) continue;
    MORPH_ASSERT_OK_AND_ASSIGN(
        std::string v, client->Get("result/" + std::to_string(w), Deadline::AfterMs(40000)));
    int code = 0, used = 0;
    double seconds = 0;
    std::sscanf(v.c_str(), "%d %lf %n", &code, &seconds, &used);
    const std::string message = v.substr(static_cast<size_t>(used));
    const StatusCode c = static_cast<StatusCode>(code);
    EXPECT_TRUE(c == StatusCode::kUnavailable || c == StatusCode::kAborted ||
                c == StatusCode::kDeadlineExceeded)
        << "worker " << w << ": " << message;
    EXPECT_LT(seconds, 7.0) << "worker " << w << ": bounded by the 5 s timeout";
    if (message.find("worker 11") != std::string::npos) ++named;
  }
  EXPECT_GE(named, 1) << "no worker named the one that was killed";
  std::vector<int> codes = ranks.Wait(Deadline::AfterMs(30000));
  for (int i = 0; i < 4; ++i) {
    if (workers[static_cast<size_t>(i)] == kVictim) {
      EXPECT_EQ(codes[static_cast<size_t>(i)], 128 + SIGKILL);
    } else {
      EXPECT_EQ(codes[static_cast<size_t>(i)], 0) << "worker " << workers[static_cast<size_t>(i)];
    }
  }
}

TEST(SwitchMultiprocTest, WorkerKilledMidTransferOverTcp) { SwitchWithACrash(false); }
TEST(SwitchMultiprocTest, WorkerKilledMidTransferOverSharedMemory) { SwitchWithACrash(true); }

}  // namespace
}  // namespace morph
