#include "reshard/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "base/testing.h"
#include "reshard/crc32c.h"
#include "reshard/reshard_testutil.h"

namespace morph {
namespace {

namespace fs = std::filesystem;
using ::morph::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace ::morph::testutil;  // NOLINT

TEST(Crc32cTest, KnownValuesAndExtension) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::string s(1000, 'x');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 7);
  EXPECT_EQ(Crc32cExtend(Crc32c(s.data(), 333), s.data() + 333, 667), Crc32c(s.data(), 1000));
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/morph_ckpt_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    dir_ = root_ + "/step-7";
    tensors_ = {{"w1", DType::kF32, {48, 40}},
                {"adam_m", DType::kBF16, {30, 17}},
                {"scale", DType::kF64, {}}};
    for (size_t i = 0; i < tensors_.size(); ++i)
      ref_.push_back(ReferenceTensor(tensors_[i], static_cast<int>(i)));
  }
  void TearDown() override { fs::remove_all(root_); }

  // Saves the tensors under `layouts` (one Region per piece), one rank per holder.
  void Save(const std::vector<RegionLayout>& layouts, int num_ranks,
            CheckpointSaveOptions opts = {}) {
    std::vector<std::vector<CheckpointPiece>> by_rank(static_cast<size_t>(num_ranks));
    std::vector<std::vector<char>> keep;
    keep.reserve(64);
    for (size_t t = 0; t < tensors_.size(); ++t) {
      for (const Region& r : layouts[t]) {
        keep.push_back(ExtractShard(tensors_[t], r.shard, ref_[t]));
        by_rank[static_cast<size_t>(r.holders[0])].push_back(
            {tensors_[t], r.shard,
             ConstBufferView(keep.back().data(), keep.back().size(), MemoryKind::kHost)});
      }
    }
    std::vector<std::unique_ptr<CheckpointSave>> saves;
    for (int r = 0; r < num_ranks; ++r) {
      auto s = SaveCheckpointAsync(dir_, r, num_ranks, 7, R"({"tp": 1, "dp": 4})",
                                   by_rank[static_cast<size_t>(r)], opts);
      ASSERT_TRUE(s.ok()) << s.status();
      saves.push_back(std::move(s).value());
    }
    // Snapshots were taken: clobbering the sources must not change what is saved.
    for (auto& k : keep) std::fill(k.begin(), k.end(), 0);
    for (auto& s : saves) MORPH_ASSERT_OK(s->Wait(Deadline::AfterMs(60000)));
  }

  void ExpectLoads(const CheckpointReader& ckpt, const std::vector<RegionLayout>& layouts) {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      for (const Region& r : layouts[t]) {
        std::vector<char> got(
            static_cast<size_t>(r.shard.NumElements() * DTypeSize(tensors_[t].dtype)));
        MORPH_ASSERT_OK(ckpt.Read(tensors_[t].name, tensors_[t].dtype, r.shard,
                                  BufferView{got.data(), got.size(), MemoryKind::kHost}));
        ASSERT_EQ(got, ExtractShard(tensors_[t], r.shard, ref_[t]))
            << tensors_[t].name << " shard " << r.shard.ToString();
      }
    }
  }

  std::vector<RegionLayout> Tp4() {
    return {TpLayout(tensors_[0], 1, {0, 1, 2, 3}), FlatLayout(tensors_[1], {0, 1, 2, 3}),
            ReplicatedLayout(tensors_[2], {2})};
  }

  std::string root_, dir_;
  std::vector<TensorInfo> tensors_;
  std::vector<std::vector<char>> ref_;
};

TEST_F(CheckpointTest, SaveUnderOneShardingLoadUnderAnother) {
  CheckpointSaveOptions opts;
  opts.block_bytes = 512;
  Save(Tp4(), 4, opts);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  EXPECT_EQ(ckpt.step(), 7);
  EXPECT_EQ(ckpt.num_ranks(), 4);
  EXPECT_EQ(ckpt.config_json(), R"({"dp":4,"tp":1})");
  EXPECT_EQ(ckpt.tensors().size(), 3u);
  ExpectLoads(ckpt, {TpLayout(tensors_[0], 0, {0, 1, 2}), TpLayout(tensors_[1], 1, {0, 1}),
                     ReplicatedLayout(tensors_[2], {0})});
  ExpectLoads(ckpt, {FlatLayout(tensors_[0], {0, 1, 2, 3, 4}), FlatLayout(tensors_[1], {0}),
                     ReplicatedLayout(tensors_[2], {0})});
  std::mt19937_64 rng(morph::testing::TestSeed());
  for (int i = 0; i < 20; ++i) {
    ExpectLoads(ckpt, {RandomLayout(tensors_[0], 6, rng), RandomLayout(tensors_[1], 6, rng),
                       ReplicatedLayout(tensors_[2], {0})});
  }
}

