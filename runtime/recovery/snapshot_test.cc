// Buddy snapshots over real Gloo communicators on loopback: ranks as threads (the held copies
// equal the ward's state at the snapshot step, bitwise, while training mutates the state), and
// as forked processes where the buddy is SIGKILLed mid-transfer (label fault).
#include "runtime/recovery/snapshot.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "base/testing.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/store/tcp_store.h"
#include "runtime/state/state_testutil.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace ::morph::state_testutil;  // NOLINT

constexpr char kToken[] = "snapshot-test-token";

uint64_t SeedAt(int64_t step) { return 100 + static_cast<uint64_t>(step); }

// OK when `snap` holds exactly `expected`'s shards, bytes and scalars; with `sent` (a held
// copy), only the tensors its rank sends, the others as empty shards.
Status SameAs(const SnapshotData* snap, const StateStore& expected, int64_t step, const char* what,
              const std::vector<bool>& sent = {}) {
  const std::string name = std::string(what) + " snapshot of step " + std::to_string(step);
  if (snap == nullptr) return NotFoundError(name + " is not held");
  if (snap->step != step || snap->rank != expected.rank()) {
    return InternalError(name + " is of step " + std::to_string(snap->step) + " rank " +
                         std::to_string(snap->rank));
  }
  if (!(snap->config == *expected.config())) return InternalError(name + ": config differs");
  if (snap->shards.size() != expected.tensors().size() ||
      snap->scalars.size() != expected.scalars().size()) {
    return InternalError(name + ": tensor or scalar count differs");
  }
  for (size_t i = 0; i < snap->shards.size(); ++i) {
    const State::TensorRef r = expected.TensorAt(i);
    if (!sent.empty() && !sent[i]) {
      if (!snap->shards[i].empty() || snap->tensors[i].bytes != 0) {
        return InternalError(name + ": tensor '" + r.spec->name + "' was not to be sent");
      }
      continue;
    }
    if (!(snap->shards[i] == r.shard) || snap->tensors[i].bytes != r.data.bytes ||
        (r.data.bytes > 0 && std::memcmp(snap->tensors[i].data, r.data.data, r.data.bytes) != 0)) {
      return InternalError(name + ": tensor '" + r.spec->name + "' differs");
    }
  }
  for (size_t k = 0; k < snap->scalars.size(); ++k) {
    const auto want = expected.ScalarAt(k);
    if (snap->scalars[k].size() != want.size() ||
        !std::equal(want.begin(), want.end(), snap->scalars[k].begin())) {
      return InternalError(name + ": scalar '" + expected.scalars()[k].name + "' differs");
    }
  }
  return Status::Ok();
}

TEST(BuddyRanksTest, SamePositionOnTheNextHostAndAPermutation) {
  const std::vector<std::string> two_by_two = {"a", "a", "b", "b"};
  EXPECT_THAT(BuddyRanks(two_by_two), ElementsAre(2, 3, 0, 1));
  const std::vector<std::string> three_hosts = {"a", "b", "c", "a", "b", "c"};
  // Order a: 0 3, b: 1 4, c: 2 5; shift 2.
  EXPECT_THAT(BuddyRanks(three_hosts), ElementsAre(1, 2, 0, 4, 5, 3));
  const std::vector<std::string> one_host = {"h", "h", "h"};
  EXPECT_THAT(BuddyRanks(one_host), ElementsAre(1, 2, 0));
  const std::vector<std::string> single = {"h"};
  EXPECT_THAT(BuddyRanks(single), ElementsAre(0));
  const std::vector<std::string> uneven = {"a", "a", "a", "b", "c"};
  const std::vector<int> b = BuddyRanks(uneven);
  std::set<int> held(b.begin(), b.end());
  EXPECT_EQ(held.size(), b.size()) << "every rank holds exactly one copy";
  int same_host = 0;
  for (size_t r = 0; r < b.size(); ++r) {
    EXPECT_NE(b[r], static_cast<int>(r));
    same_host += uneven[static_cast<size_t>(b[r])] == uneven[r];
  }
  // Host a's three ranks can send to only two ranks elsewhere: one pair shares a host.
  EXPECT_EQ(same_host, 1);
}

