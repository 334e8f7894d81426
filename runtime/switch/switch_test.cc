// The switch engine over real Gloo communicators, workers as threads of this process sharing a
// MemoryStore (labels multiproc: many loopback connections; the harness: switch_test_cluster.h).
// A small "coordinator" in the test derives each decision as the real one does (AssignRanks,
// ParticipantOrder, PlanForChange), so every worker checks the same digest. After every change
// each tensor's local shard must be bitwise its slice of a reference tensor, scalars must equal
// participant 0's, leavers hold nothing, and the measured peak must equal the predicted one and
// stay within the bound. Recoveries from buddy snapshots: switch_snapshot_test.cc.
#include "runtime/switch/switch.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "runtime/switch/switch_testutil.h"
#include "runtime/plan/plan_input.h"

namespace morph {
namespace {

using namespace ::morph::switch_testing;  // NOLINT

TEST(SwitchTest, DpGrowWithJoinersThenShrinkWithLeavers) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {10, 11}));
  // dp 2 -> 4
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(4, 1, 1), {10, 11, 12, 13}, /*sign_consistent=*/true));
  // dp 4 -> 2
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(2, 1, 1), {10, 11, 12, 13}, true));
}

// The same over Gloo's TCP p2p for every peer (no shared memory), as between hosts.
TEST(SwitchTest, DpGrowAndShrinkOverTcp) {
  SwitchOptions o = Cluster::Defaults();
  o.transport.shared_memory = false;
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {10, 11}));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(4, 1, 1), {10, 11, 12, 13}, /*sign_consistent=*/true, o));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(1, 2, 1), {10, 11, 12, 13}, false, o));
}

TEST(SwitchTest, TpMergeAndPpMerge) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(1, 2, 1), {1, 2}));
  // tp 2 -> 1 (dp 1 -> 2)
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(2, 1, 1), {1, 2}, /*sign_consistent=*/true));
  Cluster p;
  ASSERT_NO_FATAL_FAILURE(p.Start(Config(1, 1, 2), {1, 2}));
  // pp 2 -> 1 (dp 1 -> 2)
  ASSERT_NO_FATAL_FAILURE(p.Change(Config(2, 1, 1), {1, 2}, /*sign_consistent=*/false));
  // and back
  ASSERT_NO_FATAL_FAILURE(p.Change(Config(1, 1, 2), {1, 2}, false));
}

// dp and pp at once, with a leaver: dp 2, pp 2 on four workers -> dp 3, pp 1 on three.
TEST(SwitchTest, DpAndPpAtOnceWithALeaver) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 2), {1, 2, 3, 4}));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(3, 1, 1), {1, 2, 3, 4}, /*sign_consistent=*/false));
  // tp 1 -> 2, a joiner, the spare leaves
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(2, 2, 1), {1, 2, 3, 5}, false));
}

// batch_bytes = 0: every tensor is its own batch, and the bound is the issue's literally:
// max(old, new) + the largest single new shard + staging.
TEST(SwitchTest, SingleTensorBatchesKeepTheIssuesBound) {
  SwitchOptions o = Cluster::Defaults();
  o.batch_bytes = 0;
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 2, 1), {1, 2, 3, 4}));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(4, 1, 1), {1, 2, 3, 4}, /*sign_consistent=*/false, o));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(1, 2, 1), {1, 2, 3, 4}, false, o));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(3, 1, 1), {1, 2, 3, 4}, false, o));
}

// Staging through host memory on host tensors: the same result through one more copy; and
// keeping the old shards until the barrier.
TEST(SwitchTest, StagedAndKeepOldModesGiveTheSameState) {
  SwitchOptions staged = Cluster::Defaults();
  staged.stage_old_in_host = true;
  SwitchOptions keep = Cluster::Defaults();
  keep.keep_old_until_barrier = true;
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {1, 2}));
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg p, c.Decide(Config(1, 2, 1), {1, 2, 3}));
  auto r = c.Run(p, nullptr, staged);
  for (auto& [w, res] : r) ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
  c.Verify(1);
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg q, c.Decide(Config(3, 1, 1), {1, 2, 3}));
  r = c.Run(q, nullptr, keep);
  for (auto& [w, res] : r) {
    ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
    EXPECT_EQ(res.stats.peak_state_bytes, res.stats.old_bytes + res.stats.new_bytes);
  }
  c.Verify(1);
}

