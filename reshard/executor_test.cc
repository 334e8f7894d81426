#include "reshard/executor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "base/testing.h"
#include "reshard/inproc_transport.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using namespace ::morph::testutil;  // NOLINT

struct RunResult {
  std::vector<StatusOr<ExecutorStats>> stats;
  std::vector<ParticipantData> data;
};

// A transport without strided ops (like CommTransport): forwards contiguous ops to `t`, rejects
// strided ones with kInvalidArgument and counts them.
class ContiguousOnlyTransport final : public Transport {
 public:
  explicit ContiguousOnlyTransport(Transport& t) : t_(t) {}
  int rank() const override { return t_.rank(); }
  int size() const override { return t_.size(); }
  bool SupportsDeviceMemory() const override { return t_.SupportsDeviceMemory(); }
  StatusOr<std::unique_ptr<TransportWork>> Start(std::span<const SendOp> sends,
                                                 std::span<const RecvOp> recvs) override {
    for (const SendOp& op : sends) {
      if (op.strided != nullptr)
        return InvalidArgumentError("strided send: " + std::to_string(++strided_));
    }
    for (const RecvOp& op : recvs) {
      if (op.strided != nullptr)
        return InvalidArgumentError("strided recv: " + std::to_string(++strided_));
    }
    return t_.Start(sends, recvs);
  }
  void Abort() override { t_.Abort(); }
  int strided_ops_seen() const { return strided_; }

 private:
  Transport& t_;
  int strided_ = 0;
};

// Runs every participant's plan in its own thread over one in-process hub, participant i with
// opts[i]. `hub` may have been prepared (fault injection). `contiguous_only`: each participant's
// transport does not offer strided ops.
RunResult RunAllWith(const std::vector<LocalPlan>& plans, const std::vector<std::vector<char>>& ref,
                     const std::vector<ExecutorOptions>& opts, std::shared_ptr<InProcHub> hub,
                     int64_t deadline_ms, bool contiguous_only = false) {
  const int n = static_cast<int>(plans.size());
  if (!hub) hub = std::make_shared<InProcHub>(n);
  RunResult r;
  for (const LocalPlan& p : plans) {
    r.data.push_back(MakeParticipantData(p, ref));
    r.stats.emplace_back(InternalError("not run"));
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      const size_t k = static_cast<size_t>(i);
      InProcTransport t(hub, i);
      ContiguousOnlyTransport wrapped(t);
      Transport& use = contiguous_only ? static_cast<Transport&>(wrapped) : t;
      r.stats[k] = ExecutePlan(plans[k], r.data[k].olds, r.data[k].news, use, opts[k],
                               Deadline::AfterMs(deadline_ms));
      EXPECT_EQ(wrapped.strided_ops_seen(), 0) << "participant " << i;
    });
  }
  for (auto& t : threads) t.join();
  return r;
}

RunResult RunAll(const std::vector<LocalPlan>& plans, const std::vector<std::vector<char>>& ref,
                 const ExecutorOptions& opts, std::shared_ptr<InProcHub> hub = nullptr,
                 int64_t deadline_ms = 30000) {
  return RunAllWith(plans, ref, std::vector<ExecutorOptions>(plans.size(), opts), std::move(hub),
                    deadline_ms);
}

std::vector<std::vector<char>> Reference(const std::vector<TensorInfo>& tensors) {
  std::vector<std::vector<char>> ref;
  for (size_t i = 0; i < tensors.size(); ++i)
    ref.push_back(ReferenceTensor(tensors[i], static_cast<int>(i)));
  return ref;
}

void ExpectNewShardsMatch(const std::vector<LocalPlan>& plans, const RunResult& r,
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

ExecutorOptions SmallOptions() {
  ExecutorOptions o;
  o.chunk_bytes = 4096;
  o.staging_bytes = 64 << 10;
  return o;
}

// Message size does not shrink with the world size: 48 participants that each talk to one
// peer (a ZeRO range shifted by one) exchange messages of min(chunk, staging / 4), as with 2.
TEST(ExecutorTest, MessageSizeIndependentOfWorldSize) {
  const int n = 48;
  std::vector<TensorInfo> tensors{{"m", DType::kF32, {n * (256 << 10)}}};
  std::vector<int> old_holders, new_holders;
  for (int i = 0; i < n; ++i) {
    old_holders.push_back(i);
    new_holders.push_back((i + 1) % n);
  }
  auto plans = BuildPlans(tensors, {FlatLayout(tensors[0], old_holders)},
                          {FlatLayout(tensors[0], new_holders)}, n);
  auto ref = Reference(tensors);
  ExecutorOptions o;
  o.chunk_bytes = 512 << 10;
  o.staging_bytes = 1 << 20;
  RunResult r = RunAll(plans, ref, o);
  ExpectNewShardsMatch(plans, r, ref);
  for (int i = 0; i < n; ++i) {
    // 1 MiB per participant in 256 KiB messages (it was 5,568 B: staging / (4 (n - 1))).
    EXPECT_EQ(r.stats[static_cast<size_t>(i)]->messages_sent, 4) << "participant " << i;
  }
}

// Many participants, each with peers at many offsets, staged (strided messages off): bitwise
// right, and staging stays within staging_bytes although one round would need more.
TEST(ExecutorTest, ManyParticipantsStagingBound) {
  const int n = 37;
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {16, n * 40}}};
  std::vector<int> old_holders, new_holders{0, 7, 14, 21, 28};
  for (int i = 0; i < n; ++i) old_holders.push_back(i);
  auto plans = BuildPlans(tensors, {TpLayout(tensors[0], 1, old_holders)},
                          {TpLayout(tensors[0], 1, new_holders)}, n);
  auto ref = Reference(tensors);
  ExecutorOptions o;
  o.chunk_bytes = 4096;
  o.staging_bytes = 24 << 10;  // groups of one peer offset; a round has up to 8 receives
  o.strided_messages = false;
  RunResult r = RunAll(plans, ref, o);
  ExpectNewShardsMatch(plans, r, ref);
  int64_t staged = 0;
  for (const auto& st : r.stats) {
    EXPECT_LE(st->staging_peak_bytes, int64_t{24} << 10);
    staged += st->staging_peak_bytes;
  }
  EXPECT_GT(staged, 0);
}