// Rank `rank` of a thread-run job: snapshots every 2 steps through step 6 while "training"
// rewrites the state after each WaitCopied; then checks its local and held copies.
Status TrainAndCheck(const std::string& address, int rank, const std::vector<std::string>& hosts,
                     const ParallelConfig& config) {
  MORPH_ASSIGN_OR_RETURN(auto store,
                         TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
  MORPH_ASSIGN_OR_RETURN(auto state, MakeState(config, rank));
  BuddySnapshotOptions opts;
  opts.chunk_bytes = 256;  // several chunks even for this small state
  opts.timeout = std::chrono::seconds(30);
  BuddySnapshotter snap(2, opts);
  MORPH_RETURN_IF_ERROR(snap.StartGeneration(
      *store, {.generation = 0, .rank = rank, .hosts = hosts}, Deadline::AfterMs(20000)));
  Fill(*state, SeedAt(0));
  for (int64_t step = 0; step <= 6; ++step) {
    MORPH_RETURN_IF_ERROR(snap.MaybeBegin(step, *state));
    MORPH_RETURN_IF_ERROR(snap.WaitCopied(Deadline::AfterMs(20000)));
    Fill(*state, SeedAt(step + 1));  // the update, while the exchange may still run
  }
  MORPH_RETURN_IF_ERROR(snap.WaitExchanged(Deadline::AfterMs(30000)));
  const int ward = snap.ward();
  if (snap.local_step() != 6 || snap.held_step() != 6 || snap.held_rank() != ward) {
    return InternalError("local_step " + std::to_string(snap.local_step()) + " held_step " +
                         std::to_string(snap.held_step()) + " held_rank " +
                         std::to_string(snap.held_rank()) + ", ward " + std::to_string(ward));
  }
  // The ward sent only its pieces with no copy on another host: some tensors, not all.
  const std::vector<bool> sent = BuddyCopiedTensors(state->tensors(), config, ward, hosts);
  std::vector<int64_t> held_tensors;
  for (int64_t step : {4, 6}) {  // the newest and, double-buffered, the one before
    MORPH_ASSIGN_OR_RETURN(auto mine, MakeState(config, rank));
    Fill(*mine, SeedAt(step));
    MORPH_RETURN_IF_ERROR(SameAs(snap.Local(step), *mine, step, "local"));
    MORPH_ASSIGN_OR_RETURN(auto theirs, MakeState(config, ward));
    Fill(*theirs, SeedAt(step));
    MORPH_RETURN_IF_ERROR(SameAs(snap.Held(step), *theirs, step, "held", sent));
    held_tensors.clear();
    for (size_t i = 0; i < sent.size(); ++i) {
      if (sent[i] && !theirs->TensorAt(i).shard.empty()) held_tensors.push_back(int64_t(i));
    }
  }
  if (std::count(sent.begin(), sent.end(), true) == 0 ||
      std::count(sent.begin(), sent.end(), false) == 0) {
    return InternalError("the test needs tensors of both kinds");
  }
  if (snap.HeldTensors(0) != held_tensors) {
    return InternalError("HeldTensors does not list what the held copies hold");
  }
  // Rollback in place to step 4 from the local copy.
  MORPH_RETURN_IF_ERROR(RestoreFromSnapshot(*snap.Local(4), *state));
  if (std::string first; CountDifferences(*state, SeedAt(4), &first) != 0) {
    return InternalError("after the rollback to step 4: " + first);
  }
  MORPH_ASSIGN_OR_RETURN(auto other, MakeState(config, ward));
  const Status refused = RestoreFromSnapshot(*snap.Local(4), *other);
  if (refused.code() != StatusCode::kFailedPrecondition ||
      refused.message().find("rank " + std::to_string(ward) + ", the snapshot for") ==
          std::string_view::npos) {
    return InternalError("restoring into another rank's state: " + refused.ToString());
  }
  if (snap.Local(2) != nullptr || snap.Held(2) != nullptr) {
    return InternalError("step 2 is still held: only two snapshots are kept");
  }
  // Memory: two local copies of this rank's state, two held copies of the ward's (aligned).
  if (snap.memory_bytes() < 2 * (state->local_bytes() + 24)) {
    return InternalError("memory_bytes " + std::to_string(snap.memory_bytes()) + " for " +
                         std::to_string(state->local_bytes()) + " state bytes");
  }
  return Status::Ok();
}

void RunJob(const std::vector<std::string>& hosts, const ParallelConfig& config) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  const std::string address = server->address();
  const std::vector<Status> results = RunRankThreads(static_cast<int>(hosts.size()), [&](int rank) {
    return TrainAndCheck(address, rank, hosts, config);
  });
  MORPH_EXPECT_OK(FirstError(results));
}

