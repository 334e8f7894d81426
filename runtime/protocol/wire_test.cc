#include "runtime/protocol/wire.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

Generation Gen(int64_t id = 7) {
  Generation g;
  g.id = id;
  g.start_step = 1234;
  g.config = ParallelConfig{
      .dp = 2, .tp = 2, .pp = 1, .stage_of_layer = {0, 0, 0}, .zero_stage = 1, .micro_batches = 4};
  g.ranks = {11, 12, 13, 14};
  g.plan_digest = 0xfeedfacecafebeefULL;
  return g;
}

JobManifest Manifest() {
  JobManifest m;
  m.model = ModelShape{.num_layers = 2,
                       .num_heads = 8,
                       .tp_candidates = {1, 2},
                       .pp_candidates = {1, 2},
                       .global_batch = 64,
                       .micro_batches = 2,
                       .zero_stage = 1,
                       .device_memory_bytes = int64_t{1} << 34};
  m.tensors = {
      TensorSpec{"layers.0.w", DType::kBF16, {16, 32}, Layout::Layer(0).SplitTP(1).ZeroShard()},
      TensorSpec{"layers.1.b", DType::kF32, {32}, Layout::Layer(1)},
      // Every layout field travels (wire version 2): tied layers, blocks, padding, hybrid ZeRO.
      TensorSpec{"embed", DType::kF32, {50, 16}, Layout::Layers({0, 1}).SplitTP(0).PadToMultiple(8)},
      TensorSpec{"layers.0.qkv", DType::kF32, {48, 16},
                 Layout::Layer(0).SplitTPBlocks(0, 3).ZeroShard(2)},
      // The torch.chunk layouts (wire version 10): DTensor's Shard(d), FSDP2's Shard(0), HSDP.
      TensorSpec{"layers.1.wo", DType::kF32, {16, 33}, Layout::Layer(1).ChunkTP(1).ChunkDP()},
      TensorSpec{"layers.1.wq", DType::kF32, {33, 16}, Layout::Layer(1).ChunkTP(0).ChunkDP(2)},
      TensorSpec{"layers.1.ln", DType::kF32, {17}, Layout::Layer(1).ChunkDP()}};
  m.scalars = {ScalarSpec{"rng", 16}, ScalarSpec{"step", 8}};
  m.dataset_samples = 1000;
  m.dataset_seed = 0x1234567890abcdefULL;
  m.dataset_shuffle = false;
  m.chunk_bytes = 1 << 20;
  m.staging_bytes = 1 << 26;
  return m;
}

std::vector<WireMessage> Samples() {
  ChangeParticipants c{.participants = {11, 12, 13, 14, 20},
                       .leavers = {20},
                       .exiting = {20},
                       .lost = {9},
                       .recovery = true,
                       .stale = {12}};
  return {
      HelloMsg{.token = "secret", .host = "node-3", .pid = 4242, .capabilities = 1, .resume_id = 0},
      WelcomeMsg{.worker = 11,
                 .generation = 6,
                 .store_address = "10.0.0.1:2900",
                 .current = Gen(6),
                 .first_generation = 4},
      HeartbeatMsg{.step = 99},
      LeaveMsg{.reason = "SIGTERM"},
      ErrorMsg{.code = static_cast<int32_t>(StatusCode::kUnauthenticated),
               .message = "wrong token"},
      PrepareMsg{.next = Gen(), .from_generation = 6, .from = Gen(6), .change = c},
      StepReportMsg{.worker = 12, .generation = 7, .last_free_step = 1233, .state_step = 1230,
                    .state_ok = false,
                    .snapshots = {.local_step = 1200, .local_prev_step = 1180, .held_step = 1190,
                                  .held_prev_step = 1170, .held_rank = 3,
                                  // Wire version 7: which tensors the held copies hold.
                                  .held_tensors = {1, 2, 4, 5, 6, 9}},
                    .undo_step = 1229,
                    .vote_step = 1230,
                    .committed_step = 1229},
      CommitMsg{.next = Gen(), .from_generation = 6, .from = Gen(6), .change = c,
                .recovery = {.source = RecoveryDecision::Source::kCheckpoint,
                             .newest_step = 1240,
                             .checkpoint = "/ckpt/step-1200",
                             .snapshot_holders = {12, 14, -1}}},
      AbandonMsg{.generation = 7},
      AppliedMsg{.worker = 13, .generation = 7, .ok = false, .error = "peer 2 gone",
                 .phases = {.communicators_us = 1, .plan_us = 2, .transfer_us = 3, .resume_us = 4,
                            .stall_us = 5}},
      OutcomeMsg{.generation = 7, .applied = true},
      ReleaseMsg{.generation = 7},
      RegisterMsg{.manifest = Manifest()},
      DoneMsg{},
      FailureReportMsg{.generation = 6, .step = 1231, .peers = {12, 14}, .error = "peer closed"},
      AbortMsg{.generation = 6, .reason = "worker 13 lost"}};
}