TEST(ExecutorTest, TensorParallel4To2) {
  std::vector<TensorInfo> tensors{{"w1", DType::kF32, {64, 96}}, {"w2", DType::kBF16, {96, 64}}};
  std::vector<RegionLayout> old_l{TpLayout(tensors[0], 1, {0, 1, 2, 3}),
                                  TpLayout(tensors[1], 0, {0, 1, 2, 3})};
  std::vector<RegionLayout> new_l{TpLayout(tensors[0], 1, {0, 1}), TpLayout(tensors[1], 0, {0, 1})};
  auto plans = BuildPlans(tensors, old_l, new_l, 4);
  auto ref = Reference(tensors);
  RunResult r = RunAll(plans, ref, SmallOptions());
  ExpectNewShardsMatch(plans, r, ref);
  // Rank 0 keeps its old blocks (w1 columns [0,24), w2 rows [0,24)) and receives the rest of
  // its new ones; rank 1's old blocks ([24,48)) lie outside its new ones ([48,96)).
  EXPECT_EQ(r.stats[0]->bytes_copied, 64 * 24 * 4 + 24 * 64 * 2);
  EXPECT_EQ(r.stats[0]->bytes_received, 64 * 24 * 4 + 24 * 64 * 2);
  EXPECT_EQ(r.stats[1]->bytes_copied, 0);
  EXPECT_EQ(r.stats[1]->bytes_received, 64 * 48 * 4 + 48 * 64 * 2);
  EXPECT_EQ(r.stats[2]->bytes_received + r.stats[3]->bytes_received, 0);
  EXPECT_GT(r.stats[1]->rounds, 1);
  // Rank 1's new w1 column block is strided: its pieces are received as strided ops (the
  // senders' old blocks are whole shards, sent in place).
  EXPECT_GT(r.stats[1]->messages_strided, 0);

  // The same without strided messages (option off, or a transport without them): packed and
  // unpacked through staging, same bytes, same message counts.
  ExecutorOptions off = SmallOptions();
  off.strided_messages = false;
  for (int mode = 0; mode < 2; ++mode) {
    SCOPED_TRACE(mode == 0 ? "option off" : "contiguous-only transport");
    RunResult o = mode == 0
                      ? RunAll(plans, ref, off)
                      : RunAllWith(plans, ref, std::vector<ExecutorOptions>(4, SmallOptions()),
                                   nullptr, 30000, /*contiguous_only=*/true);
    ExpectNewShardsMatch(plans, o, ref);
    for (size_t p = 0; p < 4; ++p) {
      EXPECT_EQ(o.stats[p]->messages_strided, 0);
      EXPECT_EQ(o.stats[p]->messages_sent, r.stats[p]->messages_sent);
      EXPECT_EQ(o.stats[p]->messages_received, r.stats[p]->messages_received);
      EXPECT_EQ(o.data[p].new_data, r.data[p].new_data);
    }
    EXPECT_GT(o.stats[1]->staging_peak_bytes, 0);
  }
}

TEST(ExecutorTest, ZeroFlat4To3AndReplicatedJoiner) {
  std::vector<TensorInfo> tensors{{"adam_m", DType::kF32, {10, 1000}}, {"bias", DType::kF64, {77}}};
  std::vector<RegionLayout> old_l{FlatLayout(tensors[0], {0, 1, 2, 3}),
                                  ReplicatedLayout(tensors[1], {0, 1, 2, 3})};
  std::vector<RegionLayout> new_l{FlatLayout(tensors[0], {0, 2, 4}),
                                  ReplicatedLayout(tensors[1], {0, 2, 4})};
  auto plans = BuildPlans(tensors, old_l, new_l, 5);
  auto ref = Reference(tensors);
  RunResult r = RunAll(plans, ref, SmallOptions());
  ExpectNewShardsMatch(plans, r, ref);
  // Contiguous ranges go straight between shard buffers.
  EXPECT_GT(r.stats[4]->messages_zero_copy, 0);
}