TEST(SwitchTest, DigestMismatchIsRefusedBeforeAnyCommunicator) {
  Cluster c;
  Generation from{.id = 1, .config = Config(2, 1, 1), .ranks = {1, 2}};
  c.current_ = from;
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg p, c.Decide(Config(4, 1, 1), {1, 2, 3, 4}));
  const uint64_t computed = p.next.plan_digest;
  p.next.plan_digest ^= 0x5a;
  MemoryStore store(c.table_, p.next.id);
  const auto start = Clock::now();
  auto sw = PrepareSwitch(c.manifest_, 1, p, store, GlooFactory(c.device_), Cluster::Defaults(),
                          Deadline::AfterMs(20000));
  ASSERT_FALSE(sw.ok());
  EXPECT_EQ(sw.status().code(), StatusCode::kFailedPrecondition);
  const std::string want = "plan digest mismatch: coordinator " + DigestHex(p.next.plan_digest) +
                           ", computed " + DigestHex(computed) + " (computed parts: tensors ";
  EXPECT_EQ(sw.status().message().substr(0, want.size()), want) << sw.status();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 1.0)
      << "refused without waiting for peers";
  EXPECT_EQ(c.table_->size(), 0u) << "nothing was published to the store";

  // The first generation's digest is checked too.
  Cluster d;
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg f, d.Decide(Config(2, 1, 1), {1, 2}));
  f.next.plan_digest += 1;
  auto sf = PrepareSwitch(d.manifest_, 1, f, store, GlooFactory(d.device_), Cluster::Defaults(),
                          Deadline::AfterMs(20000));
  EXPECT_EQ(sf.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(sf.status().message().find("plan digest mismatch"), std::string::npos);
}

// A lost worker whose ZeRO shards nobody else holds: refused at prepare, naming a tensor.
TEST(SwitchTest, StateWithNoSurvivingHolderIsDataLoss) {
  Cluster c;
  c.current_ = Generation{.id = 1, .config = Config(2, 1, 1), .ranks = {1, 2}};
  PrepareMsg p{.from_generation = 1, .from = c.current_};
  p.next = Generation{.id = 2, .config = Config(1, 1, 1), .ranks = {1}};
  p.change.lost = {2};
  p.change.participants = ParticipantOrder(p.from, p.change.lost, p.next.ranks);
  MORPH_ASSERT_OK_AND_ASSIGN(ChangePlan plan, PlanForChange(c.manifest_, p.from, p.next, p.change));
  p.next.plan_digest = plan.digest;
  MemoryStore store(c.table_, 2);
  auto sw = PrepareSwitch(c.manifest_, 1, p, store, GlooFactory(c.device_), Cluster::Defaults(),
                          Deadline::AfterMs(5000));
  EXPECT_EQ(sw.status().code(), StatusCode::kDataLoss) << sw.status();
  EXPECT_NE(sw.status().message().find("exp_avg"), std::string::npos) << sw.status();
}

// A commit that is not what was prepared is refused before anything moves; the state is intact.
// An allocator that counts what it handed out and what came back (pre-allocation tests).
struct CountingAllocator {
  struct Counts {
    std::mutex mu;
    int64_t outstanding = 0, max_outstanding = 0, total = 0;
    int buffers = 0;
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();
  Allocator Get() const {
    return [c = counts](size_t bytes) -> StatusOr<Buffer> {
      MORPH_ASSIGN_OR_RETURN(Buffer b, HostAllocator()(bytes));
      void* p = b.data();
      const size_t n = b.size();
      {
        std::lock_guard<std::mutex> l(c->mu);
        c->outstanding += static_cast<int64_t>(n);
        c->max_outstanding = std::max(c->max_outstanding, c->outstanding);
        c->total += static_cast<int64_t>(n);
        ++c->buffers;
      }
      // The Buffer the switch keeps owns a fresh one; the HostAllocator's storage moves in.
      auto* inner = new Buffer(std::move(b));
      return Buffer::Adopt(p, n, MemoryKind::kHost, [c, inner, n](void*) {
        delete inner;
        std::lock_guard<std::mutex> l(c->mu);
        c->outstanding -= static_cast<int64_t>(n);
      });
    };
  }
};

// New shards allocated and pre-faulted in PrepareSwitch (SwitchOptions::preallocate): the state
// after every change is bitwise the same, the measured peak is the predicted one and stays
// within the bound, and the pre-allocated buffers are the ones the State ends up holding.
TEST(SwitchTest, PreallocatedNewShardsKeepTheStateAndTheBound) {
  CountingAllocator counting;
  SwitchOptions o = Cluster::Defaults();
  o.preallocate = ForAnyTensor(counting.Get());
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {10, 11}));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(4, 1, 1), {10, 11, 12, 13}, /*sign_consistent=*/true, o));
  EXPECT_GT(counting.counts->total, 0) << "the joiners' new shards were not pre-allocated";
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(2, 1, 1), {10, 11, 12, 13}, true, o));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(1, 2, 1), {10, 11, 12}, false, o));
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(1, 1, 2), {10, 11}, false, o));
  // Single-tensor batches: the issue's bound literally, pre-allocation included.
  SwitchOptions single = o;
  single.batch_bytes = 0;
  ASSERT_NO_FATAL_FAILURE(c.Change(Config(1, 2, 1), {10, 11}, false, single));
  // Whatever was pre-allocated and is still held is held by the states, as their shards.
  int64_t pre_installed = 0;
  for (const auto& [w, s] : c.states_) pre_installed += s->local_bytes();
  EXPECT_LE(counting.counts->outstanding, pre_installed);
}

