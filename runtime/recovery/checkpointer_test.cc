#include "runtime/recovery/checkpointer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/testing.h"
#include "runtime/state/state_testutil.h"

namespace morph {
namespace {

namespace fs = std::filesystem;
using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace ::morph::state_testutil;  // NOLINT

class CheckpointerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/morph_checkpointer_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Saves step `step` of generation `gen` from every rank of `config` (states filled with
  // `seed`), clobbering each state right after MaybeSave returns: the snapshot was taken.
  // `first_generation`: the job's (PeriodicCheckpointer::set_first_generation; 0: not set).
  void SaveAll(const ParallelConfig& config, int64_t step, int64_t gen, uint64_t seed,
               bool hybrid = false, int keep = 2, int64_t first_generation = 0) {
    const int world = config.world();
    std::vector<std::unique_ptr<StateStore>> states;
    std::vector<std::unique_ptr<PeriodicCheckpointer>> ckpts;
    for (int r = 0; r < world; ++r) {
      MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(config, r, hybrid));
      Fill(*s, seed);
      states.push_back(std::move(s));
      ckpts.push_back(std::make_unique<PeriodicCheckpointer>(dir_, 5, keep));
      ckpts.back()->set_first_generation(first_generation);
    }
    for (int r = 0; r < world; ++r) {
      MORPH_ASSERT_OK(ckpts[r]->MaybeSave(step, gen, *states[r], r, world, config));
      Fill(*states[r], seed + 1000);  // the training step changes the state at once
    }
    // Ranks > 0 first, so rank 0's retention pass after its own save sees them complete.
    for (int r = world - 1; r >= 0; --r) MORPH_ASSERT_OK(ckpts[r]->Flush(Deadline::AfterMs(60000)));
  }

  // Rank 0 of 2 saves step `step` of generation `gen`, rank 1 never does: an incomplete folder.
  void SaveRankZeroOnly(int64_t step, int64_t gen) {
    const ParallelConfig c = Config(1, 2, 1);
    MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(c, 0));
    MORPH_ASSERT_OK_AND_ASSIGN(std::vector<CheckpointPiece> pieces, CheckpointPieces(*s, c, 0));
    MORPH_ASSERT_OK_AND_ASSIGN(
        auto save, SaveCheckpointAsync(CheckpointPath(dir_, step, gen), 0, 2, step, "", pieces));
    MORPH_ASSERT_OK(save->Wait(Deadline::AfterMs(60000)));
  }

  std::string dir_;
};

struct RestoreCase {
  ParallelConfig from;
  ParallelConfig to;
};

TEST_F(CheckpointerTest, SaveInOneConfigRestoreInAnotherBitwise) {
  const std::vector<ParallelConfig> froms = {Config(1, 2, 1), Config(2, 1, 1)};
  const std::vector<ParallelConfig> tos = {Config(3, 1, 1), Config(1, 1, 3), Config(1, 3, 1)};
  int64_t gen = 1;
  for (const ParallelConfig& from : froms) {
    for (const ParallelConfig& to : tos) {
      SCOPED_TRACE(from.ToString() + " -> " + to.ToString());
      const uint64_t seed = 17 + static_cast<uint64_t>(gen);
      SaveAll(from, 10, gen, seed);
      MORPH_ASSERT_OK_AND_ASSIGN(CheckpointRef ref, LatestCompleteCheckpoint(dir_));
      EXPECT_EQ(ref.step, 10);
      EXPECT_EQ(ref.generation, gen);
      EXPECT_EQ(ref.path, CheckpointPath(dir_, 10, gen));
      for (int r = 0; r < to.world(); ++r) {
        MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(to, r));
        MORPH_ASSERT_OK(RestoreFromCheckpoint(ref.path, *s));
        ExpectFilled(*s, seed);
      }
      ++gen;
    }
  }
}

