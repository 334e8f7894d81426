// The device transport's logic on CPUs, through the same code as on a GPU: the reshard executor
// over DeviceTransport over fake NCCL communicators (collectives/fake_nccl.h), whose "device
// memory" is registered host memory and which refuse anything else. Bitwise results, one
// communicator group per transport group, union communicators whose ranks are not the
// participants', message tags, the staging bound, abort, a dead process and a reshard over the
// survivors' shrunk communicator.
#include "collectives/device_transport.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "base/testing.h"
#include "collectives/fake_nccl.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/union_comm.h"
#include "reshard/executor.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using namespace ::morph::testutil;  // NOLINT
constexpr std::chrono::milliseconds kTimeout(20000);

std::vector<std::vector<char>> Reference(const std::vector<TensorInfo>& tensors) {
  std::vector<std::vector<char>> ref;
  for (size_t i = 0; i < tensors.size(); ++i) {
    ref.push_back(ReferenceTensor(tensors[i], static_cast<int>(i)));
  }
  return ref;
}

// `processes` fake GPUs with one "world" communicator each; participant p of a plan runs on
// process process_of[p], whose world rank is its process number.
class DeviceWorld {
 public:
  explicit DeviceWorld(int processes)
      : device_(std::make_shared<FakeDevice>()),
        hub_(std::make_shared<FakeNcclHub>(processes, device_)),
        world_(static_cast<size_t>(processes)) {
    FirstError(RunRankThreads(processes, [&](int r) -> Status {
      MemoryStore store(table_, 1);
      MORPH_ASSIGN_OR_RETURN(world_[static_cast<size_t>(r)],
                             hub_->Factory(r)(store, "world", r, processes,
                                              Deadline::After(kTimeout)));
      return Status::Ok();
    })).CheckOk("fake world");
  }

  struct Result {
    std::vector<StatusOr<ExecutorStats>> stats;
    std::vector<ParticipantData> data;
  };

  // Runs every participant's plan on its process, over the world communicator with the
  // participants' ranks mapped. `before_wait`: called on a side thread once all started.
  Result Run(const std::vector<LocalPlan>& plans, const std::vector<std::vector<char>>& ref,
             const std::vector<int>& process_of, const ExecutorOptions& options,
             std::function<void()> side = nullptr, std::vector<Communicator*> comms = {}) {
    const size_t n = plans.size();
    Result r;
    for (const LocalPlan& p : plans) {
      r.data.push_back(MakeParticipantData(p, ref));
      r.stats.emplace_back(InternalError("not run"));
    }
    // The shards live in "device memory".
    for (ParticipantData& d : r.data) {
      for (auto& v : d.old_data) device_->Register(v.data(), v.size());
      for (auto& v : d.new_data) device_->Register(v.data(), v.size());
    }
    if (comms.empty()) {
      for (size_t p = 0; p < n; ++p) {
        comms.push_back(world_[static_cast<size_t>(process_of[p])].get());
      }
    }
    std::vector<int> map;
    for (size_t p = 0; p < n; ++p) map.push_back(comms[p]->rank());
    std::thread side_thread;
    if (side) side_thread = std::thread(side);
    std::vector<std::thread> threads;
    for (size_t p = 0; p < n; ++p) {
      threads.emplace_back([&, p] {
        auto t = DeviceTransport::Create(comms[p], map, device_->Memory(), kTimeout);
        if (!t.ok()) {
          r.stats[p] = t.status();
          return;
        }
        r.stats[p] = ExecutePlan(plans[p], r.data[p].olds, r.data[p].news, **t, options,
                                 Deadline::After(kTimeout));
        bounced_ += (*t)->bounced_bytes();
      });
    }
    for (auto& t : threads) t.join();
    if (side_thread.joinable()) side_thread.join();
    for (ParticipantData& d : r.data) {
      for (auto& v : d.old_data) device_->Unregister(v.data());
      for (auto& v : d.new_data) device_->Unregister(v.data());
    }
    return r;
  }