// Shards large enough for page-mapped storage (HostAllocator, >= 1 MiB) whose old shard is a
// page-aligned contiguous part of the new one — a ZeRO range that grows, a TP split on dim 0
// that merges — are grown in place (MovePages: the resident part is not copied), with and
// without pre-allocation; the state stays bitwise right, the peak as predicted and bounded.
TEST(SwitchTest, GrowingShardsKeepTheirResidentPagesInPlace) {
  const std::vector<TensorSpec> big = {
      {"l0.w", DType::kF32, {1024, 1024}, Layout::Layer(0).SplitTP(0)},
      {"l0.w.exp_avg", DType::kF32, {1024, 1024}, Layout::Layer(0).ZeroShard()},
      {"l1.w.exp_avg", DType::kF32, {1024, 768}, Layout::Layer(1).SplitTP(1).ZeroShard()},
      {"l1.ln", DType::kF32, {7}, Layout::Layer(1)},
  };
  for (bool preallocate : {false, true}) {
    SCOPED_TRACE(preallocate ? "pre-allocated" : "allocated at the switch");
    SwitchOptions o = Cluster::Defaults();
    o.batch_bytes = 8 << 20;
    if (preallocate) o.preallocate = ForAnyTensor(HostAllocator());
    Cluster c(big);
    c.manifest_.chunk_bytes = 1 << 20;
    c.manifest_.staging_bytes = 8 << 20;
    ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 2, 1), {1, 2, 3, 4}));
    // dp 2 -> 1 with tp 2 kept: ZeRO ranges double (offset 0 on the survivors).
    PrepareMsg p;
    auto r = c.Propose(Config(1, 2, 1), {1, 2, 3, 4}, o, &p);
    int grown = 0;
    for (auto& [w, res] : r) {
      ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
      EXPECT_EQ(res.stats.peak_state_bytes, res.predicted_peak) << w;
      grown += res.stats.shards_grown;
    }
    EXPECT_GE(grown, 2) << "no ZeRO range grew in place";
    c.Verify(1);
    // tp 2 -> 1: l0.w's dim-0 half is the new shard's first or second half (offset 2 MiB).
    r = c.Propose(Config(1, 1, 1), {1, 2}, o, &p);
    grown = 0;
    for (auto& [w, res] : r) {
      ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
      EXPECT_EQ(res.stats.peak_state_bytes, res.predicted_peak) << w;
      grown += res.stats.shards_grown;
    }
    EXPECT_GE(grown, 1) << "the dim-0 TP half did not grow in place";
    c.Verify(1);
    // And back out: dp 1 -> 2 (ranges shrink: copied as before). With pre-allocation the old
    // shards released after a batch back the next batch's new ones (PagePool).
    // One tensor per batch, so that later batches allocate after earlier ones released.
    SwitchOptions single = o;
    single.batch_bytes = 0;
    r = c.Propose(Config(2, 1, 1), {1, 2}, single, &p);
    int64_t recycled = 0;
    for (auto& [w, res] : r) {
      ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
      EXPECT_EQ(res.stats.peak_state_bytes, res.predicted_peak) << w;
      EXPECT_LE(res.stats.peak_bytes, res.stats.bound_bytes) << w;
      recycled += res.stats.recycled_bytes;
    }
    if (preallocate) {
      EXPECT_GT(recycled, 0) << "no released page was reused";
    } else {
      EXPECT_EQ(recycled, 0);
    }
    c.Verify(1);
  }
}

