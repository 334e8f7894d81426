// The switch engine over real Gloo communicators, workers as threads of this process sharing a
// MemoryStore (labels multiproc: many loopback connections). A small "coordinator" in the test
// derives each decision as the real one does (AssignRanks, ParticipantOrder, PlanForChange), so
// every worker checks the same digest. After every change each tensor's local shard must be
// bitwise its slice of a reference tensor, scalars must equal participant 0's, leavers hold
// nothing, and the measured peak must equal the predicted one and stay within the bound.
#include "runtime/agent/switch.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "base/testing.h"
#include "collectives/gloo_communicator.h"
#include "collectives/rank_harness.h"
#include "reshard/reshard_testutil.h"
#include "runtime/protocol/plan_input.h"
#include "runtime/protocol/recovery.h"

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;

ParallelConfig Config(int dp, int tp, int pp) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(2, pp);
  c.zero_stage = 1;
  return c;
}

// Two layers: TP-split weights (column and row), ZeRO-sharded moments (TP-split and not, uneven
// ranges), replicated norms; f32 and bf16.
std::vector<TensorSpec> Tensors() {
  return {
      {"l0.w", DType::kF32, {64, 48}, Layout::Layer(0).SplitTP(1)},
      {"l0.w.exp_avg", DType::kF32, {64, 48}, Layout::Layer(0).SplitTP(1).ZeroShard()},
      {"l0.b", DType::kBF16, {48}, Layout::Layer(0).SplitTP(0)},
      {"emb.exp_avg", DType::kF32, {33, 5}, Layout::Layer(0).ZeroShard()},
      {"l1.w", DType::kBF16, {48, 64}, Layout::Layer(1).SplitTP(0)},
      {"l1.w.exp_avg_sq", DType::kF32, {48, 64}, Layout::Layer(1).SplitTP(0).ZeroShard()},
      {"l1.ln", DType::kF32, {7}, Layout::Layer(1)},
      {"l1.ln.exp_avg", DType::kF32, {77}, Layout::Layer(1).ZeroShard()},
  };
}

const std::vector<ScalarSpec> kScalars = {{"step", 8}, {"rng", 24}, {"lr_schedule", 16}};

std::vector<std::byte> ScalarValue(const ScalarSpec& s, int64_t generation) {
  std::vector<std::byte> v(static_cast<size_t>(s.bytes));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<std::byte>(s.name.size() * 31 + i * 7 + static_cast<size_t>(generation));
  }
  return v;
}

struct WorkerResult {
  Status status;
  SwitchStats stats;
  int64_t predicted_peak = 0;
  bool has_groups = false;
  int group_rank = -1;
  double seconds = 0;
};

class Cluster {
 public:
  explicit Cluster(std::vector<TensorSpec> tensors = Tensors()) {
    manifest_.model.num_layers = 2;
    manifest_.tensors = std::move(tensors);
    manifest_.scalars = kScalars;
    // Small messages and staging, so that the staging term does not hide the state bound.
    manifest_.chunk_bytes = 4096;
    manifest_.staging_bytes = 16384;
    for (size_t i = 0; i < manifest_.tensors.size(); ++i) {
      const TensorSpec& t = manifest_.tensors[i];
      reference_.push_back(
          testutil::ReferenceTensor(TensorInfo{t.name, t.dtype, t.shape}, static_cast<int>(i)));
    }
    device_ = *GlooDevice::Create(GlooOptions{});
  }

  // One Gloo device (event loop, listening address) per worker, as in separate processes.
  std::shared_ptr<GlooDevice> DeviceOf(WorkerId w) {
    auto& d = devices_[w];
    if (!d) d = *GlooDevice::Create(GlooOptions{});
    return d;
  }

  State& StateOf(WorkerId w) {
    auto& s = states_[w];
    if (!s) {
      s = std::make_unique<State>();
      for (const TensorSpec& t : manifest_.tensors) {
        EXPECT_TRUE(s->AddTensor(t.name, t.shape, t.dtype, t.layout).ok());
      }
      for (const ScalarSpec& sc : manifest_.scalars)
        EXPECT_TRUE(s->AddScalar(sc.name, sc.bytes).ok());
    }
    return *s;
  }