// A direction whose messages need no staging at either end (both sides in place, agreed in
// the handshake) is not cut into staging-sized groups: a ZeRO 4 -> 3 reshard whose ranges are
// contiguous at both ends runs in one round per participant, where staging would allow one
// message per pair and group (SmallOptions: 4 KiB messages, 64 KiB of staging).
TEST(ExecutorTest, InPlaceDirectionsNeedNoStagingRounds) {
  std::vector<TensorInfo> tensors{{"adam_m", DType::kF32, {64, 1024}}};
  auto plans = BuildPlans(tensors, {FlatLayout(tensors[0], {0, 1, 2, 3})},
                          {FlatLayout(tensors[0], {0, 1, 2})}, 4);
  auto ref = Reference(tensors);
  ASSERT_EQ(MessagesPerGroup(SmallOptions(), 4), 1);
  RunResult r = RunAll(plans, ref, SmallOptions());
  ExpectNewShardsMatch(plans, r, ref);
  for (size_t p = 0; p < 4; ++p) {
    SCOPED_TRACE("participant " + std::to_string(p));
    EXPECT_GT(r.stats[p]->messages_sent + r.stats[p]->messages_received, 4);
    EXPECT_EQ(r.stats[p]->messages_zero_copy,
              r.stats[p]->messages_sent + r.stats[p]->messages_received);
    EXPECT_EQ(r.stats[p]->rounds, 1);
    EXPECT_EQ(r.stats[p]->staging_peak_bytes, 0);
  }
  // The same pieces, received into a column block of a 2-D layout (strided at the receiver, so
  // staged or gathered there): that direction keeps staging-sized groups.
  std::vector<TensorInfo> t2{{"w", DType::kF32, {64, 1024}}};
  auto tp = BuildPlans(t2, {TpLayout(t2[0], 0, {0, 1, 2, 3})}, {TpLayout(t2[0], 1, {0, 1})}, 4);
  auto ref2 = Reference(t2);
  RunResult r2 = RunAll(tp, ref2, SmallOptions());
  ExpectNewShardsMatch(tp, r2, ref2);
  EXPECT_GT(r2.stats[0]->rounds, 1);
}

TEST(ExecutorTest, RandomizedPlansMatchReference) {
  const unsigned long long seed = morph::testing::TestSeed();
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const DType dtypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kU8, DType::kI64};
  for (int iter = 0; iter < 600; ++iter) {
    const int n = 1 + static_cast<int>(rng() % 6);
    const int nt = 1 + static_cast<int>(rng() % 4);
    std::vector<TensorInfo> tensors;
    for (int t = 0; t < nt; ++t) {
      TensorInfo info{"t" + std::to_string(t), dtypes[rng() % 5], {}};
      const int rank = static_cast<int>(rng() % 4);
      for (int d = 0; d < rank; ++d) info.shape.push_back(1 + static_cast<int64_t>(rng() % 40));
      tensors.push_back(info);
    }
    std::vector<RegionLayout> old_l, new_l;
    for (const TensorInfo& t : tensors) {
      old_l.push_back(RandomLayout(t, n, rng));
      new_l.push_back(RandomLayout(t, n, rng));
    }
    auto plans = BuildPlans(tensors, old_l, new_l, n);
    auto ref = Reference(tensors);
    ExecutorOptions opts;
    opts.chunk_bytes = 64 << (rng() % 8);
    opts.staging_bytes = opts.chunk_bytes * (1 + rng() % 64);
    RunResult r = RunAll(plans, ref, opts);
    SCOPED_TRACE("iteration " + std::to_string(iter));
    ExpectNewShardsMatch(plans, r, ref);
    if (::testing::Test::HasFatalFailure()) return;
    // The staging bound: staging_bytes, or one group of one send and one receive.
    const uint64_t chunk = EffectiveChunkBytes(opts, n);
    const uint64_t bound = std::max<uint64_t>(opts.staging_bytes, 2 * chunk);
    for (const auto& st : r.stats) {
      EXPECT_LE(static_cast<uint64_t>(st->staging_peak_bytes), bound);
    }
  }
}