TEST_F(CheckpointerTest, LoadBoxFillsOnlyThatBoxOfAStridedShard) {
  SaveAll(Config(1, 2, 1), 5, 1, 41);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader reader,
                             CheckpointReader::Open(CheckpointPath(dir_, 5, 1)));
  const ParallelConfig to = Config(3, 1, 1);
  for (int r = 0; r < 3; ++r) {
    MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(to, r));
    Fill(*s, 41);
    for (size_t i = 0; i < s->tensors().size(); ++i) {
      State::TensorRef ref = s->TensorAt(i);
      if (ref.shard.empty()) continue;
      // Lose the shard's elements, then load them back box by box (ZeRO shards: partial rows).
      std::memset(ref.data.data, 0xEE, ref.data.bytes);
      for (const Box& b : ShardBoxes(ref.shard)) {
        MORPH_ASSERT_OK(LoadBoxFromCheckpoint(reader, *ref.spec, to, ref.shard, ref.data, b));
      }
    }
    // Padding (vocab's rows 10..11 of a 12-row frame) is not in the checkpoint: zero-filled.
    ExpectFilled(*s, 41);
  }
  MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(to, 0));
  State::TensorRef w1 = s->TensorAt(1);
  EXPECT_THAT(
      LoadBoxFromCheckpoint(reader, *w1.spec, to, w1.shard, w1.data, Box::FromShape({7, 12})),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'w1'")));
}

TEST_F(CheckpointerTest, HybridZeroSavesOneReplicaGroup) {
  SaveAll(Config(4, 1, 1), 5, 1, 99, /*hybrid=*/true);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointRef ref, LatestCompleteCheckpoint(dir_));
  for (const ParallelConfig& to : {Config(2, 1, 1), Config(2, 2, 1)}) {
    for (int r = 0; r < to.world(); ++r) {
      MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(to, r, /*hybrid=*/true));
      MORPH_ASSERT_OK(RestoreFromCheckpoint(ref.path, *s));
      ExpectFilled(*s, 99);
    }
  }
}

TEST_F(CheckpointerTest, NotDueStepsAndDisabledSaveNothing) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(Config(1, 1, 1), 0));
  PeriodicCheckpointer off("", 5, 2);
  EXPECT_FALSE(off.enabled());
  MORPH_EXPECT_OK(off.MaybeSave(5, 1, *s, 0, 1, Config(1, 1, 1)));
  PeriodicCheckpointer ckpt(dir_, 5, 2);
  MORPH_EXPECT_OK(ckpt.MaybeSave(3, 1, *s, 0, 1, Config(1, 1, 1)));
  EXPECT_EQ(ckpt.saves_started(), 0);
  EXPECT_TRUE(fs::is_empty(dir_));
  EXPECT_THAT(LatestCompleteCheckpoint(dir_), StatusIs(StatusCode::kNotFound, HasSubstr(dir_)));
  EXPECT_THAT(LatestCompleteCheckpoint(dir_ + "/nope"),
              StatusIs(StatusCode::kNotFound, HasSubstr(dir_ + "/nope")));
}

TEST_F(CheckpointerTest, BadCallsAreRefusedNamingWhatIsWrong) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(Config(1, 2, 1), 1));
  PeriodicCheckpointer ckpt(dir_, 5, 2);
  EXPECT_THAT(ckpt.MaybeSave(5, 1, *s, 2, 2, Config(1, 2, 1)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 2 of world 2")));
  EXPECT_THAT(ckpt.MaybeSave(5, 1, *s, 0, 2, Config(1, 2, 1)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("rank 1, not")));
  StateStore fresh;
  MORPH_ASSERT_OK(fresh.AddTensor("w", {4}, DType::kF32, Layout::Layer(0)));
  EXPECT_THAT(RestoreFromCheckpoint(dir_, fresh),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("holds no shards")));
}