  static void ExpectMatch(const std::vector<LocalPlan>& plans, const Result& r,
                          const std::vector<std::vector<char>>& ref) {
    for (size_t p = 0; p < plans.size(); ++p) {
      MORPH_ASSERT_OK(r.stats[p]);
      for (size_t t = 0; t < plans[p].tensors.size(); ++t) {
        if (!plans[p].new_shards[t]) continue;
        ASSERT_EQ(r.data[p].new_data[t],
                  ExtractShard(plans[p].tensors[t], *plans[p].new_shards[t], ref[t]))
            << "participant " << p << " tensor " << plans[p].tensors[t].name;
      }
    }
  }

  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
  std::shared_ptr<FakeDevice> device_;
  std::shared_ptr<FakeNcclHub> hub_;
  std::vector<std::unique_ptr<Communicator>> world_;
  std::atomic<int64_t> bounced_{0};
};

ExecutorOptions Small() {
  ExecutorOptions o;
  o.chunk_bytes = 4096;
  o.staging_bytes = 64 << 10;
  return o;
}

std::vector<int> Identity(int n) {
  std::vector<int> v;
  for (int i = 0; i < n; ++i) v.push_back(i);
  return v;
}

// TP 4 -> 2 on both dims plus ZeRO 4 -> 3 with a joiner: bitwise; strided pieces are packed into
// device staging (the transport takes no strided op); host messages (handshake, tags) bounce
// through device memory; one communicator group per transport group.
TEST(DeviceTransportTest, ExecutorMovesDeviceStateBitwise) {
  std::vector<TensorInfo> tensors{{"w1", DType::kF32, {64, 96}},
                                  {"w2", DType::kBF16, {96, 64}},
                                  {"m", DType::kF32, {4000}}};
  std::vector<RegionLayout> old_l{TpLayout(tensors[0], 1, {0, 1, 2, 3}),
                                  TpLayout(tensors[1], 0, {0, 1, 2, 3}),
                                  FlatLayout(tensors[2], {0, 1, 2, 3})};
  std::vector<RegionLayout> new_l{TpLayout(tensors[0], 1, {0, 4}), TpLayout(tensors[1], 0, {0, 4}),
                                  FlatLayout(tensors[2], {0, 4, 1})};
  auto plans = BuildPlans(tensors, old_l, new_l, 5);
  auto ref = Reference(tensors);
  DeviceWorld w(5);
  auto r = w.Run(plans, ref, Identity(5), Small());
  DeviceWorld::ExpectMatch(plans, r, ref);
  int64_t groups = 0, staged = 0;
  for (size_t p = 0; p < plans.size(); ++p) {
    EXPECT_EQ(r.stats[p]->messages_strided, 0);
    staged += r.stats[p]->staging_peak_bytes;
    const bool talks = !plans[p].sends.empty() || !plans[p].recvs.empty();
    groups += r.stats[p]->rounds + (talks ? 1 : 0);  // + the handshake
  }
  EXPECT_GT(staged, 0);
  EXPECT_GT(w.device_->peak_bytes(), 0);  // staging and bounce buffers came from the device
  EXPECT_GT(w.bounced_.load(), 0);
  EXPECT_EQ(w.hub_->groups_started(), groups);
}

// The union communicator's ranks are not the participants': a world of 7 processes in which
// the 4 participants live on processes 5, 2, 6, 0 (a reused old world with spares, say).
TEST(DeviceTransportTest, RankMapOfAUnionCommunicator) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {48, 40}}, {"z", DType::kF16, {3000}}};
  std::vector<RegionLayout> old_l{TpLayout(tensors[0], 0, {0, 1, 2}),
                                  FlatLayout(tensors[1], {0, 1, 2})};
  std::vector<RegionLayout> new_l{TpLayout(tensors[0], 1, {1, 2, 3}),
                                  FlatLayout(tensors[1], {3, 2, 1, 0})};
  auto plans = BuildPlans(tensors, old_l, new_l, 4);
  auto ref = Reference(tensors);
  DeviceWorld w(7);
  auto r = w.Run(plans, ref, {5, 2, 6, 0}, Small());
  DeviceWorld::ExpectMatch(plans, r, ref);
}