// Strided messages on and off, and mixed between participants (either side of a pair decides
// alone): bitwise the same new shards, which are the reference's.
TEST(ExecutorTest, RandomizedPlansStridedOnOffMixedAgree) {
  const unsigned long long seed = morph::testing::TestSeed();
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const DType dtypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kU8, DType::kI64};
  int64_t strided_total = 0;
  for (int iter = 0; iter < 200; ++iter) {
    SCOPED_TRACE("iteration " + std::to_string(iter));
    const int n = 2 + static_cast<int>(rng() % 5);
    const int nt = 1 + static_cast<int>(rng() % 4);
    std::vector<TensorInfo> tensors;
    for (int t = 0; t < nt; ++t) {
      TensorInfo info{"t" + std::to_string(t), dtypes[rng() % 5], {}};
      const int rank = 1 + static_cast<int>(rng() % 3);
      for (int d = 0; d < rank; ++d) info.shape.push_back(1 + static_cast<int64_t>(rng() % 40));
      tensors.push_back(info);
    }
    std::vector<RegionLayout> old_l, new_l;
    for (const TensorInfo& t : tensors) {
      old_l.push_back(RandomLayout(t, n, rng));
      new_l.push_back(RandomLayout(t, n, rng));
    }
    auto plans = BuildPlans(tensors, old_l, new_l, n);
    auto ref = Reference(tensors);
    ExecutorOptions base;
    base.chunk_bytes = 64 << (rng() % 8);
    base.staging_bytes = base.chunk_bytes * (1 + rng() % 64);
    std::vector<std::vector<std::vector<char>>> first;  // mode 0's new data, per participant
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(mode == 0 ? "off" : mode == 1 ? "on" : "mixed");
      std::vector<ExecutorOptions> opts(static_cast<size_t>(n), base);
      for (int i = 0; i < n; ++i) {
        opts[static_cast<size_t>(i)].strided_messages = mode == 1 || (mode == 2 && (i + iter) % 2);
      }
      RunResult r = RunAllWith(plans, ref, opts, nullptr, 30000);
      ExpectNewShardsMatch(plans, r, ref);
      if (::testing::Test::HasFatalFailure()) return;
      const uint64_t chunk = EffectiveChunkBytes(base, n);
      const uint64_t bound = std::max<uint64_t>(base.staging_bytes, 2 * chunk);
      for (int i = 0; i < n; ++i) {
        const auto& st = r.stats[static_cast<size_t>(i)];
        EXPECT_LE(static_cast<uint64_t>(st->staging_peak_bytes), bound);
        if (!opts[static_cast<size_t>(i)].strided_messages) {
          EXPECT_EQ(st->messages_strided, 0);
        }
        if (mode == 1) strided_total += st->messages_strided;
      }
      if (mode == 0) {
        for (auto& d : r.data) first.push_back(d.new_data);
      } else {
        for (size_t p = 0; p < r.data.size(); ++p) ASSERT_EQ(r.data[p].new_data, first[p]);
      }
    }
  }
  EXPECT_GT(strided_total, 0);
}

class FailureTest : public ::testing::TestWithParam<bool> {};

TEST_P(FailureTest, TransportFailureMidPlanLeavesOldDataIntact) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {128, 256}}};
  auto plans = BuildPlans(tensors, {TpLayout(tensors[0], 1, {0, 1, 2, 3})},
                          {TpLayout(tensors[0], 0, {0, 1, 2})}, 4);
  auto ref = Reference(tensors);
  auto hub = std::make_shared<InProcHub>(4);
  hub->InjectFailAfterBytes(20000);
  ExecutorOptions opts = SmallOptions();
  opts.strided_messages = GetParam();
  RunResult r = RunAll(plans, ref, opts, hub);
  int unavailable = 0;
  for (size_t p = 0; p < plans.size(); ++p) {
    ASSERT_FALSE(r.stats[p].ok()) << "participant " << p;
    EXPECT_THAT(r.stats[p].status().code(), AnyOf(StatusCode::kUnavailable, StatusCode::kAborted))
        << r.stats[p].status();
    EXPECT_THAT(std::string(r.stats[p].status().message()),
                HasSubstr("reshard participant " + std::to_string(p) + " of 4"));
    if (r.stats[p].status().code() == StatusCode::kUnavailable) ++unavailable;
    EXPECT_EQ(r.data[p].old_data[0], ExtractShard(tensors[0], *plans[p].old_shards[0], ref[0]))
        << "old data of participant " << p << " changed";
  }
  EXPECT_GE(unavailable, 1);
  EXPECT_LE(hub->bytes_delivered(), 20000);
}

INSTANTIATE_TEST_SUITE_P(Strided, FailureTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "StridedOn" : "StridedOff"; });

TEST(ExecutorTest, KilledPeerAndAbortAndDeadline) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {64, 64}}};
  auto plans =
      BuildPlans(tensors, {FlatLayout(tensors[0], {0, 1})}, {FlatLayout(tensors[0], {1, 0})}, 2);
  auto ref = Reference(tensors);
  for (int mode = 0; mode < 3; ++mode) {
    SCOPED_TRACE("mode " + std::to_string(mode));
    // Participant 1 never runs: it is killed, or participant 0 is aborted, or times out.
    auto hub = std::make_shared<InProcHub>(2);
    ParticipantData d = MakeParticipantData(plans[0], ref);
    InProcTransport t(hub, 0);
    std::thread side([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      if (mode == 0) hub->KillRank(1);
      if (mode == 1) t.Abort();
    });
    auto s = ExecutePlan(plans[0], d.olds, d.news, t, SmallOptions(),
                         Deadline::AfterMs(mode == 2 ? 100 : 60000));
    side.join();
    const StatusCode want[] = {StatusCode::kUnavailable, StatusCode::kAborted,
                               StatusCode::kDeadlineExceeded};
    EXPECT_THAT(s, StatusIs(want[mode], HasSubstr("plan handshake")));
    EXPECT_EQ(d.old_data[0], ExtractShard(tensors[0], *plans[0].old_shards[0], ref[0]));
  }
}