// Which tensors go to the buddy: those whose piece has no copy in another failure domain.
TEST(BuddySnapshotTest, OnlyPiecesWithoutAnotherCopyGoToTheBuddy) {
  auto sent_names = [](const ParallelConfig& config, int rank,
                       const std::vector<std::string>& hosts) {
    auto state = MakeState(config, rank, /*hybrid=*/config.dp % 2 == 0);
    EXPECT_TRUE(state.ok()) << state.status();
    const std::vector<bool> sent = BuddyCopiedTensors((*state)->tensors(), config, rank, hosts);
    std::vector<std::string> out;
    for (size_t i = 0; i < sent.size(); ++i) {
      if (sent[i]) out.push_back((*state)->tensors()[i].name);
    }
    return out;
  };
  // dp 4 on one host: a replicated tensor has other copies; ZeRO ranges (w1.m, flat) have
  // none; a hybrid ZeRO range (hz, groups of 2) has one, at DP rank d + 2.
  EXPECT_THAT(sent_names(Config(4, 1, 1), 1, {"h", "h", "h", "h"}), ElementsAre("w1.m", "flat"));
  // Hosts a a b b: rank 0's hybrid ZeRO replica (rank 2) is on host b: not sent.
  EXPECT_THAT(sent_names(Config(4, 1, 1), 0, {"a", "a", "b", "b"}), ElementsAre("w1.m", "flat"));
  // Hosts a b a b: rank 0's hybrid ZeRO replica (rank 2) shares its host: losing host a would
  // lose both copies, so it goes to the buddy.
  EXPECT_THAT(sent_names(Config(4, 1, 1), 0, {"a", "b", "a", "b"}),
              ElementsAre("w1.m", "flat", "hz"));
  // dp 2 x pp 2, each stage on its own host: the DP replicas of a stage share its host, so
  // they go to the buddy; the tied emb has its other copies on the other stage's host.
  EXPECT_THAT(sent_names(Config(2, 1, 2), 0, {"a", "a", "b", "b"}),
              ElementsAre("w1", "w1.m", "flat", "hz"));
  EXPECT_THAT(sent_names(Config(2, 1, 2), 3, {"a", "a", "b", "b"}),
              ElementsAre("norm", "qkv", "vocab"));
  // The same on one host: only the pieces without any other copy.
  EXPECT_THAT(sent_names(Config(2, 1, 2), 0, {"h", "h", "h", "h"}),
              ElementsAre("w1.m", "flat", "hz"));
  // TP 2 across hosts: the unsplit norm has its copy on the other host, the split ones none.
  EXPECT_THAT(sent_names(Config(1, 2, 1), 1, {"a", "b"}),
              ElementsAre("emb", "w1", "w1.m", "qkv", "vocab"));
  // Hosts not one per rank: everything (nothing is known about failure domains).
  EXPECT_EQ(sent_names(Config(2, 1, 1), 0, {"a"}).size(), 8u);
}