// Storage that is its allocator's (SwitchOptions::fixed_storage: adopted tensors, the Python
// package's host blocks that torch may still view) is never grown in place, even when it is
// page-mapped: its resident part is copied into a new shard that pre-allocation faulted in.
TEST(SwitchTest, FixedStorageIsCopiedNotGrownInPlace) {
  const std::vector<TensorSpec> big = {
      {"l0.w.exp_avg", DType::kF32, {1024, 1024}, Layout::Layer(0).ZeroShard()},
      {"l1.ln", DType::kF32, {7}, Layout::Layer(1)},
  };
  SwitchOptions o = Cluster::Defaults();
  o.batch_bytes = 8 << 20;
  o.preallocate = ForAnyTensor(HostAllocator());
  o.fixed_storage = {true, true};
  Cluster c(big);
  c.manifest_.chunk_bytes = 1 << 20;
  c.manifest_.staging_bytes = 8 << 20;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {1, 2}));
  PrepareMsg p;
  auto r = c.Propose(Config(1, 1, 1), {1}, o, &p);  // the ZeRO range doubles at offset 0
  for (auto& [w, res] : r) {
    ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
    EXPECT_EQ(res.stats.shards_grown, 0) << w;
    EXPECT_EQ(res.stats.peak_state_bytes, res.predicted_peak) << w;
  }
  c.Verify(1);
}

// Host storage of adopted tensors whose allocator moves pages (TensorAllocator::move_pages), as
// the Python package's host blocks: each block a mapping of its own; a moved range is left
// reserved and inaccessible. Shared by every worker of a test (one process).
class MovableBlocks {
 public:
  TensorAllocator Get() {
    TensorAllocator a;
    a.allocate = [this](int64_t bytes) -> StatusOr<BufferView> {
      const size_t len = Round(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
      void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return ResourceExhaustedError("mmap");
      std::lock_guard<std::mutex> l(mu_);
      blocks_[reinterpret_cast<uintptr_t>(p)] = len;
      return BufferView{p, static_cast<size_t>(bytes), MemoryKind::kHost};
    };
    a.release = [this](BufferView v) {
      std::lock_guard<std::mutex> l(mu_);
      auto it = blocks_.find(reinterpret_cast<uintptr_t>(v.data));
      ASSERT_NE(it, blocks_.end());
      munmap(v.data, it->second);
      blocks_.erase(it);
    };
    a.move_pages = [this](BufferView from, BufferView to, size_t offset) {
      const size_t len = Round(from.bytes);
      if (reinterpret_cast<uintptr_t>(from.data) % Round(1) != 0 || offset % Round(1) != 0) {
        return false;
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        auto it = blocks_.find(reinterpret_cast<uintptr_t>(to.data));
        if (it == blocks_.end() || offset + len > it->second) return false;
      }
      void* at = static_cast<char*>(to.data) + offset;
      if (mremap(from.data, len, len, MREMAP_MAYMOVE | MREMAP_FIXED | 4 /* DONTUNMAP */, at) ==
          MAP_FAILED) {
        return false;
      }
      mprotect(from.data, len, PROT_NONE);
      moved_bytes += len;
      return true;
    };
    a.any_thread = true;
    return a;
  }
  // The allocator's storage as pre-allocation's ShardAllocator wants it.
  ShardAllocator Preallocate() {
    return [a = Get()](size_t, size_t bytes) -> StatusOr<Buffer> {
      MORPH_ASSIGN_OR_RETURN(BufferView v, a.allocate(static_cast<int64_t>(bytes)));
      return Buffer::Adopt(v.data, v.bytes, MemoryKind::kHost,
                           [rel = a.release, v](void*) { rel(v); });
    };
  }
  size_t live() {
    std::lock_guard<std::mutex> l(mu_);
    return blocks_.size();
  }
  std::atomic<size_t> moved_bytes{0};

 private:
  static size_t Round(size_t n) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (n + page - 1) / page * page;
  }
  std::mutex mu_;
  std::map<uintptr_t, size_t> blocks_;
};