// Runs two participants' plans concurrently over one hub (participant 1 starting `delay1_ms`
// later); returns their statuses and each one's elapsed seconds.
struct PairRun {
  Status s[2];
  double seconds[2] = {0, 0};
  ParticipantData d[2];
};
PairRun RunPair(const LocalPlan& p0, const LocalPlan& p1, const std::vector<std::vector<char>>& ref,
                std::shared_ptr<InProcHub> hub,
                std::function<void(ParticipantData&, int)> tweak = {},
                ExecutorOptions o1 = SmallOptions(), int delay_ms[2] = nullptr) {
  PairRun r;
  r.d[0] = MakeParticipantData(p0, ref);
  r.d[1] = MakeParticipantData(p1, ref);
  if (tweak) tweak(r.d[0], 0), tweak(r.d[1], 1);
  const LocalPlan* plans[2] = {&p0, &p1};
  std::vector<std::thread> ts;
  for (int i = 0; i < 2; ++i) {
    ts.emplace_back([&, i] {
      if (delay_ms != nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms[i]));
      InProcTransport t(hub, i);
      const auto t0 = std::chrono::steady_clock::now();
      r.s[i] = ExecutePlan(*plans[i], r.d[i].olds, r.d[i].news, t, i == 1 ? o1 : SmallOptions(),
                           Deadline::AfterMs(30000))
                   .status();
      r.seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : ts) t.join();
  return r;
}

// Two hand-built plans, 8x8 f32 moving from participant 0 to participant 1 in two pieces.
std::vector<LocalPlan> TwoPiecePlans(const std::vector<TensorInfo>& tensors) {
  auto whole = *Shard::Whole(Box::FromShape(tensors[0].shape));
  std::vector<LocalPlan> plans(2);
  for (int i = 0; i < 2; ++i) {
    plans[i].participant = i;
    plans[i].num_participants = 2;
    plans[i].tensors = tensors;
    plans[i].old_shards.resize(1);
    plans[i].new_shards.resize(1);
  }
  plans[0].old_shards[0] = whole;
  plans[1].new_shards[0] = whole;
  const Box top({{0, 4}, {0, 8}}), bottom({{4, 8}, {0, 8}});
  plans[0].sends = {{0, 1, top}, {0, 1, bottom}};
  plans[1].recvs = {{0, 0, top}, {0, 0, bottom}};
  return plans;
}

// Issue 7: participant 0 sends rows {0-3, 4-7}, participant 1 expects {4-7, 0-3}; sizes match,
// and before the handshake both returned OK with every element participant 1 got wrong.
TEST(ExecutorTest, DisagreeingPieceOrderFailsBeforeAnyDataMoves) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {8, 8}}};
  auto plans = TwoPiecePlans(tensors);
  std::swap(plans[1].recvs[0], plans[1].recvs[1]);
  auto ref = Reference(tensors);
  auto hub = std::make_shared<InProcHub>(2);
  PairRun r = RunPair(plans[0], plans[1], ref, hub);
  EXPECT_THAT(r.s[0], StatusIs(StatusCode::kFailedPrecondition,
                               AllOf(HasSubstr("plans disagree"),
                                     HasSubstr("participant 0 sends to participant 1"))));
  EXPECT_THAT(r.s[1], StatusIs(StatusCode::kFailedPrecondition,
                               AllOf(HasSubstr("plans disagree"),
                                     HasSubstr("pieces participant 0 sends to participant 1"))));
  EXPECT_EQ(hub->bytes_delivered(), 2 * 512) << "only the handshake may move";
  // And the agreeing order works.
  auto good = TwoPiecePlans(tensors);
  PairRun ok = RunPair(good[0], good[1], ref, std::make_shared<InProcHub>(2));
  MORPH_EXPECT_OK(ok.s[0]);
  MORPH_EXPECT_OK(ok.s[1]);
  EXPECT_EQ(ok.d[1].new_data[0], ref[0]);
}

TEST(ExecutorTest, DigestMismatchNamesTheDifferingPart) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {8, 8}}};
  auto plans = TwoPiecePlans(tensors);
  auto ref = Reference(tensors);
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < PlanDigest::kMessageLayout; ++k)
      plans[static_cast<size_t>(i)].digest.parts[static_cast<size_t>(k)] = 100 + k;
  }
  plans[1].digest.parts[PlanDigest::kNewConfig] = 7;
  PairRun r = RunPair(plans[0], plans[1], ref, std::make_shared<InProcHub>(2));
  for (int i = 0; i < 2; ++i) {
    EXPECT_THAT(
        r.s[i],
        StatusIs(StatusCode::kFailedPrecondition,
                 AllOf(HasSubstr("participant " + std::to_string(1 - i) + " runs a different plan"),
                       HasSubstr("differ in new config ("))));
  }
  // Executor options that cut messages differently are part of the agreement too.
  plans[1].digest = plans[0].digest;
  ExecutorOptions other = SmallOptions();
  other.chunk_bytes *= 2;
  r = RunPair(plans[0], plans[1], ref, std::make_shared<InProcHub>(2), {}, other);
  EXPECT_THAT(r.s[0], StatusIs(StatusCode::kFailedPrecondition,
                               HasSubstr("differ in executor message layout")));
  EXPECT_NE(MessageLayoutDigest(SmallOptions(), 2), MessageLayoutDigest(other, 2));
  EXPECT_EQ(WithMessageLayout(plans[0].digest, other, 2).parts[PlanDigest::kMessageLayout],
            MessageLayoutDigest(other, 2));
}