// Random layouts, chunk and staging sizes: bitwise, within the staging bound.
TEST(DeviceTransportTest, RandomLayoutsWithinTheStagingBound) {
  std::mt19937_64 rng(testing::TestSeed());
  DeviceWorld w(6);
  for (int iter = 0; iter < 30; ++iter) {
    const int n = 2 + static_cast<int>(rng() % 5);
    std::vector<TensorInfo> tensors;
    std::vector<RegionLayout> old_l, new_l;
    const int nt = 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < nt; ++t) {
      TensorInfo info{"t" + std::to_string(t), t % 2 ? DType::kBF16 : DType::kF32,
                      {8 + static_cast<int64_t>(rng() % 40), 4 + static_cast<int64_t>(rng() % 40)}};
      old_l.push_back(RandomLayout(info, n, rng));
      new_l.push_back(RandomLayout(info, n, rng));
      tensors.push_back(info);
    }
    auto plans = BuildPlans(tensors, old_l, new_l, n);
    auto ref = Reference(tensors);
    ExecutorOptions o;
    o.chunk_bytes = 4096u << (rng() % 3);
    o.staging_bytes = o.chunk_bytes * (4 + rng() % 8);
    std::vector<int> procs = Identity(6);
    std::shuffle(procs.begin(), procs.end(), rng);
    procs.resize(static_cast<size_t>(n));
    auto r = w.Run(plans, ref, procs, o);
    SCOPED_TRACE("iteration " + std::to_string(iter));
    DeviceWorld::ExpectMatch(plans, r, ref);
    for (const auto& s : r.stats) {
      EXPECT_LE(static_cast<uint64_t>(s->staging_peak_bytes),
                std::max(o.staging_bytes, 2 * EffectiveChunkBytes(o, n)));
    }
  }
}

TEST(DeviceTransportTest, CreateChecksTheMap) {
  DeviceWorld w(3);
  Communicator* c = w.world_[1].get();
  auto make = [&](std::vector<int> map) {
    return DeviceTransport::Create(c, std::move(map), w.device_->Memory(), kTimeout).status();
  };
  EXPECT_THAT(make({}), StatusIs(StatusCode::kInvalidArgument, HasSubstr("no participant")));
  EXPECT_THAT(make({0, 0, 1}), StatusIs(StatusCode::kInvalidArgument, HasSubstr("another")));
  EXPECT_THAT(make({0, 5}), StatusIs(StatusCode::kInvalidArgument, HasSubstr("out of range")));
  EXPECT_THAT(make({0, 2}), StatusIs(StatusCode::kInvalidArgument, HasSubstr("no participant")));
  MORPH_ASSERT_OK_AND_ASSIGN(auto t, DeviceTransport::Create(c, {2, 1}, w.device_->Memory(),
                                                             kTimeout));
  EXPECT_EQ(t->rank(), 1);
  EXPECT_EQ(t->size(), 2);
  char host[8];
  StridedLayout l;
  std::vector<SendOp> strided{{0, host, 8, &l}};
  EXPECT_THAT(t->Start(strided, {}).status(), StatusIs(StatusCode::kInvalidArgument, ::testing::_));
  std::vector<SendOp> self{{1, host, 8}};
  EXPECT_THAT(t->Start(self, {}).status(), StatusIs(StatusCode::kInvalidArgument, ::testing::_));
}

// Tags travel per group and pair; a receive expecting other tags fails, naming the peer as a
// participant (not as its communicator rank).
TEST(DeviceTransportTest, TagMismatchNamesTheParticipant) {
  DeviceWorld w(4);
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer a, w.device_->Allocate(64));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer b, w.device_->Allocate(64));
  std::vector<int> map{3, 1};  // participant 0 on rank 3, participant 1 on rank 1
  std::vector<Status> s = RunRankThreads(2, [&](int p) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto t, DeviceTransport::Create(w.world_[p == 0 ? 3 : 1].get(), map,
                                                           w.device_->Memory(), kTimeout));
    std::vector<SendOp> sends;
    std::vector<RecvOp> recvs;
    if (p == 0) sends.push_back({1, a.data(), 64, nullptr, /*tag=*/7});
    if (p == 1) recvs.push_back({0, b.data(), 64, nullptr, /*tag=*/8});
    MORPH_ASSIGN_OR_RETURN(auto work, t->Start(sends, recvs));
    return work->Wait(Deadline::After(kTimeout));
  });
  MORPH_EXPECT_OK(s[0]);
  EXPECT_THAT(s[1], StatusIs(StatusCode::kFailedPrecondition,
                             HasSubstr("message tag mismatch: peer 0 sent 1 messages")));
}