  // The coordinator's decision for generation current+1 over `candidates`.
  StatusOr<PrepareMsg> Decide(const ParallelConfig& config,
                              const std::vector<WorkerId>& candidates) {
    PrepareMsg p;
    p.from = current_;
    p.from_generation = current_.id;
    next_id_ = std::max(next_id_, current_.id) + 1;
    p.next.id = next_id_;
    p.next.config = config;
    MORPH_ASSIGN_OR_RETURN(p.next.ranks, AssignRanks(manifest_, current_, {}, candidates, config));
    p.change.participants = ParticipantOrder(current_, {}, p.next.ranks);
    for (WorkerId w : current_.ranks) {
      if (p.next.RankOf(w) < 0) {
        p.change.leavers.push_back(w);
        p.change.exiting.push_back(w);
      }
    }
    MORPH_ASSIGN_OR_RETURN(ChangePlan plan, PlanForChange(manifest_, p.from, p.next, p.change));
    p.next.plan_digest = plan.digest;
    return p;
  }

  // Every participant prepares and executes the switch on its own thread.
  std::map<WorkerId, WorkerResult> Run(
      const PrepareMsg& prepare,
      const std::function<void(WorkerId, SwitchOptions&, std::unique_ptr<PreparedSwitch>*)>& tweak =
          nullptr,
      const SwitchOptions& base = Defaults(),
      const std::function<void(CommitMsg&)>& edit_commit = nullptr) {
    CommitMsg commit{prepare.next, prepare.from_generation, prepare.from, prepare.change};
    commit.next.start_step = 100 * commit.next.id;
    if (edit_commit) edit_commit(commit);
    std::vector<WorkerId> workers = prepare.change.participants;
    if (prepare.from.id == 0) workers = prepare.next.ranks;
    std::map<WorkerId, CommunicatorFactory> factories;
    for (WorkerId w : workers) {
      StateOf(w);  // registration, on this thread
      factories[w] = GlooFactory(DeviceOf(w));
    }
    std::map<WorkerId, WorkerResult> results;
    std::mutex mu;
    std::condition_variable cv;
    size_t prepared = 0;
    bool all_prepared = true;
    std::vector<std::thread> threads;
    for (WorkerId w : workers) {
      threads.emplace_back([&, w] {
        WorkerResult r;
        const auto start = Clock::now();
        std::unique_ptr<PreparedSwitch> sw;
        SwitchOptions options = base;
        if (tweak) tweak(w, options, &sw);
        MemoryStore store(table_, prepare.next.id);
        r.status = [&]() -> Status {
          const Deadline deadline = Deadline::AfterMs(30000);
          auto p = PrepareSwitch(manifest_, w, prepare, store, factories.at(w), options, deadline);
          {
            // As the coordinator: commit only once every participant prepared, else abandon.
            std::unique_lock<std::mutex> lock(mu);
            all_prepared &= p.ok();
            if (++prepared == workers.size()) cv.notify_all();
            cv.wait(lock, [&] { return prepared == workers.size(); });
            if (p.ok() && !all_prepared) return AbortedError("abandoned: a peer failed to prepare");
          }
          MORPH_ASSIGN_OR_RETURN(sw, std::move(p));
          if (wait_for_preallocation_) sw->WaitForPreallocation();
          r.predicted_peak = sw->predicted_peak_bytes();
          MORPH_ASSIGN_OR_RETURN(r.stats, ExecuteSwitch(*sw, commit, *states_.at(w), deadline));
          std::unique_ptr<GroupSet> groups = TakeGroups(*sw);
          r.has_groups = groups != nullptr;
          if (groups) r.group_rank = groups->rank();
          return Status::Ok();
        }();
        r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
        sw.reset();
        std::lock_guard<std::mutex> lock(mu);
        results[w] = std::move(r);
      });
    }
    for (std::thread& t : threads) t.join();
    bool ok = true;
    for (auto& [w, r] : results) ok &= r.status.ok();
    if (ok) current_ = commit.next;
    last_run_prepared_ = all_prepared;
    return results;
  }