TEST_F(CheckpointerTest, RetentionKeepsTheNewestCompleteOnes) {
  const ParallelConfig c = Config(1, 2, 1);
  for (int64_t step : {0, 5, 10, 15}) SaveAll(c, step, 1, 7 + static_cast<uint64_t>(step));
  // Rank 0's retention after step 15's save kept the newest two.
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 0, 1)));
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 5, 1)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 10, 1)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 15, 1)));

  // Step 20: rank 0 saved, rank 1 not (yet, or died): incomplete, so it counts for nothing and
  // steps 10 and 15 stay. (15, g0): an earlier generation's save that rank 1 never finished.
  MORPH_ASSERT_OK_AND_ASSIGN(auto s0, MakeState(c, 0));
  {
    PeriodicCheckpointer only0(dir_, 5, 2);
    MORPH_ASSERT_OK(only0.MaybeSave(20, 1, *s0, 0, 2, c));
    MORPH_ASSERT_OK(only0.MaybeSave(15, 0, *s0, 0, 2, c));  // (15, g0) < (15, g1)
    MORPH_ASSERT_OK(only0.Flush(Deadline::AfterMs(60000)));
  }
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointRef ref, LatestCompleteCheckpoint(dir_));
  EXPECT_EQ(ref.step, 15);
  EXPECT_EQ(ref.generation, 1);
  MORPH_ASSERT_OK_AND_ASSIGN(int deleted, PruneCheckpoints(dir_, 2, 0));
  EXPECT_EQ(deleted, 0);  // (15, g0) is older than step 15 g1 but not than step 10: kept
  MORPH_ASSERT_OK_AND_ASSIGN(deleted, PruneCheckpoints(dir_, 1, 0));
  EXPECT_EQ(deleted, 1);  // step 10; (15, g0) was written just now: a rank of g0 may still be
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 15, 0)));
  MORPH_ASSERT_OK_AND_ASSIGN(deleted, PruneCheckpoints(dir_, 1, 0, /*idle_ms=*/0));
  EXPECT_EQ(deleted, 1);  // (15, g0) unchanged since, and generation 1 went on: abandoned
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 20, 1)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 15, 1)));
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 15, 0)));
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 10, 1)));
}

// An incomplete folder is deleted only when no rank of its generation can still be writing it:
// a later step of its generation is complete, or its generation ended (a later one has a
// complete checkpoint) and nothing in it changed for idle_ms. Nothing newer than the oldest kept
// complete checkpoint is touched, and nothing below the job's first generation.
TEST_F(CheckpointerTest, RetentionDeletesAnIncompleteSaveOnlyWhenNobodyCanStillWriteIt) {
  SaveRankZeroOnly(5, 3);   // rank 1 of generation 3 never finished step 5...
  SaveRankZeroOnly(10, 2);  // ...nor of generation 2 step 10 (generation 2 ended during it)
  SaveAll(Config(1, 2, 1), 10, 3, 1, false, /*keep=*/1, /*first_generation=*/2);
  // Rank 0's retention after (10, g3): every rank of g3 saved step 10, so step 5 went; (10, g2)
  // may be written still (as far as the folder shows: it changed just now).
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 5, 3)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 10, 2)));
  SaveRankZeroOnly(15, 3);  // generation 3's save in flight
  SaveRankZeroOnly(5, 1);   // an earlier run's, interrupted
  MORPH_ASSERT_OK_AND_ASSIGN(int deleted, PruneCheckpoints(dir_, 1, 2, /*idle_ms=*/0));
  EXPECT_EQ(deleted, 1);
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 10, 2)));  // unchanged for idle_ms: abandoned
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 15, 3)));   // newer than the kept one
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 5, 1)));    // not the job's
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 10, 3)));
}

// Retention keeps to the job's own generations (issue 22). Run A left complete checkpoints of
// steps 25 and 30 (generation 1); run B, started afresh on the folder, numbers its generations
// above (2) and saves steps 5, 10, 15: it keeps its own newest two although A's rank above them
// by step, and never deletes A's.
TEST_F(CheckpointerTest, RetentionKeepsToTheJobsOwnGenerations) {
  const ParallelConfig c = Config(1, 2, 1);
  for (int64_t step : {25, 30}) SaveAll(c, step, 1, 7 + static_cast<uint64_t>(step));
  for (int64_t step : {5, 10, 15}) SaveAll(c, step, 2, 7 + static_cast<uint64_t>(step));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 25, 1)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 30, 1)));
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 5, 2)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 10, 2)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 15, 2)));
  // Generation 3 of run B (after a change): its rank 0 knows the job's first generation (2)
  // and so prunes generation 2's older folders as well, never run A's.
  SaveAll(c, 20, 3, 27, false, /*keep=*/2, /*first_generation=*/2);
  EXPECT_FALSE(fs::exists(CheckpointPath(dir_, 10, 2)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 15, 2)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 20, 3)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 25, 1)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 30, 1)));
  MORPH_ASSERT_OK_AND_ASSIGN(int deleted, PruneCheckpoints(dir_, 1, 2, /*idle_ms=*/0));
  EXPECT_EQ(deleted, 1);  // (15, g2)
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 25, 1)));
  EXPECT_TRUE(fs::exists(CheckpointPath(dir_, 30, 1)));
}