// Adopted storage whose allocator moves pages is grown in place and recycled as morph's own
// page-mapped buffers are (the Python package's host blocks); bitwise right, nothing leaked.
TEST(SwitchTest, AdoptedStorageThatMovesPagesIsGrownAndRecycled) {
  const std::vector<TensorSpec> big = {
      {"l0.w.exp_avg", DType::kF32, {1024, 1024}, Layout::Layer(0).ZeroShard()},
      {"l1.w.exp_avg", DType::kF32, {1024, 768}, Layout::Layer(1).ZeroShard()},
      {"l1.ln", DType::kF32, {7}, Layout::Layer(1)},
  };
  MovableBlocks blocks;
  Cluster c(big);
  c.manifest_.chunk_bytes = 1 << 20;
  c.manifest_.staging_bytes = 8 << 20;
  for (WorkerId w : {1, 2}) {
    auto s = std::make_unique<StateStore>();
    for (const TensorSpec& t : big) {
      ASSERT_TRUE(s->AdoptTensor(t.name, t.shape, t.dtype, t.layout, blocks.Get()).ok());
    }
    for (const ScalarSpec& sc : c.manifest_.scalars) {
      ASSERT_TRUE(s->AddScalar(sc.name, sc.bytes).ok());
    }
    c.states_[w] = std::move(s);
  }
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {1, 2}));
  SwitchOptions o = Cluster::Defaults();
  o.preallocate = blocks.Preallocate();
  PrepareMsg p;
  auto r = c.Propose(Config(1, 1, 1), {1, 2}, o, &p);  // ZeRO ranges double on worker 1
  int grown = 0;
  for (auto& [w, res] : r) {
    ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
    grown += res.stats.shards_grown;
  }
  EXPECT_GE(grown, 2);
  EXPECT_GT(blocks.moved_bytes.load(), 0u);
  c.Verify(1);
  // Back out to dp 2, one tensor per batch: released old shards back the next batch's new ones.
  o.batch_bytes = 0;
  r = c.Propose(Config(2, 1, 1), {1, 2}, o, &p);
  int64_t recycled = 0;
  for (auto& [w, res] : r) {
    ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
    recycled += res.stats.recycled_bytes;
  }
  EXPECT_GT(recycled, 0) << "no released adopted page was reused";
  c.Verify(1);
  size_t shards = 0;
  for (auto& [w, s] : c.states_) {
    for (size_t i = 0; i < big.size(); ++i) shards += s->TensorAt(i).data.bytes > 0 ? 1 : 0;
  }
  EXPECT_EQ(blocks.live(), shards) << "storage released or leaked";
}