TEST(ExecutorTest, StrayMessageFailsLoudly) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {8, 8}}};
  auto plans = TwoPiecePlans(tensors);
  auto ref = Reference(tensors);
  auto hub = std::make_shared<InProcHub>(2);
  // A leftover from something else on the same pair, of the handshake's size.
  // Posted, never waited for (so rank 0 stays open while participant 1 matches it).
  std::vector<char> junk(512, 'x');
  InProcTransport t0(hub, 0);
  std::vector<SendOp> ops{{1, junk.data(), junk.size(), nullptr, 42}};
  auto w = t0.Start(ops, {});
  ASSERT_TRUE(w.ok());
  ParticipantData d = MakeParticipantData(plans[1], ref);
  InProcTransport t(hub, 1);
  auto s = ExecutePlan(plans[1], d.olds, d.news, t, SmallOptions(), Deadline::AfterMs(5000));
  EXPECT_THAT(s, StatusIs(StatusCode::kFailedPrecondition, HasSubstr("tag mismatch")));
}

// Issue 7 §3: a participant whose plan fails validation used to return without aborting, and its
// peers waited out their whole deadline (5 s measured). Now they fail at once and know why.
TEST(ExecutorTest, LocalValidationFailureFailsPeersFast) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {8, 8}}};
  auto plans = TwoPiecePlans(tensors);
  auto ref = Reference(tensors);
  auto shrink1 = [](ParticipantData& d, int i) {
    if (i == 1) d.news[0].data.bytes -= 4;  // participant 1's buffer is wrong
  };
  // Participant 0 already waiting: it gets participant 1's reason.
  int delays[2] = {0, 50};
  PairRun r = RunPair(plans[0], plans[1], ref, std::make_shared<InProcHub>(2), shrink1,
                      SmallOptions(), delays);
  EXPECT_THAT(r.s[1], StatusIs(StatusCode::kInvalidArgument, HasSubstr("has 252 bytes")));
  EXPECT_THAT(r.s[0], StatusIs(StatusCode::kAborted,
                               AllOf(HasSubstr("participant 1 failed before the exchange"),
                                     HasSubstr("has 252 bytes"))));
  // Participant 0 arriving after participant 1 gave up: the transport says who aborted.
  int late[2] = {600, 0};
  PairRun q = RunPair(plans[0], plans[1], ref, std::make_shared<InProcHub>(2), shrink1,
                      SmallOptions(), late);
  EXPECT_THAT(q.s[0], StatusIs(StatusCode::kUnavailable, HasSubstr("peer 1 aborted")));
  std::printf(
      "peer of a failed participant: failed %.1f ms after it started (waiting, includes "
      "the 50 ms start delay) / %.1f ms (arriving late); deadline 30000 ms\n",
      r.seconds[0] * 1000, q.seconds[0] * 1000);
  EXPECT_LT(r.seconds[0], 1.0);
  EXPECT_LT(q.seconds[0], 1.0);
}

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = {{"w", DType::kF32, {8, 8}}, {"b", DType::kF16, {8}}};
    plans_ = BuildPlans(
        tensors_, {TpLayout(tensors_[0], 0, {0, 1}), ReplicatedLayout(tensors_[1], {0, 1})},
        {TpLayout(tensors_[0], 1, {0, 1}), ReplicatedLayout(tensors_[1], {0, 1})}, 2);
    ref_ = Reference(tensors_);
    d_ = MakeParticipantData(plans_[0], ref_);
  }
  Status Run(const LocalPlan& plan) {
    auto hub = std::make_shared<InProcHub>(2);
    InProcTransport t(hub, 0);
    return ExecutePlan(plan, d_.olds, d_.news, t, SmallOptions(), Deadline::AfterMs(1000)).status();
  }
  std::vector<TensorInfo> tensors_;
  std::vector<LocalPlan> plans_;
  std::vector<std::vector<char>> ref_;
  ParticipantData d_;
};

TEST_F(ValidationTest, UnknownTensor) {
  d_.olds[0].name = "nope";
  EXPECT_THAT(Run(plans_[0]), StatusIs(StatusCode::kInvalidArgument,
                                       HasSubstr("old buffer for unknown tensor 'nope'")));
}

TEST_F(ValidationTest, MissingBuffer) {
  d_.news.pop_back();
  EXPECT_THAT(Run(plans_[0]),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no new buffer for tensor 'b'")));
}

TEST_F(ValidationTest, DtypeMismatch) {
  d_.olds[1].dtype = DType::kBF16;
  EXPECT_THAT(Run(plans_[0]),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("old buffer of tensor 'b' is bf16, the plan says f16")));
}

TEST_F(ValidationTest, BufferSizeMismatch) {
  d_.news[0].data.bytes -= 4;
  EXPECT_THAT(Run(plans_[0]), StatusIs(StatusCode::kInvalidArgument,
                                       HasSubstr("new buffer of tensor 'w' has 124 bytes")));
}

TEST_F(ValidationTest, PieceOutsideShard) {
  LocalPlan p = plans_[0];
  p.sends[0].box = Box({{0, 8}, {0, 8}});
  EXPECT_THAT(Run(p),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("sends[0] (tensor 'w'"), HasSubstr("not inside shard"))));
}