  static SwitchOptions Defaults() {
    SwitchOptions o;
    o.batch_bytes = 16 << 10;
    o.timeout = std::chrono::seconds(10);
    return o;
  }

  // Decide + Run; a proposal some participant could not prepare for (its communicators failed
  // to build) is abandoned and proposed again under a fresh generation, as the coordinator does.
  std::map<WorkerId, WorkerResult> Propose(const ParallelConfig& config,
                                           const std::vector<WorkerId>& candidates,
                                           const SwitchOptions& options, PrepareMsg* out) {
    std::map<WorkerId, WorkerResult> r;
    for (int attempt = 0; attempt < 3; ++attempt) {
      auto p = Decide(config, candidates);
      EXPECT_TRUE(p.ok()) << p.status();
      if (!p.ok()) return r;
      *out = *p;
      r = Run(*p, nullptr, options);
      if (last_run_prepared_) return r;
      for (auto& [w, res] : r) {
        if (!res.status.ok()) {
          std::fprintf(stderr, "generation %lld abandoned (worker %lld: %s); proposing again\n",
                       static_cast<long long>(p->next.id), static_cast<long long>(w),
                       res.status.ToString().c_str());
        }
      }
      ++abandoned_;
    }
    return r;
  }

  // The first generation: Materialize, then fill every shard from the reference and set the
  // scalars.
  void Start(const ParallelConfig& config, const std::vector<WorkerId>& workers) {
    PrepareMsg p;
    std::map<WorkerId, WorkerResult> r = Propose(config, workers, Defaults(), &p);
    for (auto& [w, res] : r) ASSERT_TRUE(res.status.ok()) << "worker " << w << ": " << res.status;
    for (WorkerId w : current_.ranks) {
      State& s = *states_.at(w);
      for (size_t i = 0; i < manifest_.tensors.size(); ++i) {
        State::TensorRef t = s.TensorAt(i);
        const std::vector<char> want = Slice(i, t.shard);
        ASSERT_EQ(t.data.bytes, want.size());
        if (!want.empty()) std::memcpy(t.data.data, want.data(), want.size());
      }
      for (const ScalarSpec& sc : manifest_.scalars) {
        std::span<std::byte> v = *s.scalar(sc.name);
        const std::vector<std::byte> want = ScalarValue(sc, current_.id);
        std::memcpy(v.data(), want.data(), want.size());
      }
    }
    Verify(current_.id);
  }

  std::vector<char> Slice(size_t tensor, const Shard& shard) const {
    const TensorSpec& t = manifest_.tensors[tensor];
    return testutil::ExtractShard(TensorInfo{t.name, t.dtype, t.shape}, shard, reference_[tensor]);
  }

  // Every worker's state is what `current_` says; scalars are those set at `scalar_generation`.
  void Verify(int64_t scalar_generation) {
    for (auto& [w, s] : states_) {
      const int rank = current_.RankOf(w);
      SCOPED_TRACE("worker " + std::to_string(w) + " rank " + std::to_string(rank));
      EXPECT_EQ(s->rank(), rank);
      EXPECT_TRUE(s->intact());
      if (rank < 0) {
        EXPECT_EQ(s->local_bytes(), 0) << "a worker without a rank holds state";
        continue;
      }
      ASSERT_NE(s->config(), nullptr);
      EXPECT_EQ(*s->config(), current_.config);
      for (size_t i = 0; i < manifest_.tensors.size(); ++i) {
        const TensorSpec& spec = manifest_.tensors[i];
        State::TensorRef t = s->TensorAt(i);
        MORPH_ASSERT_OK_AND_ASSIGN(Shard want_shard, ShardOf(spec, current_.config, rank));
        if (!want_shard.empty()) {
          EXPECT_EQ(t.shard, want_shard) << spec.name;
        }
        const std::vector<char> want = Slice(i, want_shard);
        ASSERT_EQ(t.data.bytes, want.size()) << spec.name;
        EXPECT_TRUE(want.empty() || std::memcmp(t.data.data, want.data(), want.size()) == 0)
            << spec.name << " differs from its slice";
      }
      for (const ScalarSpec& sc : manifest_.scalars) {
        std::span<std::byte> v = *s->scalar(sc.name);
        const std::vector<std::byte> want = ScalarValue(sc, scalar_generation);
        EXPECT_TRUE(std::equal(v.begin(), v.end(), want.begin(), want.end())) << sc.name;
      }
    }
  }