TEST_F(CheckpointerTest, SaveKilledMidwayNeverCountsAsComplete) {
  const ParallelConfig c = Config(1, 2, 1);
  SaveAll(c, 5, 1, 3);
  // Rank 1 of step 10 is killed while its background write runs (64 MiB, fsynced: far longer
  // than the instant between MaybeSave's return and the kill); rank 0 finishes.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto s = MakeBigState(c, 1, int64_t{64} << 20);
    if (!s.ok()) ::_exit(2);
    PeriodicCheckpointer ckpt(dir_, 5, 2);
    if (!ckpt.MaybeSave(10, 1, **s, 1, 2, c).ok()) ::_exit(3);
    ::raise(SIGKILL);
    ::_exit(4);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exit " << WEXITSTATUS(status);
  MORPH_ASSERT_OK_AND_ASSIGN(auto s0, MakeBigState(c, 0, int64_t{64} << 20));
  PeriodicCheckpointer ckpt0(dir_, 5, 2);
  MORPH_ASSERT_OK(ckpt0.MaybeSave(10, 1, *s0, 0, 2, c));
  MORPH_ASSERT_OK(ckpt0.Flush(Deadline::AfterMs(60000)));
  EXPECT_THAT(CheckpointReader::Open(CheckpointPath(dir_, 10, 1)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("rank 1 of 2")));
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointRef ref, LatestCompleteCheckpoint(dir_));
  EXPECT_EQ(ref.step, 5);
}

TEST_F(CheckpointerTest, MissingPieceIsDataLossNamingTensorAndBox) {
  // Rank 1 of tp=2 saves everything but its half of "w1" (columns 6..11).
  const ParallelConfig c = Config(1, 2, 1);
  std::vector<std::unique_ptr<CheckpointSave>> saves;
  std::vector<std::unique_ptr<StateStore>> states;
  for (int r = 0; r < 2; ++r) {
    MORPH_ASSERT_OK_AND_ASSIGN(auto s, MakeState(c, r));
    Fill(*s, 5);
    MORPH_ASSERT_OK_AND_ASSIGN(std::vector<CheckpointPiece> pieces, CheckpointPieces(*s, c, r));
    if (r == 1) {
      std::erase_if(pieces, [](const CheckpointPiece& p) { return p.tensor.name == "w1"; });
    }
    MORPH_ASSERT_OK_AND_ASSIGN(
        auto save, SaveCheckpointAsync(CheckpointPath(dir_, 5, 1), r, 2, 5, "", pieces));
    saves.push_back(std::move(save));
    states.push_back(std::move(s));
  }
  for (auto& s : saves) MORPH_ASSERT_OK(s->Wait(Deadline::AfterMs(60000)));
  MORPH_ASSERT_OK_AND_ASSIGN(auto target, MakeState(Config(3, 1, 1), 0));
  EXPECT_THAT(
      RestoreFromCheckpoint(CheckpointPath(dir_, 5, 1), *target),
      StatusIs(StatusCode::kDataLoss, AllOf(HasSubstr("tensor 'w1'"), HasSubstr("[0,6)x[6,12)"))));
}