TEST_F(CheckpointTest, ReadsOnlyTheBlocksItNeeds) {
  CheckpointSaveOptions opts;
  opts.block_bytes = 256;
  Save(Tp4(), 4, opts);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  // Row 5, columns [0, 10) of w1 lie in rank 0's piece (columns [0, 10)): 40 bytes.
  Shard want = *Shard::Whole(Box({{5, 6}, {0, 10}}));
  std::vector<char> got(40);
  MORPH_ASSERT_OK(
      ckpt.Read("w1", DType::kF32, want, BufferView{got.data(), 40, MemoryKind::kHost}));
  EXPECT_EQ(got, ExtractShard(tensors_[0], want, ref_[0]));
  EXPECT_LE(ckpt.bytes_read(), 2 * 256);
}

// A load in another TP split keeps half of every saved row. With the default (page-sized)
// blocks and pieces starting at a page, it reads exactly the bytes it keeps, each once, even
// after a small piece that leaves data.bin at an odd offset.
TEST_F(CheckpointTest, ReSlicedLoadReadsOnlyTheBytesItKeeps) {
  tensors_ = {{"bias", DType::kF32, {100}}, {"w", DType::kF32, {64, 2048}}};
  ref_ = {ReferenceTensor(tensors_[0], 0), ReferenceTensor(tensors_[1], 1)};
  Save({ReplicatedLayout(tensors_[0], {0}), TpLayout(tensors_[1], 0, {0, 1})}, 2);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  const RegionLayout halves = TpLayout(tensors_[1], 1, {0, 1});
  for (const Region& r : halves) {
    std::vector<char> got(static_cast<size_t>(r.shard.NumElements() * 4));
    MORPH_ASSERT_OK(ckpt.Read("w", DType::kF32, r.shard,
                              BufferView{got.data(), got.size(), MemoryKind::kHost}));
    ASSERT_EQ(got, ExtractShard(tensors_[1], r.shard, ref_[1])) << r.shard.ToString();
  }
  EXPECT_EQ(ckpt.bytes_read(), 64 * 2048 * 4);
}

// Random layouts saved and loaded with block sizes that do and do not divide the rows, dtypes
// of 1 to 8 bytes, rows shorter and longer than a block, 1-D to 3-D: bitwise equal to the
// reference built element by element. Then one flipped byte in each rank's data: any read of a
// whole tensor that has a piece in that block is kDataLoss, the others still load.
TEST_F(CheckpointTest, RandomLayoutsAndBlockSizesLoadBitwise) {
  tensors_ = {{"a", DType::kF32, {37, 96}},
              {"b", DType::kBF16, {24, 130}},
              {"c", DType::kF64, {9, 5, 12}},
              {"d", DType::kI8, {1000}},
              {"e", DType::kI32, {3, 4097}}};
  ref_.clear();
  for (size_t i = 0; i < tensors_.size(); ++i)
    ref_.push_back(ReferenceTensor(tensors_[i], static_cast<int>(i)));
  std::mt19937_64 rng(morph::testing::TestSeed());
  for (uint64_t block : {uint64_t{64}, uint64_t{192}, uint64_t{1024}, uint64_t{4096}}) {
    SCOPED_TRACE("block_bytes " + std::to_string(block));
    fs::remove_all(dir_);
    std::vector<RegionLayout> saved;
    for (const TensorInfo& t : tensors_) saved.push_back(RandomLayout(t, 3, rng));
    CheckpointSaveOptions opts;
    opts.block_bytes = block;
    Save(saved, 3, opts);
    MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
    for (int i = 0; i < 8; ++i) {
      std::vector<RegionLayout> loaded;
      for (const TensorInfo& t : tensors_) loaded.push_back(RandomLayout(t, 5, rng));
      ExpectLoads(ckpt, loaded);
    }
    // One flipped byte in each rank's data file, at random.
    std::map<std::string, bool> damaged;  // tensor -> a piece shares a damaged block
    for (int rank = 0; rank < 3; ++rank) {
      const std::string rank_dir = dir_ + "/rank-0000" + std::to_string(rank);
      const uint64_t size = fs::file_size(rank_dir + "/data.bin");
      if (size == 0) continue;
      const uint64_t at = rng() % size, k = at / block;
      {
        std::fstream f(rank_dir + "/data.bin", std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(static_cast<std::streamoff>(at));
        char c = 0;
        f.read(&c, 1);
        c = static_cast<char>(c ^ 0x01);
        f.seekp(static_cast<std::streamoff>(at));
        f.write(&c, 1);
      }
      const auto manifest = nlohmann::json::parse(std::ifstream(rank_dir + "/manifest.json"));
      for (const auto& piece : manifest.at("pieces")) {
        const uint64_t off = piece.at("offset").get<uint64_t>();
        const uint64_t bytes = piece.at("bytes").get<uint64_t>();
        if (bytes > 0 && off / block <= k && k <= (off + bytes - 1) / block) {
          damaged[piece.at("tensor").get<std::string>()] = true;
        }
      }
    }
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const Shard whole = *Shard::Whole(Box::FromShape(tensors_[t].shape));
      std::vector<char> got(ref_[t].size());
      const Status s = ckpt.Read(tensors_[t].name, tensors_[t].dtype, whole,
                                 BufferView{got.data(), got.size(), MemoryKind::kHost});
      if (damaged[tensors_[t].name]) {
        EXPECT_THAT(s, StatusIs(StatusCode::kDataLoss, HasSubstr("checksum mismatch")))
            << tensors_[t].name;
      } else {
        EXPECT_TRUE(s.ok()) << tensors_[t].name << ": " << s;
        EXPECT_EQ(got, ref_[t]) << tensors_[t].name;
      }
    }
  }
}

