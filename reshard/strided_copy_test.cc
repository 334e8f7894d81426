#include "reshard/strided_copy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

// Element-by-element reference of HostStridedCopy.
void NaiveCopy(const StridedView& dst, char* d, const StridedView& src, const char* s, int es,
               int64_t begin, int64_t end) {
  for (int64_t e = begin; e < end; ++e) {
    int64_t rem = e, doff = dst.offset, soff = src.offset;
    for (int k = static_cast<int>(src.shape.size()) - 1; k >= 0; --k) {
      const size_t i = static_cast<size_t>(k);
      const int64_t idx = rem % src.shape[i];
      rem /= src.shape[i];
      doff += idx * dst.strides[i];
      soff += idx * src.strides[i];
    }
    std::memcpy(d + doff * es, s + soff * es, static_cast<size_t>(es));
  }
}

TEST(StridedCopyTest, PackColumnBlockOfMatrix) {
  // A 4x6 frame; box rows [1,3), cols [2,5).
  const Shard s = *Shard::Whole(Box::FromShape({4, 6}));
  std::vector<int32_t> frame(24);
  for (int i = 0; i < 24; ++i) frame[static_cast<size_t>(i)] = i;
  MORPH_ASSERT_OK_AND_ASSIGN(StridedView v, ViewOf(s, Box({{1, 3}, {2, 5}})));
  MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry g, MakeCopyGeometry(ContiguousView({2, 3}), v));
  EXPECT_EQ(g.row, 3);
  EXPECT_EQ(g.outer_rank, 1);
  std::vector<int32_t> out(6, -1);
  HostStridedCopy(g, out.data(), frame.data(), 4, 0, 6);
  EXPECT_EQ(out, (std::vector<int32_t>{8, 9, 10, 14, 15, 16}));
  // A sub-range that starts and ends inside rows.
  std::vector<int32_t> part(6, -1);
  HostStridedCopy(g, part.data(), frame.data(), 4, 1, 5);
  EXPECT_EQ(part, (std::vector<int32_t>{-1, 9, 10, 14, 15, -1}));
}

TEST(StridedCopyTest, MergesContiguousDimensions) {
  const Shard s = *Shard::Whole(Box::FromShape({3, 4, 5}));
  MORPH_ASSERT_OK_AND_ASSIGN(StridedView v, ViewOf(s, Box({{1, 3}, {0, 4}, {0, 5}})));
  MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry g, MakeCopyGeometry(ContiguousView(v.shape), v));
  EXPECT_EQ(g.outer_rank, 0);
  EXPECT_EQ(g.row, 40);
  EXPECT_EQ(g.src_offset, 20);
}

TEST(StridedCopyTest, RejectsShapeMismatch) {
  EXPECT_THAT(MakeCopyGeometry(ContiguousView({2, 3}), ContiguousView({3, 2})),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("{2,3}")));
}

TEST(StridedCopyTest, ContiguousOffset) {
  const Shard s = *Shard::Whole(Box::FromShape({4, 6}));
  const StridedView cols = *ViewOf(s, Box({{0, 4}, {2, 4}}));
  EXPECT_EQ(ContiguousOffset(cols, 0, 2), std::optional<int64_t>(2));
  EXPECT_EQ(ContiguousOffset(cols, 1, 3), std::nullopt);
  const StridedView rows = *ViewOf(s, Box({{1, 3}, {0, 6}}));
  EXPECT_EQ(ContiguousOffset(rows, 3, 12), std::optional<int64_t>(9));
}

TEST(StridedCopyTest, RandomViewsMatchNaiveCopy) {
  const unsigned long long seed = morph::testing::TestSeed();
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 500; ++iter) {
    const int rank = 1 + static_cast<int>(rng() % 4);
    std::vector<int64_t> fshape_a, fshape_b;
    std::vector<Interval> box_dims;
    std::vector<Interval> fa, fb;
    for (int d = 0; d < rank; ++d) {
      const int64_t len = 1 + static_cast<int64_t>(rng() % 5);
      const int64_t begin = static_cast<int64_t>(rng() % 3);
      box_dims.push_back({begin, begin + len});
      const int64_t pa = static_cast<int64_t>(rng() % 2), pb = static_cast<int64_t>(rng() % 3);
      fa.push_back({begin - std::min(begin, pa), begin + len + pa});
      fb.push_back({begin - std::min(begin, pb), begin + len + static_cast<int64_t>(rng() % 2)});
    }
    const Box box(box_dims);
    const Shard sa = *Shard::Whole(Box(fa)), sb = *Shard::Whole(Box(fb));
    const int es = 1 << (rng() % 4);
    MORPH_ASSERT_OK_AND_ASSIGN(StridedView va, ViewOf(sa, box));
    MORPH_ASSERT_OK_AND_ASSIGN(StridedView vb, ViewOf(sb, box));
    MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry g, MakeCopyGeometry(vb, va));
    std::vector<char> src(static_cast<size_t>(sa.NumElements() * es));
    for (char& c : src) c = static_cast<char>(rng());
    std::vector<char> got(static_cast<size_t>(sb.NumElements() * es), 0), want = got;
    const int64_t n = *box.NumElements();
    const int64_t b = static_cast<int64_t>(rng() % static_cast<uint64_t>(n + 1));
    const int64_t e = b + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - b + 1));
    HostStridedCopy(g, got.data(), src.data(), es, b, e);
    NaiveCopy(vb, want.data(), va, src.data(), es, b, e);
    ASSERT_EQ(got, want) << "iteration " << iter << " box " << box << " range [" << b << "," << e
                         << ")";
  }
}