TEST(BuddySnapshotTest, HeldCopiesEqualTheWardsStateAtTheSnapshotStep) {
  // Buddy != ward: rank 0 -> 2 -> 1 -> 0 (host a holds 0 and 1).
  RunJob({"a", "a", "b"}, Config(1, 3, 1));
}

TEST(BuddySnapshotTest, TwoRanksShareOneCommunicator) { RunJob({"a", "b"}, Config(2, 1, 1)); }

TEST(BuddySnapshotTest, BadCallsAreRefused) {
  BuddySnapshotter snap(2);
  MORPH_ASSERT_OK_AND_ASSIGN(auto state, MakeState(Config(1, 1, 1), 0));
  EXPECT_THAT(snap.MaybeBegin(2, *state),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no generation started")));
  MORPH_EXPECT_OK(snap.MaybeBegin(3, *state));  // not due
  auto table = std::make_shared<KvTable>();
  MemoryStore store(table, 0);
  EXPECT_THAT(snap.StartGeneration(store, {.generation = 0, .rank = 1, .hosts = {"a"}},
                                   Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 1 outside a world of 1")));
  // A world of one: local copies only.
  MORPH_ASSERT_OK(snap.StartGeneration(store, {.generation = 0, .rank = 0, .hosts = {"a"}},
                                       Deadline::AfterMs(1000)));
  Fill(*state, 5);
  MORPH_ASSERT_OK(snap.MaybeBegin(2, *state));
  MORPH_ASSERT_OK(snap.WaitCopied(Deadline::AfterMs(10000)));
  MORPH_ASSERT_OK(snap.WaitExchanged(Deadline::AfterMs(10000)));
  EXPECT_EQ(snap.local_step(), 2);
  EXPECT_EQ(snap.held_step(), -1);
  EXPECT_EQ(snap.buddy(), -1);
  MORPH_EXPECT_OK(SameAs(snap.Local(2), *state, 2, "local"));
}

// After a rollback from a local copy, the next snapshot of that step writes into the same
// buffer and copies only the tensors the note does not vouch for (or whose bytes differ).
TEST(BuddySnapshotTest, TheSnapshotAfterARollbackCopiesOnlyWhatChanged) {
  const ParallelConfig config = Config(1, 1, 1);
  MORPH_ASSERT_OK_AND_ASSIGN(auto state, MakeState(config, 0));
  auto table = std::make_shared<KvTable>();
  MemoryStore store(table, 0);
  BuddySnapshotter snap(2);
  MORPH_ASSERT_OK(snap.StartGeneration(store, {.generation = 0, .rank = 0, .hosts = {"a"}},
                                       Deadline::AfterMs(1000)));
  Fill(*state, SeedAt(2));
  MORPH_ASSERT_OK(snap.MaybeBegin(2, *state));
  MORPH_ASSERT_OK(snap.WaitCopied(Deadline::AfterMs(10000)));
  const int64_t all = snap.copied_bytes();
  int64_t scalars = 0;
  for (const ScalarSpec& s : state->scalars()) scalars += s.bytes;
  EXPECT_EQ(all, state->local_bytes() + scalars);
  Fill(*state, SeedAt(3));  // training went on; then the rollback to step 2
  MORPH_ASSERT_OK(RestoreFromSnapshot(*snap.Local(2), *state));
  // Every tensor vouched for but tensor 1, whose first byte changes after the note.
  std::vector<bool> same(state->tensors().size(), true);
  same[0] = false;
  snap.NoteRestored(2, 0, same);
  static_cast<char*>(state->TensorAt(1).data.data)[0] ^= 1;
  MORPH_ASSERT_OK(snap.StartGeneration(store, {.generation = 1, .rank = 0, .hosts = {"a"}},
                                       Deadline::AfterMs(1000)));
  MORPH_ASSERT_OK(snap.MaybeBegin(2, *state));
  MORPH_ASSERT_OK(snap.WaitCopied(Deadline::AfterMs(10000)));
  EXPECT_EQ(snap.copied_bytes(),
            static_cast<int64_t>(state->TensorAt(0).data.bytes + state->TensorAt(1).data.bytes) +
                scalars);
  MORPH_EXPECT_OK(SameAs(snap.Local(2, 1), *state, 2, "local"));
  EXPECT_EQ(snap.Local(2, 0), nullptr) << "the previous generation's copy was written over";
  // The note is used once: the next round copies everything.
  Fill(*state, SeedAt(4));
  MORPH_ASSERT_OK(snap.MaybeBegin(4, *state));
  MORPH_ASSERT_OK(snap.WaitCopied(Deadline::AfterMs(10000)));
  EXPECT_EQ(snap.copied_bytes(), all);
  MORPH_EXPECT_OK(SameAs(snap.Local(4), *state, 4, "local"));
  MORPH_ASSERT_OK_AND_ASSIGN(auto at2, MakeState(config, 0));  // the state at step 2
  Fill(*at2, SeedAt(2));
  static_cast<char*>(at2->TensorAt(1).data.data)[0] ^= 1;
  MORPH_EXPECT_OK(SameAs(snap.Local(2, 1), *at2, 2, "local"));  // double-buffered
}

// A failure does not wait for a local copy still running: Abort stops it within a chunk.
TEST(BuddySnapshotTest, AbortStopsALocalCopyInFlight) {
  const ParallelConfig config = Config(1, 1, 1);
  MORPH_ASSERT_OK_AND_ASSIGN(auto state, MakeBigState(config, 0, int64_t{96} << 20));
  auto table = std::make_shared<KvTable>();
  MemoryStore store(table, 0);
  BuddySnapshotOptions opts;
  BuddySnapshotter* self = nullptr;
  int chunks = 0;
  opts.after_chunk_copied = [&](int64_t step) {
    if (step == 4 && ++chunks == 1) self->Abort();
  };
  BuddySnapshotter snap(2, opts);
  self = &snap;
  MORPH_ASSERT_OK(snap.StartGeneration(store, {.generation = 0, .rank = 0, .hosts = {"a"}},
                                       Deadline::AfterMs(1000)));
  Fill(*state, SeedAt(2));
  MORPH_ASSERT_OK(snap.MaybeBegin(2, *state));
  MORPH_ASSERT_OK(snap.WaitCopied(Deadline::AfterMs(10000)));
  Fill(*state, SeedAt(4));
  MORPH_ASSERT_OK(snap.MaybeBegin(4, *state));
  EXPECT_THAT(snap.WaitCopied(Deadline::AfterMs(10000)),
              StatusIs(StatusCode::kAborted, HasSubstr("the local copy was aborted")));
  EXPECT_EQ(chunks, 1) << "it stopped at the next chunk";
  EXPECT_EQ(snap.Local(4), nullptr);
  EXPECT_EQ(snap.local_step(), 2) << "the previous copy stays";
  MORPH_EXPECT_OK(snap.WaitExchanged(Deadline::AfterMs(10000)).code() == StatusCode::kAborted
                      ? Status::Ok()
                      : InternalError("the round did not end aborted"));
}

// A round aborted after its copy completed (a recovery reads the holdings right after Abort,
// without waiting for the round): the new copy does not count and the previous local and held
// copies stay complete and intact.
TEST(BuddySnapshotTest, AnAbortedRoundCompletesNothingAndKeepsThePreviousCopies) {
  const ParallelConfig config = Config(1, 2, 1);
  const int64_t bytes = int64_t{128} << 20;  // 64 MiB a rank: two chunks
  const std::vector<std::string> hosts = {"a", "b"};
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  const std::string address = server->address();
  const std::vector<Status> results = RunRankThreads(2, [&](int rank) -> Status {
    MORPH_ASSIGN_OR_RETURN(auto store,
                           TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
    MORPH_ASSIGN_OR_RETURN(auto state, MakeBigState(config, rank, bytes));
    BuddySnapshotOptions opts;
    opts.timeout = std::chrono::seconds(30);
    BuddySnapshotter* self = nullptr;
    int chunks = 0;
    if (rank == 0) {
      // The copy of step 4 is its tensor's two chunks and two scalars: abort after the last.
      opts.after_chunk_copied = [&](int64_t step) {
        if (step == 4 && ++chunks == 4) self->Abort();
      };
    }
    BuddySnapshotter snap(2, opts);
    self = &snap;
    MORPH_RETURN_IF_ERROR(snap.StartGeneration(
        *store, {.generation = 0, .rank = rank, .hosts = hosts}, Deadline::AfterMs(20000)));
    for (int64_t step : {0, 2, 4}) {
      Fill(*state, SeedAt(step));
      MORPH_RETURN_IF_ERROR(snap.MaybeBegin(step, *state));
      const Status copied = snap.WaitCopied(Deadline::AfterMs(20000));
      const Status exchanged = snap.WaitExchanged(Deadline::AfterMs(30000));
      if (step < 4) {
        MORPH_RETURN_IF_ERROR(copied);
        MORPH_RETURN_IF_ERROR(exchanged);
      } else if (rank == 0 && (copied.code() != StatusCode::kAborted || exchanged.ok())) {
        return InternalError("the aborted round: copy " + copied.ToString() + ", exchange " +
                             exchanged.ToString());
      }
    }
    if (rank != 0) return Status::Ok();  // its exchange failed with the aborted peer
    if (chunks != 4) return InternalError(std::to_string(chunks) + " chunks copied");
    // The local copy of step 0 was given up when the round began (its buffer took step 4's);
    // the held copy the round would have received into stays complete.
    if (snap.LocalSteps(0) != std::vector<int64_t>{2} ||
        snap.HeldSteps(0) != std::vector<int64_t>{2, 0}) {
      auto list = [](const std::vector<int64_t>& v) {
        std::string out;
        for (int64_t x : v) out += " " + std::to_string(x);
        return out;
      };
      return InternalError("the aborted round changed which copies are complete: local" +
                           list(snap.LocalSteps(0)) + ", held" + list(snap.HeldSteps(0)));
    }
    for (int64_t step : {0, 2}) {
      MORPH_ASSIGN_OR_RETURN(auto mine, MakeBigState(config, 0, bytes));
      Fill(*mine, SeedAt(step));
      if (step == 2) {
        MORPH_RETURN_IF_ERROR(SameAs(snap.Local(step), *mine, step, "local"));
      }
      MORPH_ASSIGN_OR_RETURN(auto theirs, MakeBigState(config, 1, bytes));
      Fill(*theirs, SeedAt(step));
      MORPH_RETURN_IF_ERROR(SameAs(snap.Held(step), *theirs, step, "held"));
    }
    return Status::Ok();
  });
  MORPH_EXPECT_OK(FirstError(results));
}

// Two forked processes; rank 1 is SIGKILLed after the first chunk of its second snapshot.
TEST(BuddySnapshotFaultTest, BuddyDyingMidTransferKeepsThePreviousSnapshot) {
  const ParallelConfig config = Config(1, 2, 1);
  const int64_t bytes = int64_t{16} << 20;
  ForkedRanks ranks = ForkedRanks::Fork(2, [&](int rank, const std::string& address) -> int {
    auto run = [&]() -> Status {
      MORPH_ASSIGN_OR_RETURN(auto store,
                             TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(20000)));
      MORPH_ASSIGN_OR_RETURN(auto state, MakeBigState(config, rank, bytes));
      BuddySnapshotOptions opts;
      opts.chunk_bytes = size_t{1} << 20;
      opts.chunks_per_group = 2;  // the kill comes with the next group already queued
      opts.timeout = std::chrono::seconds(30);
      if (rank == 1) {
        opts.after_chunk_sent = [](int64_t step, int64_t) {
          if (step == 2) ::raise(SIGKILL);
        };
      }
      BuddySnapshotter snap(2, opts);
      MORPH_RETURN_IF_ERROR(snap.StartGeneration(
          *store, {.generation = 0, .rank = rank, .hosts = {"a", "b"}}, Deadline::AfterMs(20000)));
      Fill(*state, SeedAt(0));
      MORPH_RETURN_IF_ERROR(snap.MaybeBegin(0, *state));
      MORPH_RETURN_IF_ERROR(snap.WaitCopied(Deadline::AfterMs(20000)));
      Fill(*state, SeedAt(1));
      MORPH_RETURN_IF_ERROR(snap.WaitExchanged(Deadline::AfterMs(30000)));
      MORPH_RETURN_IF_ERROR(snap.MaybeBegin(2, *state));
      MORPH_RETURN_IF_ERROR(snap.WaitCopied(Deadline::AfterMs(20000)));
      const Status failed = snap.WaitExchanged(Deadline::AfterMs(30000));
      // Only rank 0 gets here.
      if (failed.ok()) return InternalError("the exchange with the killed buddy succeeded");
      if (failed.code() != StatusCode::kUnavailable && failed.code() != StatusCode::kAborted) {
        return InternalError("wrong code: " + failed.ToString());
      }
      if (failed.message().find("rank 1 (host b)") == std::string_view::npos ||
          std::vector<int>(failed.failed_peers().begin(), failed.failed_peers().end()) !=
              std::vector<int>{1}) {
        return InternalError("the error does not name the peer: " + failed.ToString());
      }
      if (snap.held_step() != 0 || snap.held_rank() != 1 || snap.local_step() != 2) {
        return InternalError("held_step " + std::to_string(snap.held_step()) + " local_step " +
                             std::to_string(snap.local_step()));
      }
      MORPH_ASSIGN_OR_RETURN(auto theirs, MakeBigState(config, 1, bytes));
      Fill(*theirs, SeedAt(0));
      MORPH_RETURN_IF_ERROR(SameAs(snap.Held(0), *theirs, 0, "held"));
      MORPH_ASSIGN_OR_RETURN(auto mine0, MakeBigState(config, 0, bytes));
      Fill(*mine0, SeedAt(0));
      MORPH_RETURN_IF_ERROR(SameAs(snap.Local(0), *mine0, 0, "local"));
      // The rollback: the survivor's state (at step 2's values) back to step 0, bitwise.
      MORPH_RETURN_IF_ERROR(RestoreFromSnapshot(*snap.Local(0), *state));
      for (size_t i = 0; i < state->tensors().size(); ++i) {
        const auto got = state->TensorAt(i).data, want = mine0->TensorAt(i).data;
        if (got.bytes != want.bytes || std::memcmp(got.data, want.data, got.bytes) != 0) {
          return InternalError("the rollback to step 0 left tensor " + std::to_string(i) +
                               " different from step 0's values");
        }
      }
      for (size_t k = 0; k < state->scalars().size(); ++k) {
        const auto got = state->ScalarAt(k), want = mine0->ScalarAt(k);
        if (!std::equal(got.begin(), got.end(), want.begin(), want.end())) {
          return InternalError("the rollback to step 0 left scalar " + std::to_string(k) +
                               " different from step 0's value");
        }
      }
      // The generation's snapshots are broken: the next round says why.
      const Status again = snap.MaybeBegin(4, *state);
      if (again.message().find("rank 1 (host b)") == std::string_view::npos) {
        return InternalError("a later round does not repeat the failure: " + again.ToString());
      }
      return Status::Ok();
    };
    return ExitCode(rank, run());
  });
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  ranks.Release(server->address());
  const std::vector<int> codes = ranks.Wait(Deadline::AfterMs(90000));
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 128 + SIGKILL);
}

}  // namespace
}  // namespace morph