TEST_F(CheckpointTest, InterruptedSaveIsNeverComplete) {
  auto layouts = Tp4();
  // Rank 3 holds w1 columns [30, 40) and a flat part of adam_m: make it save nothing, and leave
  // the temporary folder a killed save would leave.
  Save(layouts, 4);
  fs::rename(dir_ + "/rank-00003", dir_ + "/.rank-00003.tmp-12345-0");
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("incomplete: rank 3 of 4 has not finished saving"),
                             HasSubstr("interrupted"))));
  fs::remove_all(dir_);
  fs::create_directories(dir_ + "/.rank-00000.tmp-1-0");
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("rank 0 has not finished")));
  EXPECT_THAT(CheckpointReader::Open(root_ + "/nope").status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("nope")));
}

TEST_F(CheckpointTest, CorruptedAndTruncatedFilesAreDataLoss) {
  CheckpointSaveOptions opts;
  opts.block_bytes = 1024;
  Save(Tp4(), 4, opts);
  const std::string f1 = dir_ + "/rank-00001/data.bin";
  {
    std::fstream f(f1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c;
    f.read(&c, 1);
    f.seekp(100);
    c = static_cast<char>(c ^ 0x40);
    f.write(&c, 1);
  }
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  std::vector<char> got(48 * 40 * 4);
  EXPECT_THAT(
      ckpt.Read("w1", DType::kF32, *Shard::Whole(Box::FromShape({48, 40})),
                BufferView{got.data(), got.size(), MemoryKind::kHost}),
      StatusIs(StatusCode::kDataLoss, AllOf(HasSubstr(f1), HasSubstr("checksum mismatch"))));
  fs::resize_file(dir_ + "/rank-00002/data.bin", 100);
  // Truncated after the reader was opened: the read says so (the loader maps the files, and
  // touching a mapping past the end of its file would raise SIGBUS instead).
  {
    const TensorInfo& t = tensors_[2];  // held by rank 2 only
    int64_t elements = 1;
    for (int64_t d : t.shape) elements *= d;
    std::vector<char> whole(static_cast<size_t>(elements * DTypeSize(t.dtype)));
    EXPECT_THAT(ckpt.Read(t.name, t.dtype, *Shard::Whole(Box::FromShape(t.shape)),
                          BufferView{whole.data(), whole.size(), MemoryKind::kHost}),
                StatusIs(StatusCode::kDataLoss,
                         AllOf(HasSubstr("rank-00002/data.bin"), HasSubstr("truncated"))));
  }
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("rank-00002/data.bin"), HasSubstr("truncated"))));
  std::ofstream(dir_ + "/rank-00000/manifest.json") << "{\"format\": \"morph-checkpoint\"";
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("rank-00000/manifest.json"), HasSubstr("unreadable"))));
}