// TensorAllocator::pad_dp_shards through changes (the Python package's FSDP2 parameters): every
// new shard of a DP-sharded tensor lives in storage of its DP group's first shard's size, also
// where the change left this rank a short chunk; the values are right.
TEST(SwitchTest, PaddedDpShardsKeepTheirRoomThroughChanges) {
  const std::vector<TensorSpec> specs = {
      {"w", DType::kF32, {10, 4}, Layout::Layer(0).ChunkDP()},
      {"m", DType::kF32, {7}, Layout::Layer(0).ZeroShard()},
  };
  std::mutex mu;
  std::map<uintptr_t, int64_t> asked;  // live block -> bytes the allocator was asked for
  TensorAllocator a;
  a.allocate = [&](int64_t bytes) -> StatusOr<BufferView> {
    void* p = std::malloc(static_cast<size_t>(bytes));
    std::lock_guard<std::mutex> l(mu);
    asked[reinterpret_cast<uintptr_t>(p)] = bytes;
    return BufferView{p, static_cast<size_t>(bytes), MemoryKind::kHost};
  };
  a.release = [&](BufferView v) {
    std::lock_guard<std::mutex> l(mu);
    asked.erase(reinterpret_cast<uintptr_t>(v.data));
    std::free(v.data);
  };
  a.pad_dp_shards = true;
  Cluster c(specs);
  for (WorkerId w : {1, 2, 3, 4}) {
    auto s = std::make_unique<StateStore>();
    for (const TensorSpec& t : specs) {
      ASSERT_TRUE(s->AdoptTensor(t.name, t.shape, t.dtype, t.layout, a).ok());
    }
    for (const ScalarSpec& sc : c.manifest_.scalars) {
      ASSERT_TRUE(s->AddScalar(sc.name, sc.bytes).ok());
    }
    c.states_[w] = std::move(s);
  }
  const auto check = [&](int dp) {
    SCOPED_TRACE("dp " + std::to_string(dp));
    const int64_t rows = (10 + dp - 1) / dp;
    const int64_t range = (7 + dp - 1) / dp;
    std::lock_guard<std::mutex> l(mu);
    for (auto& [w, s] : c.states_) {
      for (size_t t = 0; t < specs.size(); ++t) {
        const State::TensorRef r = s->TensorAt(t);
        if (r.data.bytes == 0) continue;
        ASSERT_EQ(asked.count(reinterpret_cast<uintptr_t>(r.data.data)), 1u) << specs[t].name;
        EXPECT_EQ(asked[reinterpret_cast<uintptr_t>(r.data.data)],
                  (t == 0 ? rows * 4 : range) * 4)
            << "worker " << w << " " << specs[t].name << " (" << r.data.bytes << " bytes)";
      }
    }
  };
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {1, 2}));
  check(2);
  PrepareMsg p;
  for (const std::vector<WorkerId>& workers :
       std::vector<std::vector<WorkerId>>{{1, 2, 3, 4}, {1, 2, 3}, {2, 3}}) {
    const int dp = static_cast<int>(workers.size());
    auto r = c.Propose(Config(dp, 1, 1), workers, Cluster::Defaults(), &p);
    for (auto& [w, res] : r) ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
    c.Verify(1);
    check(dp);
  }
}

// A prepare that pre-allocated and is then abandoned (its commit refused, then destroyed)
// releases every pre-allocated buffer, and the state is untouched.
TEST(SwitchTest, AbandonedPrepareReleasesItsPreallocatedShards) {
  CountingAllocator counting;
  SwitchOptions o = Cluster::Defaults();
  o.preallocate = ForAnyTensor(counting.Get());
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {1, 2}));
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg p, c.Decide(Config(4, 1, 1), {1, 2, 3, 4}));
  c.wait_for_preallocation_ = true;  // so that there is something to release
  int64_t held_before_abandon = 0;
  std::map<WorkerId, WorkerResult> r =
      c.Run(p, nullptr, o, [](CommitMsg& commit) { commit.next.plan_digest ^= 1; });
  for (auto& [w, res] : r) {
    EXPECT_EQ(res.status.code(), StatusCode::kFailedPrecondition) << w << ": " << res.status;
  }
  {
    std::lock_guard<std::mutex> l(counting.counts->mu);
    held_before_abandon = counting.counts->max_outstanding;
    EXPECT_GT(held_before_abandon, 0) << "nothing was pre-allocated";
    EXPECT_EQ(counting.counts->outstanding, 0) << "pre-allocated shards outlived the prepare";
  }
  c.Verify(1);  // nothing moved
}

// The switch passed its closing barrier: the change is applied everywhere, and the groups built
// for it are the new generation's. An abort of the old generation that reaches the prepared
// switch now (the coordinator saw an old member go) must leave them alone: aborting them made
// the new generation's first step fail, and its failure reports, sent before the change was
// applied, reached no one (failure_test, seeded kills).
TEST(SwitchTest, AnAbortAfterTheClosingBarrierLeavesTheNewGroupsAlone) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {10, 11}));
  c.abort_after_execute_ = true;
  PrepareMsg p;
  std::map<WorkerId, WorkerResult> results =
      c.Propose(Config(3, 1, 1), {10, 11, 12}, Cluster::Defaults(), &p);
  ASSERT_EQ(results.size(), 3u);
  for (auto& [w, r] : results) {
    EXPECT_TRUE(r.status.ok()) << "worker " << w << ": " << r.status;
    EXPECT_TRUE(r.has_groups) << "worker " << w;
    EXPECT_TRUE(r.groups_barrier.ok()) << "worker " << w << ": " << r.groups_barrier;
  }
}