TEST_F(ValidationTest, CoverageAndPeersAndRanks) {
  LocalPlan p = plans_[0];
  p.local_copies.pop_back();
  EXPECT_THAT(Run(p), StatusIs(StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("tensor 'b'"), HasSubstr("not covered"))));
  p = plans_[0];
  p.recvs[0].peer = 7;
  EXPECT_THAT(Run(p), StatusIs(StatusCode::kInvalidArgument, HasSubstr("bad peer")));
  p = plans_[0];
  p.num_participants = 3;
  EXPECT_THAT(Run(p),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("transport is rank 0 of 2, plan is for participant 0 of 3")));
  p = plans_[0];
  p.recvs[0].tensor = 9;
  EXPECT_THAT(Run(p), StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor index")));
}

// Issue 7: plans whose element counts match but that write some elements twice and others never
// used to pass and return OK with half the new shard left as the allocator's fill.
TEST(ExecutorTest, CoverageIsExactNotByCount) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {8, 8}}};
  auto plans = BuildPlans(tensors, {ReplicatedLayout(tensors[0], {0})},
                          {ReplicatedLayout(tensors[0], {0})}, 1);
  ASSERT_EQ(plans[0].local_copies.size(), 1u);
  LocalPlan p = plans[0];
  p.local_copies = {{0, 0, Box({{0, 4}, {0, 8}})}, {0, 0, Box({{0, 4}, {0, 8}})}};
  auto ref = Reference(tensors);
  ParticipantData d = MakeParticipantData(p, ref);
  auto hub = std::make_shared<InProcHub>(1);
  InProcTransport t(hub, 0);
  EXPECT_THAT(
      Reshard(p, d.olds, t, HostAllocator(), SmallOptions(), Deadline::AfterMs(1000)),
      StatusIs(StatusCode::kInvalidArgument,
               AllOf(HasSubstr("tensor 'w'"), HasSubstr("local_copies[0] (peer 0) box [0,4)x[0,8)"),
                     HasSubstr("overlap"))));
}

TEST_F(ValidationTest, ReceivingAPieceTwiceIsRejected) {
  // Participant 0 keeps rows 0-3 of its new columns and receives rows 4-7 from participant 1;
  // here it "receives" rows 0-3 instead: counts match, rows 4-7 would never be written.
  LocalPlan p = plans_[0];
  ASSERT_EQ(p.recvs[0].tensor, 0);
  ASSERT_EQ(p.recvs[0].box, Box({{4, 8}, {0, 4}}));
  p.recvs[0].box = Box({{0, 4}, {0, 4}});
  p.sends.clear();  // nothing must be exchanged: validation fails first
  EXPECT_THAT(Run(p), StatusIs(StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("tensor 'w'"),
                                     HasSubstr("recvs[0] (peer 1) box [0,4)x[0,4)"),
                                     HasSubstr("overlap"))));
}

TEST_F(ValidationTest, LostPiecesCountTowardsCoverage) {
  std::vector<TensorInfo> tensors{{"w", DType::kF32, {8, 8}}};
  auto plans = BuildPlans(tensors, {ReplicatedLayout(tensors[0], {0})},
                          {ReplicatedLayout(tensors[0], {0})}, 1);
  LocalPlan p = plans[0];
  auto ref = Reference(tensors);
  ParticipantData d = MakeParticipantData(p, ref);
  // Rows 4-7 are lost: the executor leaves them alone and the plan still validates.
  p.local_copies = {{0, 0, Box({{0, 4}, {0, 8}})}};
  p.lost = {{0, -1, Box({{4, 8}, {0, 8}})}};
  auto hub = std::make_shared<InProcHub>(1);
  InProcTransport t(hub, 0);
  std::vector<char> before = d.new_data[0];
  MORPH_ASSERT_OK(
      ExecutePlan(p, d.olds, d.news, t, SmallOptions(), Deadline::AfterMs(1000)).status());
  EXPECT_EQ(std::memcmp(d.new_data[0].data(), ref[0].data(), 128), 0);
  EXPECT_EQ(std::memcmp(d.new_data[0].data() + 128, before.data() + 128, 128), 0);
  p.lost.push_back({0, -1, Box({{7, 8}, {0, 1}})});
  auto hub2 = std::make_shared<InProcHub>(1);
  InProcTransport t2(hub2, 0);
  EXPECT_THAT(ExecutePlan(p, d.olds, d.news, t2, SmallOptions(), Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("lost[0]"), HasSubstr("lost[1]"), HasSubstr("overlap"))));
}