TEST(WireTest, EveryMessageRoundTrips) {
  std::vector<WireMessage> all = Samples();
  ASSERT_EQ(all.size(), std::variant_size_v<WireMessage>);
  all.push_back(CommitMsg{.next = Gen(1), .from_generation = 0});  // from nothing: no ranks
  all.push_back(WelcomeMsg{.worker = 3});                           // before the first generation
  all.push_back(RegisterMsg{});                                     // the default manifest
  for (const WireMessage& m : all) {
    std::string frame = EncodeFrame(m);
    MORPH_ASSERT_OK_AND_ASSIGN(WireMessage back, DecodeFrame(frame));
    EXPECT_EQ(back, m) << WireTypeName(static_cast<uint16_t>(m.index() + 1));
  }
}

// The fuzz target's seed corpus (runtime/protocol/fuzz/corpus): for every sample message a frame
// ("frame-<type>") and a body led by the byte that selects its type ("body-<type>"), in this
// wire version. MORPH_WRITE_WIRE_CORPUS=1 rewrites it; the test fails when the version (or an
// encoding) moves on without it, so the fuzzer never starts from seeds it refuses at once.
TEST(WireTest, FuzzCorpusIsThisVersion) {
  namespace fs = std::filesystem;
  const fs::path dir = MORPH_WIRE_CORPUS_DIR;
  const bool write = std::getenv("MORPH_WRITE_WIRE_CORPUS") != nullptr;
  std::vector<WireMessage> all = Samples();
  all.push_back(CommitMsg{.next = Gen(1), .from_generation = 0});
  all.push_back(WelcomeMsg{.worker = 3});
  std::map<std::string, int> seen;
  constexpr int kTypes = std::variant_size_v<WireMessage>;
  for (const WireMessage& m : all) {
    const uint16_t type = static_cast<uint16_t>(m.index() + 1);
    std::string name(WireTypeName(type));
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (int n = seen[name]++; n > 0) name += "-" + std::to_string(n + 1);
    const std::string frame = EncodeFrame(m);
    const std::string body =
        std::string(1, static_cast<char>(type - 1)) + frame.substr(kFrameHeaderBytes);
    static_assert(kTypes < 256);
    for (const auto& [file, bytes] : {std::pair{"frame-" + name, frame}, {"body-" + name, body}}) {
      if (write) {
        std::ofstream(dir / file, std::ios::binary) << bytes;
        continue;
      }
      std::ifstream in(dir / file, std::ios::binary);
      ASSERT_TRUE(in) << (dir / file) << " is missing (MORPH_WRITE_WIRE_CORPUS=1 writes it)";
      const std::string have((std::istreambuf_iterator<char>(in)), {});
      EXPECT_EQ(have, bytes) << (dir / file)
                             << " is not this wire version's encoding (MORPH_WRITE_WIRE_CORPUS=1)";
    }
  }
}

TEST(WireTest, EveryTruncationFailsCleanly) {
  for (const WireMessage& m : Samples()) {
    std::string frame = EncodeFrame(m);
    for (size_t n = 0; n < frame.size(); ++n) {
      std::string_view cut(frame.data(), n);
      StatusOr<WireMessage> r = DecodeFrame(cut);
      EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes decoded";
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    }
  }
}