// checksums.bin: a changed checksum is a mismatch of its block; a short file is refused by
// Open, or by a Read if it shrinks after Open; a missing one is refused by Open.
TEST_F(CheckpointTest, DamagedChecksumFileIsDataLoss) {
  Save(Tp4(), 4);
  const std::string sums = dir_ + "/rank-00001/checksums.bin";
  ASSERT_EQ(fs::file_size(sums), 4u);  // rank 1's pieces fit in one 4 KiB block
  {
    std::fstream f(sums, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2);
    f.write("\x5a", 1);
  }
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  std::vector<char> got(48 * 40 * 4);
  const BufferView view{got.data(), got.size(), MemoryKind::kHost};
  const Shard w1 = *Shard::Whole(Box::FromShape({48, 40}));
  EXPECT_THAT(ckpt.Read("w1", DType::kF32, w1, view),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("rank-00001/data.bin"),
                             HasSubstr("checksum mismatch in block 0 (bytes 0.."))));
  fs::resize_file(sums, 0);  // after Open: the Read finds it short
  EXPECT_THAT(ckpt.Read("w1", DType::kF32, w1, view),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("checksum file " + sums), HasSubstr("(truncated)"))));
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("checksum file " + sums),
                             HasSubstr("has 0 bytes, its data file's 1 blocks need 4"))));
  fs::remove(sums);
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("checksum file " + sums), HasSubstr("is missing"))));
}

// Checkpoints of format 1 (checksums inline in the manifest, pieces 64-byte aligned) still
// load: this one is made by rewriting a format-2 save the way format 1 stored it.
TEST_F(CheckpointTest, ReadsFormatOneCheckpoints) {
  CheckpointSaveOptions opts;
  opts.block_bytes = 256;
  Save(Tp4(), 4, opts);
  for (int r = 0; r < 4; ++r) {
    const std::string rank_dir = dir_ + "/rank-0000" + std::to_string(r);
    std::ifstream in(rank_dir + "/checksums.bin", std::ios::binary);
    const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<uint32_t> crcs(raw.size() / 4);
    std::memcpy(crcs.data(), raw.data(), raw.size());  // little-endian host
    auto m = nlohmann::json::parse(std::ifstream(rank_dir + "/manifest.json"));
    m["version"] = 1;
    m["files"][0].erase("checksums");
    m["files"][0]["crc32c"] = crcs;
    std::ofstream(rank_dir + "/manifest.json") << m.dump(1);
    fs::remove(rank_dir + "/checksums.bin");
  }
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  ExpectLoads(ckpt, {TpLayout(tensors_[0], 0, {0, 1, 2}), TpLayout(tensors_[1], 1, {0, 1}),
                     ReplicatedLayout(tensors_[2], {0})});
  std::mt19937_64 rng(morph::testing::TestSeed());
  for (int i = 0; i < 5; ++i) {
    ExpectLoads(ckpt, {RandomLayout(tensors_[0], 6, rng), RandomLayout(tensors_[1], 6, rng),
                       ReplicatedLayout(tensors_[2], {0})});
  }
  // An unknown version is named as such.
  const std::string man = dir_ + "/rank-00000/manifest.json";
  auto m = nlohmann::json::parse(std::ifstream(man));
  m["version"] = 3;
  std::ofstream(man) << m.dump();
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("not a morph checkpoint of version 1 to 2")));
}

TEST_F(CheckpointTest, BadInputsAndReads) {
  Save(Tp4(), 4);
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  std::vector<char> buf(8);
  BufferView v{buf.data(), 8, MemoryKind::kHost};
  const Shard scalar = *Shard::Whole(Box());
  EXPECT_THAT(ckpt.Read("nope", DType::kF64, scalar, v),
              StatusIs(StatusCode::kNotFound, HasSubstr("'nope'")));
  EXPECT_THAT(ckpt.Read("scale", DType::kF32, scalar, v),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("saved as f64, not f32")));
  MORPH_EXPECT_OK(ckpt.Read("scale", DType::kF64, scalar, v));
  EXPECT_EQ(buf, ref_[2]);
  EXPECT_THAT(ckpt.Read("w1", DType::kF32, *Shard::Whole(Box({{0, 3}, {0, 1}})), v),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("has 8 bytes, shard")));

  // The same rank cannot save twice into one checkpoint.
  std::vector<CheckpointPiece> none;
  MORPH_ASSERT_OK_AND_ASSIGN(auto again, SaveCheckpointAsync(dir_, 1, 4, 7, {}, none));
  EXPECT_THAT(again->Wait(Deadline::AfterMs(60000)),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("rank-00001 already exists")));
  EXPECT_THAT(SaveCheckpointAsync(dir_, 4, 4, 7, {}, none).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("rank 4 of 4")));
  std::vector<CheckpointPiece> bad{{tensors_[0], *Shard::Whole(Box::FromShape({48, 40})),
                                    ConstBufferView(buf.data(), 8, MemoryKind::kHost)}};
  EXPECT_THAT(SaveCheckpointAsync(root_ + "/x", 0, 1, 7, {}, bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor 'w1' has 8 bytes")));
  EXPECT_THAT(SaveCheckpointAsync(root_ + "/y", 0, 1, 7, "{\"tp\": ", none).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("config_json is not JSON")));
}