// HostStridedTransfer between two geometries that each pair one side with a dense layout (as
// the two ends of a strided message do, merging dimensions differently) equals the direct copy.
TEST(StridedCopyTest, RandomStridedTransferMatchesNaiveCopy) {
  const unsigned long long seed = morph::testing::TestSeed();
  SCOPED_TRACE("MORPH_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 500; ++iter) {
    const int rank = 1 + static_cast<int>(rng() % 4);
    std::vector<Interval> box_dims, fa, fb;
    for (int d = 0; d < rank; ++d) {
      const int64_t len = 1 + static_cast<int64_t>(rng() % 5);
      const int64_t begin = static_cast<int64_t>(rng() % 3);
      box_dims.push_back({begin, begin + len});
      fa.push_back({begin - std::min<int64_t>(begin, rng() % 2),
                    begin + len + static_cast<int64_t>(rng() % 2)});
      fb.push_back({begin - std::min<int64_t>(begin, rng() % 3),
                    begin + len + static_cast<int64_t>(rng() % 3)});
    }
    const Box box(box_dims);
    const Shard sa = *Shard::Whole(Box(fa)), sb = *Shard::Whole(Box(fb));
    const int es = 1 << (rng() % 4);
    MORPH_ASSERT_OK_AND_ASSIGN(StridedView va, ViewOf(sa, box));
    MORPH_ASSERT_OK_AND_ASSIGN(StridedView vb, ViewOf(sb, box));
    const StridedView dense = ContiguousView(box.shape());
    MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry gs, MakeCopyGeometry(dense, va));  // gather side
    MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry gd, MakeCopyGeometry(vb, dense));  // scatter side
    std::vector<char> src(static_cast<size_t>(sa.NumElements() * es));
    for (char& c : src) c = static_cast<char>(rng());
    std::vector<char> got(static_cast<size_t>(sb.NumElements() * es), 0), want = got;
    const int64_t n = *box.NumElements();
    const int64_t b = static_cast<int64_t>(rng() % static_cast<uint64_t>(n + 1));
    const int64_t e = b + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - b + 1));
    HostStridedTransfer(gd, got.data(), b, gs, src.data(), b, es, e - b);
    NaiveCopy(vb, want.data(), va, src.data(), es, b, e);
    ASSERT_EQ(got, want) << "iteration " << iter << " box " << box << " range [" << b << "," << e
                         << ")";
  }
}

}  // namespace
}  // namespace morph

namespace morph {
namespace {

// Copies at and above kStreamingCopyMinBytes take the non-temporal path: every alignment of
// source and destination and every tail length must still copy exactly.
TEST(BulkCopyTest, StreamingPathIsExactForAnyAlignmentAndTail) {
  const size_t big = kStreamingCopyMinBytes + 4096;
  std::vector<unsigned char> src(big + 64), dst(big + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t src_off : {0, 1, 8, 15}) {
    for (size_t dst_off : {0, 3, 16, 33}) {
      for (size_t tail : {0, 1, 63, 64, 65}) {
        const size_t n = kStreamingCopyMinBytes + tail;
        std::fill(dst.begin(), dst.end(), 0xAB);
        BulkCopy(dst.data() + dst_off, src.data() + src_off, n);
        ASSERT_EQ(0, std::memcmp(dst.data() + dst_off, src.data() + src_off, n))
            << src_off << " " << dst_off << " " << tail;
        ASSERT_EQ(dst[dst_off + n], 0xAB) << "wrote past the end";
        if (dst_off > 0) {
          ASSERT_EQ(dst[dst_off - 1], 0xAB) << "wrote before the start";
        }
      }
    }
  }
}

// A strided copy large enough to stream (rows of 3 elements, odd offsets) equals the
// element-by-element reference.
TEST(BulkCopyTest, LargeStridedCopyStreamsExactly) {
  const int64_t rows = 40000, cols = 7, take = 3;  // 40000 x 3 f32 = 480 KB >= threshold
  std::vector<float> src(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 0.5f;
  StridedView from{.offset = 2, .shape = {rows, take}, .strides = {cols, 1}};
  StridedView to = ContiguousView({rows, take});
  MORPH_ASSERT_OK_AND_ASSIGN(CopyGeometry g, MakeCopyGeometry(to, from));
  std::vector<float> dst(static_cast<size_t>(rows * take), -1.f);
  ASSERT_GE(dst.size() * sizeof(float), kStreamingCopyMinBytes);
  HostStridedCopy(g, dst.data(), src.data(), sizeof(float), 0, g.num_elements);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < take; ++c) {
      ASSERT_EQ(dst[static_cast<size_t>(r * take + c)], src[static_cast<size_t>(r * cols + c + 2)]);
    }
  }
}

}  // namespace
}  // namespace morph