TEST(SwitchTest, CommitThatDiffersFromThePrepareIsRefused) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(1, 1, 1), {1}));
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg p, c.Decide(Config(1, 1, 1), {2}));  // 1 hands over to 2
  std::map<WorkerId, WorkerResult> r = c.Run(
      p, [](WorkerId, SwitchOptions&, std::unique_ptr<PreparedSwitch>*) {}, Cluster::Defaults());
  for (auto& [w, res] : r) ASSERT_TRUE(res.status.ok()) << w << ": " << res.status;
  c.Verify(1);
  // Prepare 2 -> {1}, commit a different digest.
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg q, c.Decide(Config(1, 1, 1), {1}));
  MemoryStore store(c.table_, q.next.id);
  std::vector<Status> got(2);
  std::thread t1([&] {
    auto sw = PrepareSwitch(c.manifest_, 1, q, store, GlooFactory(c.device_), Cluster::Defaults(),
                            Deadline::AfterMs(20000));
    if (!sw.ok()) {
      got[0] = sw.status();
      return;
    }
    CommitMsg bad{q.next, q.from_generation, q.from, q.change};
    bad.next.plan_digest ^= 1;
    got[0] = ExecuteSwitch(**sw, bad, c.StateOf(1), Deadline::AfterMs(20000)).status();
  });
  std::thread t2([&] {
    auto sw = PrepareSwitch(c.manifest_, 2, q, store, GlooFactory(c.device_), Cluster::Defaults(),
                            Deadline::AfterMs(20000));
    got[1] = sw.status();
  });
  t1.join();
  t2.join();
  MORPH_EXPECT_OK(got[1]);
  EXPECT_EQ(got[0].code(), StatusCode::kFailedPrecondition) << got[0];
  EXPECT_NE(got[0].message().find("differs from the prepared generation 3: plan digest"),
            std::string::npos)
      << got[0];
  c.Verify(1);  // nothing moved
}

// A participant that disappears after the first batch: every other participant fails within
// its timeouts, at least one naming it, and none switches.
void DisappearMidTransfer(bool shared_memory) {
  constexpr WorkerId kVictim = 11;
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(2, 1, 1), {10, 11}));
  MORPH_ASSERT_OK_AND_ASSIGN(PrepareMsg p, c.Decide(Config(4, 1, 1), {10, 11, 12, 13}));
  SwitchOptions o = Cluster::Defaults();
  o.batch_bytes = 0;  // many batches
  o.timeout = std::chrono::seconds(5);
  o.transport.shared_memory = shared_memory;
  std::map<WorkerId, WorkerResult> r = c.Run(
      p,
      [&](WorkerId w, SwitchOptions& opt, std::unique_ptr<PreparedSwitch>* sw) {
        if (w != kVictim) return;
        opt.after_batch = [sw](int batch) {
          if (batch == 0) (*sw)->Abort();  // its connections close, as in a crash
        };
      },
      o);
  int named = 0;
  for (auto& [w, res] : r) {
    SCOPED_TRACE("worker " + std::to_string(w));
    ASSERT_FALSE(res.status.ok());
    std::fprintf(stderr, "worker %lld failed after %.3f s: %s\n", static_cast<long long>(w),
                 res.seconds, res.status.ToString().c_str());
    if (w == kVictim) {
      EXPECT_EQ(res.status.code(), StatusCode::kAborted);
      continue;
    }
    const StatusCode code = res.status.code();
    EXPECT_TRUE(code == StatusCode::kUnavailable || code == StatusCode::kAborted ||
                code == StatusCode::kDeadlineExceeded)
        << res.status;
    EXPECT_LT(res.seconds, 8.0);
    if (res.status.message().find("worker 11") != std::string::npos) ++named;
    EXPECT_NE(res.status.message().find("switch to generation 2"), std::string::npos);
    // Nothing switched: the state still says generation 1's layout (or nothing, on joiners).
    const StateStore& s = *c.states_.at(w);
    EXPECT_EQ(s.rank(), p.from.RankOf(w));
  }
  EXPECT_GE(named, 1) << "no participant named the one that disappeared";
  EXPECT_EQ(c.current_.id, 1);
}

TEST(SwitchTest, ParticipantThatDisappearsMidTransferFailsTheOthers) {
  DisappearMidTransfer(/*shared_memory=*/true);
}

TEST(SwitchTest, ParticipantThatDisappearsMidTransferFailsTheOthersOverTcp) {
  DisappearMidTransfer(/*shared_memory=*/false);
}

}  // namespace
}  // namespace morph