// A hand-edited manifest whose numbers wrap past 2^64 when added: each is refused by Open
// (kDataLoss naming the manifest, the tensor and the field), never read from.
TEST_F(CheckpointTest, ManifestOffsetsThatWrapAreDataLoss) {
  Save(Tp4(), 4);
  const std::string man = dir_ + "/rank-00000/manifest.json";
  const auto original = nlohmann::json::parse(std::ifstream(man));
  auto edit = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json m = original;
    change(m);
    std::ofstream(man) << m.dump();
  };
  size_t w1 = 0;  // rank 0's piece of w1
  while (original.at("pieces").at(w1).at("tensor") != "w1") ++w1;
  const nlohmann::json& shard = original.at("pieces").at(w1).at("shard");
  const uint64_t piece_bytes =
      4 * (shard.at("flat_end").get<uint64_t>() - shard.at("flat_begin").get<uint64_t>());
  // offset + length wraps to a small number inside the file (the offset is 64-byte aligned).
  const uint64_t wrapping = ~uint64_t{0} - 63;
  ASSERT_LT(wrapping + piece_bytes, original.at("files").at(0).at("bytes").get<uint64_t>());
  edit([&](nlohmann::json& m) { m["pieces"][w1]["offset"] = wrapping; });
  EXPECT_THAT(
      CheckpointReader::Open(dir_).status(),
      StatusIs(StatusCode::kDataLoss, AllOf(HasSubstr(man), HasSubstr("tensor 'w1'"),
                                            HasSubstr("offset " + std::to_string(wrapping)))));
  // A data file size near 2^64 (its block count would wrap to 0).
  edit([&](nlohmann::json& m) { m["files"][0]["bytes"] = ~uint64_t{0}; });
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("rank-00000/")));
  // A frame reaching below 0 (its size would overflow).
  edit([&](nlohmann::json& m) {
    m["pieces"][w1]["shard"]["frame"][0] = {std::numeric_limits<int64_t>::min(), 48};
  });
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss, AllOf(HasSubstr(man), HasSubstr("tensor 'w1'"))));
  edit([](nlohmann::json&) {});
  MORPH_EXPECT_OK(CheckpointReader::Open(dir_).status());
}

// Verify reads every block once and checks it: a flipped byte anywhere is found (naming the file
// and block, as a Read of it would), as is a file shortened after Open.
TEST_F(CheckpointTest, VerifyFindsAFlippedByteAnywhere) {
  CheckpointSaveOptions opts;
  opts.block_bytes = 256;
  Save(Tp4(), 4, opts);
  {
    MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
    MORPH_EXPECT_OK(ckpt.Verify());
    int64_t total = 0;
    for (int r = 0; r < 4; ++r) {
      total += static_cast<int64_t>(
          fs::file_size(dir_ + "/rank-0000" + std::to_string(r) + "/data.bin"));
    }
    EXPECT_EQ(ckpt.bytes_read(), total);
  }
  const std::string f2 = dir_ + "/rank-00002/data.bin";
  const uint64_t last = fs::file_size(f2) - 1;  // in the file's last (short) block
  for (const uint64_t at : {uint64_t{0}, uint64_t{300}, last}) {
    SCOPED_TRACE("byte " + std::to_string(at));
    std::fstream f(f2, std::ios::in | std::ios::out | std::ios::binary);
    char c;
    f.seekg(static_cast<std::streamoff>(at));
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(static_cast<char>(c ^ 0x01));
    f.close();
    MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
    EXPECT_THAT(ckpt.Verify(),
                StatusIs(StatusCode::kDataLoss,
                         AllOf(HasSubstr(f2), HasSubstr("checksum mismatch in block " +
                                                        std::to_string(at / 256)))));
    std::fstream g(f2, std::ios::in | std::ios::out | std::ios::binary);
    g.seekp(static_cast<std::streamoff>(at));
    g.put(c);
  }
  MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader ckpt, CheckpointReader::Open(dir_));
  MORPH_EXPECT_OK(ckpt.Verify());
  fs::resize_file(f2, 100);
  EXPECT_THAT(ckpt.Verify(),
              StatusIs(StatusCode::kDataLoss, AllOf(HasSubstr(f2), HasSubstr("truncated"))));
}