TEST_F(CheckpointerTest, DifferentRegistrationIsFailedPreconditionNamingIt) {
  SaveAll(Config(1, 2, 1), 5, 1, 3);
  const std::string path = CheckpointPath(dir_, 5, 1);
  StateStore other;
  MORPH_ASSERT_OK(other.AddTensor("w1", {6, 10}, DType::kF32, Layout::Layer(1).SplitTP(1)));
  MORPH_ASSERT_OK(other.Materialize(Config(1, 1, 1), 0));
  EXPECT_THAT(RestoreFromCheckpoint(path, other),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("tensor 'w1' has shape [6, 10], saved as [6, 12]")));
  StateStore missing;
  MORPH_ASSERT_OK(missing.AddTensor("nope", {4}, DType::kF32, Layout::Layer(0)));
  MORPH_ASSERT_OK(missing.Materialize(Config(1, 1, 1), 0));
  EXPECT_THAT(RestoreFromCheckpoint(path, missing),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("tensor 'nope' is not in it")));
  MORPH_ASSERT_OK_AND_ASSIGN(auto fewer, MakeState(Config(1, 1, 1), 0, false, /*scalars=*/false));
  EXPECT_THAT(RestoreFromCheckpoint(path, *fewer),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("it holds 'scalar:rng', which is not registered")));
}

// Resume at start: the manifest check the coordinator runs before committing (no state needed),
// the newest generation a folder names (incomplete ones too), and the generation floor a
// restarted job's recovery uses so that it never reads an earlier run's checkpoints.
TEST_F(CheckpointerTest, ResumeHelpersCheckTheManifestAndNumberGenerations) {
  EXPECT_EQ(*NewestCheckpointGeneration(dir_ + "/nope"), 0);
  SaveAll(Config(1, 2, 1), 5, 3, 3);
  MORPH_ASSERT_OK_AND_ASSIGN(auto s0, MakeState(Config(1, 2, 1), 0));
  {
    PeriodicCheckpointer only0(dir_, 5, 2);
    MORPH_ASSERT_OK(only0.MaybeSave(10, 7, *s0, 0, 2, Config(1, 2, 1)));  // incomplete
    MORPH_ASSERT_OK(only0.Flush(Deadline::AfterMs(60000)));
  }
  EXPECT_EQ(*NewestCheckpointGeneration(dir_), 7);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointRef any, LatestCompleteCheckpoint(dir_));
  EXPECT_EQ(any.step, 5);
  EXPECT_EQ(any.generation, 3);
  EXPECT_THAT(LatestCompleteCheckpoint(dir_, 4),
              StatusIs(StatusCode::kNotFound, HasSubstr("of generation 4 or later")));

  const std::string path = CheckpointPath(dir_, 5, 3);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader reader, CheckpointReader::Open(path));
  MORPH_ASSERT_OK(CheckCheckpointMatches(reader, path, s0->tensors(), s0->scalars()));
  std::vector<TensorSpec> tensors = s0->tensors();
  tensors[0].dtype = DType::kI32;
  EXPECT_THAT(CheckCheckpointMatches(reader, path, tensors, s0->scalars()),
              StatusIs(StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path),
                             HasSubstr("tensor '" + tensors[0].name + "' is i32, saved as f32"))));
  std::vector<ScalarSpec> scalars = s0->scalars();
  scalars.push_back({"extra", 4});
  EXPECT_THAT(CheckCheckpointMatches(reader, path, s0->tensors(), scalars),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("scalar 'extra' is not in it")));
}