TEST(WireTest, HeaderRefusesWhatItCannotTrust) {
  std::string frame = EncodeFrame(HeartbeatMsg{.step = 1});
  std::string bad = frame;
  bad[0] = 'X';
  EXPECT_THAT(DecodeFrame(bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("bad magic")));
  bad = frame;
  bad[4] = static_cast<char>(kWireVersion + 1);  // the next version
  EXPECT_THAT(DecodeFrame(bad).status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("wire version " + std::to_string(kWireVersion + 1))));
  bad = frame;
  bad[6] = 77;  // type 77
  EXPECT_THAT(DecodeFrame(bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown type 77")));
  // A body announced larger than the limit is refused from the header alone.
  bad = frame;
  bad[8] = bad[9] = bad[10] = bad[11] = static_cast<char>(0xff);
  EXPECT_THAT(DecodeHeader(bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("exceeds")));
  // Before authentication only a small Hello is accepted.
  std::string hello = EncodeFrame(HelloMsg{.token = std::string(5000, 't')});
  EXPECT_THAT(DecodeHeader(hello).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("hello body of 5")));
}

TEST(WireTest, CountsAreBoundedByTheBytesLeft) {
  // A commit claiming 2^32-1 ranks in a small body is refused without allocating them.
  std::string frame = EncodeFrame(AbandonMsg{.generation = 1});
  std::string body;
  auto u32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>(v >> (8 * i)));
  };
  auto i64 = [&](int64_t v) {
    for (int i = 0; i < 8; ++i) body.push_back(static_cast<char>(uint64_t(v) >> (8 * i)));
  };
  i64(7);  // id
  i64(0);  // start step
  for (int v : {1, 1, 1, 0, 1}) u32(v);
  u32(0);           // no layers
  u32(0xffffffff);  // ranks count
  FrameHeader h{.version = kWireVersion,
                .type = static_cast<uint16_t>(WireType::kCommit),
                .length = static_cast<uint32_t>(body.size())};
  EXPECT_THAT(DecodeBody(h, body).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("commit.next.ranks: count 4294967295 exceeds")));
  // Trailing bytes are an error, and so are a world/ranks mismatch and a bad config.
  std::string ok = EncodeFrame(AbandonMsg{.generation = 1}) + "x";
  FrameHeader h2{
      .version = kWireVersion, .type = static_cast<uint16_t>(WireType::kAbandon), .length = 9};
  EXPECT_THAT(DecodeBody(h2, std::string_view(ok).substr(12)).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("1 trailing bytes")));
  CommitMsg c{.next = Gen()};
  c.next.ranks.pop_back();
  EXPECT_THAT(DecodeFrame(EncodeFrame(c)).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("3 ranks for a world of 4")));
  c = CommitMsg{.next = Gen()};
  c.next.config.dp = 0;
  c.next.ranks = {};
  EXPECT_THAT(DecodeFrame(EncodeFrame(c)).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("commit.next.config")));
  EXPECT_THAT(DecodeFrame(EncodeFrame(ErrorMsg{.code = 99})).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a status code: 99")));
}

TEST(WireTest, RandomCorruptionNeverCrashesAndNeverLies) {
  // Flipped bytes either fail to decode or decode to a message that re-encodes to exactly the
  // corrupted frame (i.e. the decoder accepted only what the encoding can produce).
  std::mt19937_64 rng(::morph::testing::TestSeed());
  std::vector<WireMessage> all = Samples();
  for (int i = 0; i < 20000; ++i) {
    std::string frame = EncodeFrame(all[rng() % all.size()]);
    int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) frame[rng() % frame.size()] = static_cast<char>(rng());
    StatusOr<WireMessage> r = DecodeFrame(frame);
    if (r.ok()) {
      ASSERT_EQ(EncodeFrame(*r), frame);
    }
  }
}