  // A change that must succeed: bitwise state, scalars, groups, and the memory bound.
  void Change(const ParallelConfig& config, const std::vector<WorkerId>& candidates,
              bool expect_sign_consistent, const SwitchOptions& options = Defaults()) {
    const int64_t scalar_gen = scalar_generation_;
    PrepareMsg p;
    std::map<WorkerId, WorkerResult> r = Propose(config, candidates, options, &p);
    for (auto& [w, res] : r) {
      ASSERT_TRUE(res.status.ok()) << "worker " << w << ": " << res.status;
    }
    for (auto& [w, res] : r) {
      const SwitchStats& st = res.stats;
      SCOPED_TRACE("worker " + std::to_string(w));
      EXPECT_EQ(res.has_groups, p.next.RankOf(w) >= 0);
      if (res.has_groups) {
        EXPECT_EQ(res.group_rank, p.next.RankOf(w));
      }
      EXPECT_EQ(st.peak_state_bytes, res.predicted_peak);
      EXPECT_LE(st.peak_bytes, st.peak_state_bytes + st.peak_staging_bytes);
      EXPECT_LE(st.peak_staging_bytes, static_cast<int64_t>(manifest_.staging_bytes));
      EXPECT_LE(st.largest_batch_bytes, std::max<int64_t>(static_cast<int64_t>(options.batch_bytes),
                                                          st.largest_shard_bytes));
      if (options.batch_bytes == 0) {
        EXPECT_EQ(st.largest_batch_bytes, st.largest_shard_bytes);
      }
      if (expect_sign_consistent) {
        EXPECT_TRUE(st.sign_consistent);
      }
      if (st.sign_consistent) {
        EXPECT_LE(st.peak_state_bytes,
                  std::max(st.old_bytes, st.new_bytes) + st.largest_batch_bytes);
        EXPECT_LE(st.peak_bytes, st.bound_bytes);
      }
      std::fprintf(stderr,
                   "gen %lld worker %lld: old %lld new %lld peak state %lld (+staging %lld) "
                   "bound %lld%s, %d batches, sent %lld received %lld copied %lld\n",
                   static_cast<long long>(p.next.id), static_cast<long long>(w),
                   static_cast<long long>(st.old_bytes), static_cast<long long>(st.new_bytes),
                   static_cast<long long>(st.peak_state_bytes),
                   static_cast<long long>(st.peak_staging_bytes),
                   static_cast<long long>(st.bound_bytes),
                   st.sign_consistent ? "" : " (not sign-consistent)", st.batches,
                   static_cast<long long>(st.bytes_sent), static_cast<long long>(st.bytes_received),
                   static_cast<long long>(st.bytes_copied));
    }
    Verify(scalar_gen);
  }

  JobManifest manifest_;
  std::vector<std::vector<char>> reference_;
  std::shared_ptr<KvTable> table_ = std::make_shared<KvTable>();
  std::shared_ptr<GlooDevice> device_;
  std::map<WorkerId, std::shared_ptr<GlooDevice>> devices_;
  int64_t next_id_ = 0;
  int abandoned_ = 0;  // proposals abandoned because communicators failed to build
  bool last_run_prepared_ = true;
  bool wait_for_preallocation_ = false;  // before executing (else ExecuteSwitch waits per shard)
  std::map<WorkerId, std::unique_ptr<State>> states_;
  Generation current_;
  int64_t scalar_generation_ = 1;
};

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
  o.preallocate = counting.Get();
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
    if (preallocate) o.preallocate = HostAllocator();
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