// Resume at start (issue 22): the newest complete checkpoint that verifies whole, passing over
// (and naming) a newer one with a flipped data byte; incomplete ones are passed over silently;
// the registration check of the newest complete one decides; none intact is kDataLoss.
TEST_F(CheckpointerTest, NewestIntactCheckpointPassesOverADamagedOne) {
  const ParallelConfig c = Config(1, 2, 1);
  EXPECT_THAT(NewestIntactCheckpoint(dir_, nullptr, nullptr),
              StatusIs(StatusCode::kNotFound, HasSubstr(dir_)));
  SaveAll(c, 5, 1, 5, false, /*keep=*/10);
  SaveAll(c, 10, 1, 10, false, /*keep=*/10);
  SaveRankZeroOnly(15, 1);  // incomplete
  const std::string data = CheckpointPath(dir_, 10, 1) + "/rank-00001/data.bin";
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(7);
    f.put('\x5a');
  }
  std::vector<SkippedCheckpoint> skipped;
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointRef ref, NewestIntactCheckpoint(dir_, nullptr, &skipped));
  EXPECT_EQ(ref.path, CheckpointPath(dir_, 5, 1));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].ref.path, CheckpointPath(dir_, 10, 1));
  EXPECT_THAT(skipped[0].why,
              StatusIs(StatusCode::kDataLoss, AllOf(HasSubstr(data), HasSubstr("checksum"))));
  // The check sees the newest complete one first, and its error is the answer.
  std::vector<std::string> checked;
  auto refuse = [&](const CheckpointReader&, const std::string& path) {
    checked.push_back(path);
    return FailedPreconditionError("not this one");
  };
  EXPECT_THAT(NewestIntactCheckpoint(dir_, refuse, nullptr),
              StatusIs(StatusCode::kFailedPrecondition, "not this one"));
  EXPECT_EQ(checked, std::vector<std::string>{CheckpointPath(dir_, 10, 1)});
  // Every complete one damaged: kDataLoss naming the newest.
  {
    std::fstream f(CheckpointPath(dir_, 5, 1) + "/rank-00000/manifest.json",
                   std::ios::in | std::ios::out);
    f.put('!');
  }
  skipped.clear();
  EXPECT_THAT(NewestIntactCheckpoint(dir_, nullptr, &skipped),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr(CheckpointPath(dir_, 10, 1)), HasSubstr("1 older"))));
  EXPECT_EQ(skipped.size(), 2u);
}

// Folder names are read exactly as CheckpointPath writes them (issue 22). Names with a sign, a
// blank, a leading zero or anything after the generation are not checkpoint folders: never
// counted, loaded or deleted. A checkpoint name whose generation leaves no room to count on, or
// whose step does not fit in 64 bits, stops the numbering (the job does not start), naming it.
TEST_F(CheckpointerTest, FolderNamesAreReadExactly) {
  SaveAll(Config(1, 2, 1), 5, 2, 3);
  for (const char* other : {"step-+5-g9", "step--5-g9", "step- 5-g9", "step-5-g 9", "step-05-g9",
                            "step-5-g09", "step-5-g9x", "step-5-g9-g9", "step-5-g", "step--g9",
                            "step-5-g+9", "step-5-g99999999999999999999.old", "step5-g9"}) {
    fs::create_directories(dir_ + "/" + other);
    fs::copy(CheckpointPath(dir_, 5, 2), dir_ + "/" + other, fs::copy_options::recursive);
  }
  MORPH_ASSERT_OK_AND_ASSIGN(int64_t newest, NewestCheckpointGeneration(dir_));
  EXPECT_EQ(newest, 2);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointRef ref, LatestCompleteCheckpoint(dir_));
  EXPECT_EQ(ref.path, CheckpointPath(dir_, 5, 2));
  const size_t before = std::distance(fs::directory_iterator(dir_), fs::directory_iterator());
  MORPH_ASSERT_OK_AND_ASSIGN(int deleted, PruneCheckpoints(dir_, 1, 0, /*idle_ms=*/0));
  EXPECT_EQ(deleted, 0);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), before);

  fs::create_directories(dir_ + "/step-1-g" + std::to_string(kMaxCheckpointGeneration));
  MORPH_ASSERT_OK_AND_ASSIGN(newest, NewestCheckpointGeneration(dir_));
  EXPECT_EQ(newest, kMaxCheckpointGeneration);
  for (const std::string& bad : std::vector<std::string>{
           "step-1-g" + std::to_string(kMaxCheckpointGeneration + 1), "step-1-g9223372036854775807",
           "step-1-g9223372036854775808", "step-99999999999999999999-g1"}) {
    fs::create_directories(dir_ + "/" + bad);
    EXPECT_THAT(NewestCheckpointGeneration(dir_),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr(dir_ + "/" + bad)));
    // Not loaded nor deleted either.
    MORPH_ASSERT_OK_AND_ASSIGN(ref, LatestCompleteCheckpoint(dir_));
    EXPECT_EQ(ref.path, CheckpointPath(dir_, 5, 2));
    fs::remove(dir_ + "/" + bad);
  }
}

}  // namespace
}  // namespace morph