TEST(WireTest, RegisterCountsAndValuesAreChecked) {
  // A Register claiming 2^32-1 tensors in a small body is refused before allocating them.
  std::string body;
  auto u32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>(v >> (8 * i)));
  };
  auto i64 = [&](int64_t v) {
    for (int i = 0; i < 8; ++i) body.push_back(static_cast<char>(uint64_t(v) >> (8 * i)));
  };
  u32(1);  // num_layers
  u32(0);  // num_heads
  u32(0);  // tp_candidates
  u32(0);  // pp_candidates
  i64(1);  // global_batch
  u32(1);  // micro_batches
  u32(0);  // zero_stage
  i64(0);  // device memory
  u32(0xffffffff);
  FrameHeader h{.version = kWireVersion,
                .type = static_cast<uint16_t>(WireType::kRegister),
                .length = static_cast<uint32_t>(body.size())};
  EXPECT_THAT(DecodeBody(h, body).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("register.tensors: count 4294967295 exceeds the 0 bytes left")));
  // A tensor's dtype outside the enum, a boolean that is not 0/1.
  RegisterMsg reg{.manifest = Manifest()};
  std::string frame = EncodeFrame(reg);
  size_t name_at = frame.find("layers.0.w");
  ASSERT_NE(name_at, std::string::npos);
  std::string bad = frame;
  bad[name_at + 10] = 42;  // the dtype byte after the name
  EXPECT_THAT(DecodeFrame(bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("register.tensors.dtype: not a "
                                                               "dtype: 42")));
  bad = frame;
  // dataset_shuffle: before chunk_bytes, staging_bytes and the resume fields (4 x i64, 2 bools).
  bad[frame.size() - 17 - 34] = 2;
  EXPECT_THAT(DecodeFrame(bad).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("register.dataset_shuffle: not a boolean")));
  // The layout's chunk flags (wire version 10): unknown bits, ChunkDP without DP sharding.
  {
    RegisterMsg replicated{.manifest = Manifest()};
    replicated.manifest.tensors.back().layout = Layout::Layer(1);  // was Layer(1).ChunkDP()
    const std::string plain = EncodeFrame(replicated);
    ASSERT_EQ(plain.size(), frame.size());
    std::vector<size_t> diff;  // the zero flag, then the chunk flags
    for (size_t i = 0; i < frame.size(); ++i) {
      if (plain[i] != frame[i]) diff.push_back(i);
    }
    ASSERT_EQ(diff.size(), 2u);
    ASSERT_EQ(frame[diff[1]], 2);  // kChunkDPBit
    bad = frame;
    bad[diff[1]] = 4;
    EXPECT_THAT(DecodeFrame(bad).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("register.tensors.layout.chunks: unknown bits")));
    bad = frame;
    bad[diff[0]] = 0;
    EXPECT_THAT(DecodeFrame(bad).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("chunks: ChunkDP set without DP sharding")));
  }
  // Register is not limited like Hello: a large manifest passes the header check.
  JobManifest big = Manifest();
  for (int i = 0; i < 2000; ++i) {
    big.tensors.push_back(TensorSpec{"t" + std::to_string(i), DType::kF32, {4}, Layout()});
  }
  std::string big_frame = EncodeFrame(RegisterMsg{.manifest = big});
  ASSERT_GT(big_frame.size(), kMaxHelloBody);
  MORPH_ASSERT_OK_AND_ASSIGN(WireMessage back, DecodeFrame(big_frame));
  EXPECT_EQ(std::get<RegisterMsg>(back).manifest, big);
}