// A participant aborts its transport from another thread mid-plan: it fails with kAborted, its
// peers fail too (no hang), and the failed peers they report are participants.
TEST(DeviceTransportTest, AbortFromAnotherThread) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {1024, 1024}}};
  auto plans = BuildPlans(tensors, {TpLayout(tensors[0], 1, {0, 1, 2, 3})},
                          {TpLayout(tensors[0], 1, {2, 3})}, 4);
  auto ref = Reference(tensors);
  DeviceWorld w(6);
  const std::vector<int> procs{4, 5, 1, 0};
  w.hub_->PauseDeliveryAt(512 << 10);  // mid-plan: a quarter of the 2 MiB that move
  auto r = w.Run(plans, ref, procs, Small(), [&] {
    while (!w.hub_->delivery_paused()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    w.world_[1]->Abort();  // participant 2's process
    w.hub_->ResumeDelivery();
  });
  EXPECT_THAT(r.stats[2].status(), StatusIs(StatusCode::kAborted, HasSubstr("Abort() called")));
  for (size_t p = 0; p < plans.size(); ++p) {
    if (p == 2 || r.stats[p].ok()) continue;
    EXPECT_THAT(r.stats[p].status().code(),
                AnyOf(StatusCode::kAborted, StatusCode::kUnavailable));
    for (int peer : r.stats[p].status().failed_peers()) {
      EXPECT_TRUE(peer >= 0 && peer < 4) << "peer " << peer << " is not a participant";
    }
  }
  // Participant 3 receives from 2: it cannot have finished.
  EXPECT_FALSE(r.stats[3].ok());
}

// A process dies mid-reshard: the survivors fail (kUnavailable, the dead one named), then build
// their union communicator by shrinking the old world without it, and reshard over it.
TEST(DeviceTransportTest, DeadProcessThenShrunkUnion) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {1024, 1024}}};
  DeviceWorld w(4);
  {
    auto plans = BuildPlans(tensors, {TpLayout(tensors[0], 0, {0, 1, 2, 3})},
                            {TpLayout(tensors[0], 0, {1, 3, 0, 2})}, 4);
    auto ref = Reference(tensors);
    ExecutorOptions o = Small();
    w.hub_->KillWhenDelivered(2, 256 << 10);  // a quarter of the way
    auto r = w.Run(plans, ref, Identity(4), o);
    EXPECT_FALSE(r.stats[2].ok());
    // Participant 0's new rows come from participant 2: it fails, naming it.
    EXPECT_THAT(r.stats[0].status(), StatusIs(StatusCode::kUnavailable, ::testing::_));
    for (size_t p = 0; p < 4; ++p) {
      if (p == 2 || r.stats[p].ok()) continue;
      EXPECT_THAT(r.stats[p].status().code(),
                  AnyOf(StatusCode::kUnavailable, StatusCode::kAborted));
    }
  }
  // The survivors (workers 0, 1, 3) reshard among themselves: participants 0, 1, 2.
  MORPH_ASSERT_OK_AND_ASSIGN(
      UnionCommPlan up, PlanUnionComm({.participants = {0, 1, 3},
                                       .old_world = {0, 1, 2, 3},
                                       .dead = {2},
                                       .old_world_shrinks = true}));
  ASSERT_EQ(up.source, UnionCommPlan::Source::kShrunk);
  std::vector<UnionComm> u(3);
  MemoryStore g2(w.table_, 2);
  MORPH_ASSERT_OK(FirstError(RunRankThreads(3, [&](int p) -> Status {
    const int process = p == 2 ? 3 : p;
    MORPH_ASSIGN_OR_RETURN(u[static_cast<size_t>(p)],
                           BuildUnionComm(up, p, w.world_[static_cast<size_t>(process)].get(),
                                          nullptr, {}, g2, 2, Deadline::After(kTimeout)));
    return Status::Ok();
  })));
  auto plans = BuildPlans(tensors, {TpLayout(tensors[0], 1, {0, 1, 2})},
                          {TpLayout(tensors[0], 0, {2, 0, 1})}, 3);
  auto ref = Reference(tensors);
  auto r = w.Run(plans, ref, {}, Small(), nullptr, {u[0].comm, u[1].comm, u[2].comm});
  DeviceWorld::ExpectMatch(plans, r, ref);
}

}  // namespace
}  // namespace morph
