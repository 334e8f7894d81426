// A recovery from buddy snapshots through the switch engine (switch.h "Recovery",
// runtime/plan/snapshot_plan.h): workers as threads over Gloo (switch_test_cluster.h), the
// coordinator's choice by ChooseRecovery, every rank rolled back bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "runtime/switch/switch.h"
#include "runtime/switch/switch_testutil.h"
#include "runtime/plan/choose_recovery.h"
#include "runtime/recovery/snapshot.h"

namespace morph {
namespace {

using namespace ::morph::switch_testing;  // NOLINT

// One rank's buddy snapshot as the BuddySnapshotter keeps it: a host copy of every shard and
// scalar of a State at one step.
struct HostSnapshot {
  std::vector<std::vector<char>> tensors;
  std::vector<std::vector<std::byte>> scalars;
  SnapshotData data;
};

// `sent` (a held copy): only the tensors its rank sends to its buddy (BuddyCopiedTensors), the
// others listed with an empty shard, as the buddy receives them.
std::unique_ptr<HostSnapshot> TakeSnapshot(const StateStore& s, int64_t generation, int64_t step,
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
    StateStore& s = *c.states_.at(w);
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
    reports.push_back({.worker = w,
                       .generation = p.next.id,
                       .last_free_step = now_step,
                       .state_step = now_step,
                       .state_ok = true,
                       .snapshots = {.local_step = snap_step,
                                     .local_prev_step = snap_step - 4,
                                     .held_step = snap_step,
                                     .held_prev_step = snap_step - 4,
                                     .held_rank = ward,
                                     .held_tensors = held_tensors[ward]}});
  }
  const std::string moment = tensors[1].name;  // rank 1 holds a range of it
  // Without the buddy's held copy, nothing covers rank 1's moments: the error names a piece.
  {
    std::vector<StepReportMsg> no_held = reports;
    for (StepReportMsg& r : no_held) r.snapshots.held_step = r.snapshots.held_prev_step = -1;
    StatusOr<RecoveryChoice> none =
        ChooseRecovery(c.manifest_, from, p.next, p.change, no_held, std::nullopt);
    EXPECT_EQ(none.status().code(), StatusCode::kDataLoss) << none.status();
    EXPECT_NE(
        none.status().message().find("snapshots: no snapshot copy of tensor '" + moment + "' box "),
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
  MORPH_ASSERT_OK_AND_ASSIGN(
      RecoveryChoice choice,
      ChooseRecovery(c.manifest_, from, p.next, p.change, reports, std::nullopt));
  EXPECT_EQ(choice.decision.source, RecoveryDecision::Source::kSnapshot) << choice.explanation;
  EXPECT_EQ(choice.resume_step, snap_step);
  EXPECT_EQ(choice.decision.newest_step, now_step);
  EXPECT_TRUE(choice.stale.empty());
  EXPECT_EQ(choice.decision.snapshot_holders, (std::vector<WorkerId>{1, 4, 3, 4}));
  EXPECT_NE(choice.explanation.find("from snapshot of step " + std::to_string(snap_step)),
            std::string::npos);
  {
    // A checkpoint of a later step loses fewer steps and wins; one of an earlier step does not.
    StatusOr<RecoveryChoice> newer =
        ChooseRecovery(c.manifest_, from, p.next, p.change, reports,
                       RecoveryCheckpoint{.step = snap_step + 1, .path = "/ckpt/newer"});
    ASSERT_TRUE(newer.ok()) << newer.status();
    EXPECT_EQ(newer->decision.source, RecoveryDecision::Source::kCheckpoint);
    EXPECT_EQ(newer->resume_step, snap_step + 1);
    StatusOr<RecoveryChoice> older =
        ChooseRecovery(c.manifest_, from, p.next, p.change, reports,
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
  if (big) options.preallocate = ForAnyTensor(HostAllocator());
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
