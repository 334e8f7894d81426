// The switch engine's test harness (switch_test.cc, switch_snapshot_test.cc): workers as threads
// of one process sharing a MemoryStore, each with its own Gloo device, and a small
// "coordinator" that derives each decision as the real one does (AssignRanks, ParticipantOrder,
// PlanForChange), so every worker checks the same digest. Cluster::Verify checks every tensor's
// local shard bitwise against its slice of a reference tensor. Not installed.
#ifndef MORPH_RUNTIME_SWITCH_SWITCH_TESTUTIL_H_
#define MORPH_RUNTIME_SWITCH_SWITCH_TESTUTIL_H_

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/testing/rank_harness.h"
#include "reshard/reshard_testutil.h"
#include "runtime/switch/switch.h"
#include "runtime/plan/plan_input.h"

namespace morph::switch_testing {

using Clock = std::chrono::steady_clock;

inline ParallelConfig Config(int dp, int tp, int pp) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(2, pp);
  c.zero_stage = 1;
  return c;
}

// Two layers: TP-split weights (column and row), ZeRO-sharded moments (TP-split and not, uneven
// ranges), replicated norms; f32 and bf16.
inline std::vector<TensorSpec> Tensors() {
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

inline const std::vector<ScalarSpec> kScalars = {{"step", 8}, {"rng", 24}, {"lr_schedule", 16}};

inline std::vector<std::byte> ScalarValue(const ScalarSpec& s, int64_t generation) {
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
  Status groups_barrier;  // a barrier on the new world (with Cluster::abort_after_execute_)
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

  StateStore& StateOf(WorkerId w) {
    auto& s = states_[w];
    if (!s) {
      s = std::make_unique<StateStore>();
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
      factories[w] = factory_of_ ? factory_of_(w) : GlooFactory(DeviceOf(w));
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
          // An abort of the old generation that arrives after the closing barrier (a peer's
          // death reported late) before the groups are taken.
          if (abort_after_execute_) sw->Abort();
          std::unique_ptr<GroupSet> groups = TakeGroups(*sw);
          r.has_groups = groups != nullptr;
          if (groups) r.group_rank = groups->rank();
          if (groups && abort_after_execute_) {
            r.groups_barrier = groups->world().Barrier(std::chrono::seconds(10));
          }
          return Status::Ok();
        }();
        r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
        if (before_release_) before_release_(w);
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

  bool abort_after_execute_ = false;

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
      StateStore& s = *states_.at(w);
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
  // The factory a worker's PrepareSwitch gets (null: Gloo on the worker's device).
  std::function<CommunicatorFactory(WorkerId)> factory_of_;
  // Called on a worker's thread before its PreparedSwitch is destroyed (tests that call into it
  // from another thread wait there for that call to end).
  std::function<void(WorkerId)> before_release_;
  bool wait_for_preallocation_ = false;  // before executing (else ExecuteSwitch waits per shard)
  std::map<WorkerId, std::unique_ptr<StateStore>> states_;
  Generation current_;
  int64_t scalar_generation_ = 1;
};

}  // namespace morph::switch_testing

#endif  // MORPH_RUNTIME_SWITCH_SWITCH_TESTUTIL_H_