// A prepare that pre-allocated and is then abandoned (its commit refused, then destroyed)
// releases every pre-allocated buffer, and the state is untouched.
TEST(SwitchTest, AbandonedPrepareReleasesItsPreallocatedShards) {
  CountingAllocator counting;
  SwitchOptions o = Cluster::Defaults();
  o.preallocate = counting.Get();
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
    const State& s = *c.states_.at(w);
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

// One rank's buddy snapshot as the BuddySnapshotter keeps it: a host copy of every shard and
// scalar of a State at one step.
struct HostSnapshot {
  std::vector<std::vector<char>> tensors;
  std::vector<std::vector<std::byte>> scalars;
  SnapshotData data;
};

// `sent` (a held copy): only the tensors its rank sends to its buddy (BuddyCopiedTensors), the
// others listed with an empty shard, as the buddy receives them.
std::unique_ptr<HostSnapshot> TakeSnapshot(const State& s, int64_t generation, int64_t step,
                                           const std::vector<bool>& sent = {}) {
  auto out = std::make_unique<HostSnapshot>();
  SnapshotData& d = out->data;
  d.generation = generation;
  d.step = step;
  d.rank = s.rank();
  d.config = *s.config();
  for (size_t t = 0; t < s.tensors().size(); ++t) {
    State::TensorRef ref = s.TensorAt(t);
    if (!sent.empty() && !sent[t]) {
      out->tensors.emplace_back();
      d.shards.emplace_back();
      continue;
    }
    const char* p = static_cast<const char*>(ref.data.data);
    out->tensors.emplace_back(p, p + ref.data.bytes);
    d.shards.push_back(ref.shard);
  }
  for (size_t k = 0; k < s.scalars().size(); ++k) {
    std::span<const std::byte> v = s.ScalarAt(k);
    out->scalars.emplace_back(v.begin(), v.end());
  }
  for (const auto& t : out->tensors) {
    d.tensors.emplace_back(t.empty() ? nullptr : t.data(), t.size(), MemoryKind::kHost);
  }
  for (const auto& v : out->scalars) d.scalars.emplace_back(v.data(), v.size());
  return out;
}

// Plain ZeRO (each moment shard exactly once): a dead rank's moments survive only in its
// buddy's snapshot, and only they went there (BuddyCopiedTensors: the DP-replicated tensors
// have a copy on the other host). Every rank rolls back to the snapshot step from its own copy,
// the dead rank's replicated pieces come from the survivors' own copies and its moments from
// its buddy's, and the result is bitwise the snapshot's state. With `big` tensors (page-mapped
// storage) and pre-allocation on, as in the runtime, the live shards are reused: restored in
// place where the new shard is the live one, their pages recycled for the others.
void SnapshotRecovery(bool big) {
  std::vector<TensorSpec> tensors = Tensors();
  if (big) {
    tensors = {{"w", DType::kF32, {512, 1024}, Layout::Layer(0)},
               {"w.m", DType::kF32, {512, 1024}, Layout::Layer(0).ZeroShard()},
               {"v", DType::kF32, {256, 1024}, Layout::Layer(1)},
               {"v.m", DType::kF32, {1024, 1024}, Layout::Layer(1).ZeroShard()}};
  }
  Cluster c(tensors);
  const std::vector<WorkerId> workers = {1, 2, 3, 4};
  ASSERT_NO_FATAL_FAILURE(c.Start(Config(4, 1, 1), workers));
  const Generation from = c.current_;
  const int64_t snap_step = from.start_step + 8;
  const int64_t now_step = from.start_step + 10;
  // Hosts a, a, b, b: rank r's buddy is (r + 2) % 4, so rank r holds the copy of rank (r + 2) % 4.
  const std::vector<std::string> hosts = {"a", "a", "b", "b"};
  const std::vector<int> buddy = BuddyRanks(hosts);
  ASSERT_EQ(buddy, (std::vector<int>{2, 3, 0, 1}));
  std::map<WorkerId, std::unique_ptr<HostSnapshot>> local, held;
  std::map<int, std::vector<int64_t>> held_tensors;  // by the ward's rank
  for (int r = 0; r < 4; ++r) {
    const WorkerId w = from.ranks[static_cast<size_t>(r)];
    const std::vector<bool> sent = BuddyCopiedTensors(tensors, from.config, r, hosts);
    for (size_t t = 0; t < tensors.size(); ++t) {
      // Moments (ZeRO, one copy each) go to the buddy; replicated tensors do not.
      EXPECT_EQ(sent[t], tensors[t].layout.zero_sharded()) << tensors[t].name << " rank " << r;
      if (sent[t] && !c.states_.at(w)->TensorAt(t).shard.empty()) {
        held_tensors[r].push_back(static_cast<int64_t>(t));
      }
    }
    local[w] = TakeSnapshot(*c.states_.at(w), from.id, snap_step);
    held[from.ranks[static_cast<size_t>(buddy[static_cast<size_t>(r)])]] =
        TakeSnapshot(*c.states_.at(w), from.id, snap_step, sent);
  }
  // Training went on past the snapshot: the live state no longer holds its values.
  for (WorkerId w : workers) {
    State& s = *c.states_.at(w);
    for (size_t t = 0; t < s.tensors().size(); ++t) {
      State::TensorRef ref = s.TensorAt(t);
      if (ref.data.bytes > 0) std::memset(ref.data.data, 0x5a, ref.data.bytes);
    }
    for (const ScalarSpec& sc : c.manifest_.scalars) {
      std::span<std::byte> v = *s.scalar(sc.name);
      std::fill(v.begin(), v.end(), std::byte{0x77});
    }
  }
  // Worker 2 (rank 1) dies; worker 4 (rank 3) holds its copy.
  const WorkerId dead = 2;
  PrepareMsg p{.from_generation = from.id, .from = from};
  p.next = Generation{.id = from.id + 1, .config = Config(3, 1, 1)};
  p.change.lost = {dead};
  p.change.recovery = true;
  const std::vector<WorkerId> survivors = {1, 3, 4};
  MORPH_ASSERT_OK_AND_ASSIGN(
      p.next.ranks, AssignRanks(c.manifest_, from, p.change.lost, survivors, p.next.config));
  p.change.participants = ParticipantOrder(from, p.change.lost, p.next.ranks);
  std::vector<StepReportMsg> reports;
  for (WorkerId w : survivors) {
    const int r = from.RankOf(w);
    const int ward = static_cast<int>(std::find(buddy.begin(), buddy.end(), r) - buddy.begin());
    reports.push_back({.worker = w, .generation = p.next.id, .last_free_step = now_step,
                       .state_step = now_step, .state_ok = true,
                       .snapshots = {.local_step = snap_step, .local_prev_step = snap_step - 4,
                                     .held_step = snap_step, .held_prev_step = snap_step - 4,
                                     .held_rank = ward, .held_tensors = held_tensors[ward]}});
  }
  const std::string moment = tensors[1].name;  // rank 1 holds a range of it
  // Without the buddy's held copy, nothing covers rank 1's moments: the error names a piece.
  {
    std::vector<StepReportMsg> no_held = reports;
    for (StepReportMsg& r : no_held) r.snapshots.held_step = r.snapshots.held_prev_step = -1;
    StatusOr<RecoveryChoice> none =
        ChooseRecovery(c.manifest_, from, p.next, p.change, no_held, std::nullopt);
    EXPECT_EQ(none.status().code(), StatusCode::kDataLoss) << none.status();
    EXPECT_NE(none.status().message().find("snapshots: no snapshot copy of tensor '" + moment +
                                           "' box "),
              std::string::npos)
        << none.status();
  }
  // A held copy that does not hold a tensor the exchange needs from it is no copy of it.
  {
    std::vector<StepReportMsg> partial = reports;
    for (StepReportMsg& r : partial) {
      if (r.snapshots.held_rank == 1) std::erase(r.snapshots.held_tensors, 1);
    }
    StatusOr<RecoveryChoice> none =
        ChooseRecovery(c.manifest_, from, p.next, p.change, partial, std::nullopt);
    EXPECT_EQ(none.status().code(), StatusCode::kDataLoss) << none.status();
    EXPECT_NE(none.status().message().find("no snapshot copy of tensor '" + moment + "' box "),
              std::string::npos)
        << none.status();
  }
  MORPH_ASSERT_OK_AND_ASSIGN(RecoveryChoice choice,
                             ChooseRecovery(c.manifest_, from, p.next, p.change, reports,
                                            std::nullopt));
  EXPECT_EQ(choice.decision.source, RecoveryDecision::Source::kSnapshot) << choice.explanation;
  EXPECT_EQ(choice.resume_step, snap_step);
  EXPECT_EQ(choice.decision.newest_step, now_step);
  EXPECT_TRUE(choice.stale.empty());
  EXPECT_EQ(choice.decision.snapshot_holders, (std::vector<WorkerId>{1, 4, 3, 4}));
  EXPECT_NE(choice.explanation.find("from snapshot of step " + std::to_string(snap_step)),
            std::string::npos);
  {
    // A checkpoint of a later step loses fewer steps and wins; one of an earlier step does not.
    StatusOr<RecoveryChoice> newer = ChooseRecovery(
        c.manifest_, from, p.next, p.change, reports,
        RecoveryCheckpoint{.step = snap_step + 1, .path = "/ckpt/newer"});
    ASSERT_TRUE(newer.ok()) << newer.status();
    EXPECT_EQ(newer->decision.source, RecoveryDecision::Source::kCheckpoint);
    EXPECT_EQ(newer->resume_step, snap_step + 1);
    StatusOr<RecoveryChoice> older = ChooseRecovery(
        c.manifest_, from, p.next, p.change, reports,
        RecoveryCheckpoint{.step = snap_step, .path = "/ckpt/same"});
    ASSERT_TRUE(older.ok()) << older.status();
    EXPECT_EQ(older->decision.source, RecoveryDecision::Source::kSnapshot);
  }

  auto edit = [&](CommitMsg& commit) {
    commit.next.start_step = choice.resume_step;
    commit.next.plan_digest = choice.plan_digest;
    commit.change.stale = choice.stale;
    commit.recovery = choice.decision;
  };
  std::mutex notes_mu;
  std::map<WorkerId, std::pair<int64_t, std::vector<bool>>> notes;  // restored_from_own_snapshot
  auto tweak = [&](WorkerId w, SwitchOptions& o, std::unique_ptr<PreparedSwitch>*) {
    o.snapshot = [&, w](int64_t step, bool is_held) -> const SnapshotData* {
      auto& m = is_held ? held : local;
      auto it = m.find(w);
      return it == m.end() || it->second->data.step != step ? nullptr : &it->second->data;
    };
    o.restored_from_own_snapshot = [&, w](int64_t step, std::vector<bool> tensors) {
      std::lock_guard<std::mutex> l(notes_mu);
      notes[w] = {step, std::move(tensors)};
    };
  };
  c.states_.erase(dead);
  SwitchOptions options = Cluster::Defaults();
  if (big) options.preallocate = HostAllocator();
  std::map<WorkerId, WorkerResult> r = c.Run(p, tweak, options, edit);
  ASSERT_EQ(r.size(), 3u);
  int64_t received = 0;
  for (auto& [w, res] : r) {
    ASSERT_TRUE(res.status.ok()) << "worker " << w << ": " << res.status;
    EXPECT_EQ(res.stats.batches, 2) << "two rounds";
    received += res.stats.bytes_received;
    if (big) {
      // w and v stay whole on every rank: restored in place; the moments' new ranges take the
      // pages of the old ones.
      EXPECT_EQ(res.stats.shards_kept, 2) << "worker " << w;
      EXPECT_GT(res.stats.recycled_bytes, 0) << "worker " << w;
    }
    // The replicated tensors were written whole from the worker's own copy, the moments not.
    ASSERT_EQ(notes.count(w), 1u) << "worker " << w;
    EXPECT_EQ(notes[w].first, snap_step);
    std::vector<bool> want;
    for (const TensorSpec& t : tensors) want.push_back(!t.layout.zero_sharded());
    EXPECT_EQ(notes[w].second, want) << "worker " << w;
  }
  EXPECT_GT(received, 0);
  ASSERT_EQ(c.current_.id, p.next.id);
  // Scalars as set at the start (the snapshot's), tensors bitwise their reference slices.
  c.Verify(from.id);
}

TEST(SwitchTest, SnapshotRecoveryRollsEveryRankBackBitwise) { SnapshotRecovery(/*big=*/false); }

TEST(SwitchTest, SnapshotRecoveryReusesTheLiveShardsMemory) { SnapshotRecovery(/*big=*/true); }

}  // namespace
}  // namespace morph