TEST(WireTest, IdListsAreShortestFormVarints) {
  Generation g = Gen();
  g.ranks = {0, 1, -1, std::numeric_limits<int64_t>::max()};
  ChangeParticipants c{.participants = {std::numeric_limits<int64_t>::min(), 4095}};
  CommitMsg m{.next = g, .from_generation = 6, .from = Gen(6), .change = c};
  MORPH_ASSERT_OK_AND_ASSIGN(WireMessage back, DecodeFrame(EncodeFrame(m)));
  EXPECT_EQ(std::get<CommitMsg>(back), m);
  // A 4,096-rank commit whose lists ascend by one: about a byte per id.
  Generation big = Gen();
  big.config.dp = 1024;
  big.config.tp = 4;
  big.ranks.clear();
  for (int64_t w = 1; w <= 4096; ++w) big.ranks.push_back(w);
  CommitMsg large{.next = big, .from_generation = 7, .from = big, .change = {}};
  large.from.id = 7;
  large.change.participants = big.ranks;
  // Ascending runs are run-length coded: three 4,096-id lists in a few bytes each (was 12 KB).
  EXPECT_LT(EncodeFrame(large).size(), 512u);
  // Any list survives the round trip, runs and scattered ids mixed.
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    Generation g2 = Gen();
    g2.config.dp = 1 + static_cast<int>(rng() % 64);
    g2.config.tp = 1;
    g2.ranks.clear();
    int64_t x = static_cast<int64_t>(rng() % 5) - 2;
    for (int r = 0; r < g2.config.dp; ++r) {
      const uint64_t kind = rng() % 4;
      x = kind == 0 ? static_cast<int64_t>(rng()) : kind == 1 ? x - 1 : x + 1;
      g2.ranks.push_back(x);
    }
    CommitMsg m2{.next = g2, .from_generation = 6, .from = Gen(6), .change = {}};
    MORPH_ASSERT_OK_AND_ASSIGN(WireMessage back2, DecodeFrame(EncodeFrame(m2)));
    ASSERT_EQ(std::get<CommitMsg>(back2), m2) << "list " << i;
  }
  // Hand-made bodies: an overlong zero, a varint past 64 bits.
  auto body_with_ranks = [](uint32_t count, std::string rank_bytes) {
    std::string body;
    auto u32 = [&](uint32_t v) {
      for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>(v >> (8 * i)));
    };
    for (int i = 0; i < 16; ++i) body.push_back(i == 0 ? 7 : 0);  // id 7, start step 0
    for (int v : {1, 1, 1, 0, 1}) u32(v);
    u32(0);  // no layers
    u32(count);  // the ranks' count
    return body + rank_bytes;
  };
  for (auto [count, bytes, why] :
       {std::tuple<uint32_t, std::string, std::string>{1, std::string("\x80\x00", 2), "varint not in its shortest form"},
        {1, std::string(9, '\xff') + "\x02", "varint overflows 64 bits"},
        // A run of 0 ids, a run longer than the count, a run right after a run (one run), and a
        // count no list may have (a few bytes would otherwise expand to 2^32 ids).
        {1, std::string("\x02\x00", 2), "a run of 0 ids with 1 of the count left"},
        {1, std::string("\x02\x02", 2), "a run of 2 ids with 1 of the count left"},
        {3, std::string("\x02\x01\x02\x02", 4), "a run right after a run"},
        {0xffffffffu, std::string("\x02\xff\xff\xff\xff\x0f", 6),
         "count 4294967295 exceeds the limit of 131072 ids"}}) {
    std::string body = body_with_ranks(count, bytes);
    FrameHeader h{.version = kWireVersion,
                  .type = static_cast<uint16_t>(WireType::kCommit),
                  .length = static_cast<uint32_t>(body.size())};
    EXPECT_THAT(DecodeBody(h, body).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("commit.next.ranks: " + why)));
  }
}

TEST(WireTest, IdListsOfOneFrameAreBoundedTogether) {
  // Runs make a list of k ids a few bytes long, so a small frame could name billions of ids:
  // nine 131,072-id shapes (a ~100-byte frame) would decode to 9.4 MB; the frame's budget is
  // kMaxIdsPerFrame ids in all.
  JobManifest m = Manifest();
  std::vector<int64_t> run(kMaxIdList);
  for (size_t i = 0; i < run.size(); ++i) run[i] = static_cast<int64_t>(i + 1);
  m.tensors.clear();
  for (int i = 0; i < 9; ++i) {
    m.tensors.push_back(TensorSpec{"t" + std::to_string(i), DType::kF32, run, Layout()});
  }
  const std::string frame = EncodeFrame(RegisterMsg{.manifest = m});
  EXPECT_LT(frame.size(), 1024u);
  EXPECT_THAT(DecodeFrame(frame).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("register.tensors.shape: count 131072 takes the frame past 1048576 "
                                 "ids in all")));
}

TEST(WireTest, WelcomeCurrentMustBeItsGeneration) {
  WelcomeMsg m{.worker = 1, .generation = 5, .store_address = "h:1", .current = Gen(6)};
  EXPECT_THAT(DecodeFrame(EncodeFrame(m)).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("welcome.current: generation 6 is not generation 5")));
}

TEST(WireTest, CommitFromMustBeItsFromGeneration) {
  CommitMsg m{.next = Gen(), .from_generation = 5, .from = Gen(6)};
  StatusOr<WireMessage> d = DecodeFrame(EncodeFrame(m));
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("generation 6 is not from_generation 5"), std::string::npos)
      << d.status().message();
}

}  // namespace
}  // namespace morph