// Padded tensors (issue 7 §5): pieces cover the state only, the padding of a new shard comes
// back zero-filled whatever the buffer held, and a piece reaching into padding is refused.
TEST(ExecutorTest, PaddedTensorStateMovesAndPaddingIsZeroFilled) {
  TensorInfo info{"e", DType::kF32, {6, 2}, {8, 2}};  // logical 6 rows, padded to 8
  LocalPlan p;
  p.participant = 0;
  p.num_participants = 1;
  p.tensors = {info};
  p.old_shards = {Shard{Box({{0, 8}, {0, 2}}), 0, 16}};
  p.new_shards = {Shard{Box({{4, 8}, {0, 2}}), 0, 8}};  // rows 4-5 state, 6-7 padding
  p.local_copies = {{0, 0, Box({{4, 6}, {0, 2}})}};
  std::vector<float> old_buf(16), new_buf(8, -1.0f);
  for (int i = 0; i < 16; ++i) old_buf[size_t(i)] = float(i < 12 ? i : 99);
  std::vector<OldShardData> olds{
      {"e", DType::kF32, ConstBufferView(old_buf.data(), 64, MemoryKind::kHost)}};
  std::vector<NewShardData> news{
      {"e", DType::kF32, BufferView{new_buf.data(), 32, MemoryKind::kHost}}};
  auto run = [&](const LocalPlan& plan) {
    auto hub = std::make_shared<InProcHub>(1);
    InProcTransport t(hub, 0);
    return ExecutePlan(plan, olds, news, t, SmallOptions(), Deadline::AfterMs(1000)).status();
  };
  MORPH_ASSERT_OK(run(p));
  EXPECT_EQ(new_buf, (std::vector<float>{8, 9, 10, 11, 0, 0, 0, 0}));
  LocalPlan into_pad = p;
  into_pad.local_copies = {{0, 0, Box({{4, 7}, {0, 2}})}};
  EXPECT_THAT(run(into_pad), StatusIs(StatusCode::kInvalidArgument,
                                      AllOf(HasSubstr("tensor 'e'"), HasSubstr("box [4,7)x[0,2)"),
                                            HasSubstr("within the state [0,6)x[0,2)"))));
  LocalPlan short_of_state = p;
  short_of_state.local_copies = {{0, 0, Box({{4, 5}, {0, 2}})}};
  EXPECT_THAT(
      run(short_of_state),
      StatusIs(StatusCode::kInvalidArgument,
               AllOf(HasSubstr("tensor 'e'"), HasSubstr("2 of the 4 elements of box [4,6)x[0,2)"),
                     HasSubstr("not covered"))));
  LocalPlan past_padding = p;
  past_padding.new_shards = {Shard{Box({{4, 9}, {0, 2}}), 0, 8}};
  EXPECT_THAT(run(past_padding), StatusIs(StatusCode::kInvalidArgument,
                                          HasSubstr("lies outside its padded shape [0,8)x[0,2)")));
}

TEST(ExecutorTest, ReshardAllocatesNewBuffers) {
  std::vector<TensorInfo> tensors{{"w", DType::kI32, {6, 10}}};
  auto plans =
      BuildPlans(tensors, {ReplicatedLayout(tensors[0], {0})}, {TpLayout(tensors[0], 1, {0})}, 1);
  auto ref = Reference(tensors);
  ParticipantData d = MakeParticipantData(plans[0], ref);
  auto hub = std::make_shared<InProcHub>(1);
  InProcTransport t(hub, 0);
  MORPH_ASSERT_OK_AND_ASSIGN(
      ReshardResult res,
      Reshard(plans[0], d.olds, t, HostAllocator(), ExecutorOptions(), Deadline::AfterMs(1000)));
  ASSERT_EQ(res.new_buffers.size(), 1u);
  ASSERT_EQ(res.new_buffers[0].size(), 240u);
  EXPECT_EQ(std::memcmp(res.new_buffers[0].data(), ref[0].data(), 240), 0);
  EXPECT_EQ(res.stats.bytes_copied, 240);
}

TEST(ExecutorTest, OptionsFromEnvAndEffectiveChunk) {
  setenv("MORPH_RESHARD_STAGING_BYTES", "1MiB", 1);
  setenv("MORPH_RESHARD_CHUNK_BYTES", "512KiB", 1);
  MORPH_ASSERT_OK_AND_ASSIGN(ExecutorOptions o, ExecutorOptions::FromEnv());
  EXPECT_EQ(o.staging_bytes, 1u << 20);
  EXPECT_EQ(o.chunk_bytes, 512u << 10);
  EXPECT_EQ(EffectiveChunkBytes(o, 2), 256u << 10);
  // Independent of the world size: staging is bounded by grouping peers, not by shrinking
  // messages.
  EXPECT_EQ(EffectiveChunkBytes(o, 1 << 20), 256u << 10);
  EXPECT_EQ(PeersPerGroup(o, 2), 1);
  EXPECT_EQ(PeersPerGroup(o, 1 << 20), 1);
  o.chunk_bytes = 16 << 10;
  EXPECT_EQ(PeersPerGroup(o, 1 << 20), 16);
  EXPECT_EQ(PeersPerGroup(o, 5), 4);
  EXPECT_EQ(MessagesPerGroup(o, 1 << 20), 1);
  EXPECT_EQ(MessagesPerGroup(o, 5), 4);  // 1 MiB / (4 * 16 KiB * 4 peers)
  o.chunk_bytes = 512 << 10;
  EXPECT_EQ(MessagesPerGroup(o, 2), 1);
  setenv("MORPH_RESHARD_STAGING_BYTES", "lots", 1);
  EXPECT_THAT(ExecutorOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_RESHARD_STAGING_BYTES")));
  unsetenv("MORPH_RESHARD_STAGING_BYTES");
  unsetenv("MORPH_RESHARD_CHUNK_BYTES");
}

}  // namespace
}  // namespace morph