TEST_F(CheckpointTest, OverlappingOrMissingPiecesAreDataLoss) {
  // The replicated scalar saved by two ranks: overlapping pieces.
  auto layouts = Tp4();
  layouts[2] = {{*Shard::Whole(Box()), {0}}, {*Shard::Whole(Box()), {1}}};
  Save(layouts, 4);
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("of tensor 'scale' overlap")));
  fs::remove_all(dir_);
  layouts = Tp4();
  layouts[0].pop_back();  // w1 columns [30, 40) never saved
  Save(layouts, 4);
  EXPECT_THAT(CheckpointReader::Open(dir_).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("'w1' hold 1440 of its 1920 elements")));
}

}  // namespace
}  // namespace morph

namespace morph {
namespace {

TEST(CheckpointSnapshotPoolTest, KeepsOneBufferAndReusesIt) {
  CheckpointSnapshotPool pool;
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer a, pool.Take(4096));
  void* kept = a.data();
  pool.Give(std::move(a));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer b, pool.Take(1000));  // smaller fits in the kept one
  EXPECT_EQ(b.data(), kept);
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer c, pool.Take(1000));  // nothing kept now: fresh
  EXPECT_NE(c.data(), kept);
  pool.Give(std::move(b));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer d, pool.Take(8192));  // kept one too small: fresh
  EXPECT_GE(d.size(), 8192u);
}

// Two saves through one pool: the second reuses the first's snapshot buffer, and both
// checkpoints load back bitwise.
TEST(CheckpointSnapshotPoolTest, SuccessiveSavesReuseTheSnapshot) {
  const std::string root = ::testing::TempDir() + "/morph_ckpt_pool_" + std::to_string(::getpid());
  std::filesystem::remove_all(root);
  auto pool = std::make_shared<CheckpointSnapshotPool>();
  TensorInfo info{"w", DType::kI32, {64, 32}};
  MORPH_ASSERT_OK_AND_ASSIGN(Shard whole, Shard::Whole(Box::FromShape({64, 32})));
  std::vector<int32_t> data(64 * 32);
  for (int step = 1; step <= 2; ++step) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<int32_t>(i * 7 + step);
    CheckpointSaveOptions opts;
    opts.snapshot_pool = pool;
    opts.block_bytes = 1024;
    std::vector<CheckpointPiece> pieces{
        {info, whole, ConstBufferView(data.data(), data.size() * 4, MemoryKind::kHost)}};
    const std::string dir = root + "/step-" + std::to_string(step);
    MORPH_ASSERT_OK_AND_ASSIGN(auto save, SaveCheckpointAsync(dir, 0, 1, step, {}, pieces, opts));
    std::fill(data.begin(), data.end(), -1);  // the snapshot was taken: buffers may change
    MORPH_ASSERT_OK(save->Wait(Deadline::AfterMs(30000)));
    save.reset();
    MORPH_ASSERT_OK_AND_ASSIGN(CheckpointReader reader, CheckpointReader::Open(dir));
    std::vector<int32_t> back(64 * 32, 0);
    MORPH_ASSERT_OK(reader.Read("w", DType::kI32, whole,
                                BufferView{back.data(), back.size() * 4, MemoryKind::kHost}));
    for (size_t i = 0; i < back.size(); ++i) {
      ASSERT_EQ(back[i], static_cast<int32_t>(i * 7 + step)) << "step " << step << " i " << i;
    }
    // The pool now holds the snapshot of this save: the bytes that were written.
    MORPH_ASSERT_OK_AND_ASSIGN(Buffer kept, pool->Take(back.size() * 4));
    ASSERT_EQ(std::memcmp(kept.data(), back.data(), back.size() * 4), 0);
    pool->Give(std::move(kept));
  }
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace morph
