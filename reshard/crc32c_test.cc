#include "reshard/crc32c.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace morph {
namespace {

// Bit by bit, from the definition (reflected Castagnoli polynomial).
uint32_t Reference(const unsigned char* p, size_t n) {
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32cTest, KnownValue) { EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u); }

// Lengths around the three-lane blocks (3 x 4 KiB), unaligned starts, split at random points.
TEST(Crc32cTest, EqualsTheDefinitionForAnyLengthAndSplit) {
  std::mt19937 rng(7);
  std::vector<unsigned char> b(3 * 3 * 4096 + 999);
  for (auto& x : b) x = static_cast<unsigned char>(rng());
  std::vector<size_t> lengths = {0, 1, 7, 8, 4095, 12287, 12288, 12289, 24576, 24583};
  for (int i = 0; i < 60; ++i) lengths.push_back(rng() % (b.size() - 64));
  for (size_t n : lengths) {
    const size_t off = rng() % 64;
    const size_t cut = n == 0 ? 0 : rng() % n;
    const uint32_t want = Reference(b.data() + off, n);
    EXPECT_EQ(Crc32c(b.data() + off, n), want) << "n " << n << " offset " << off;
    EXPECT_EQ(Crc32cExtend(Crc32c(b.data() + off, cut), b.data() + off + cut, n - cut), want)
        << "n " << n << " split at " << cut;
  }
}

// Independent blocks (verified alone, and verified while copied): any count (groups of three and a rest), any length, unaligned and
// non-adjacent buffers.
TEST(Crc32cTest, EachEqualsTheDefinitionPerBlock) {
  std::mt19937 rng(11);
  std::vector<unsigned char> b(64 * 5000);
  for (auto& x : b) x = static_cast<unsigned char>(rng());
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{63}, size_t{4096},
                   size_t{4099}}) {
    for (size_t count = 0; count <= 7; ++count) {
      std::vector<const void*> blocks;
      std::vector<size_t> offsets;
      for (size_t i = 0; i < count; ++i) {
        offsets.push_back(rng() % (b.size() - n));
        blocks.push_back(b.data() + offsets.back());
      }
      std::vector<uint32_t> got(count, 0xdeadbeef), got_copying(count, 0xdeadbeef);
      Crc32cEach(blocks.data(), n, count, got.data());
      // Copying: each block cut at random points into segments (some empty, some shorter
      // than 16 bytes), each segment to its own unaligned destination with guard bytes.
      std::vector<std::vector<std::vector<unsigned char>>> dst(count);
      std::vector<std::vector<CopySegment>> segs(count);
      std::vector<ScatteredBlock> scattered;
      for (size_t i = 0; i < count; ++i) {
        std::vector<size_t> cuts = {0, n};
        const size_t num_cuts = rng() % 6;
        for (size_t c = 0; c < num_cuts; ++c) {
          cuts.push_back(rng() % 3 == 0 ? std::min(n, cuts[rng() % cuts.size()] + rng() % 16)
                                         : (n == 0 ? 0 : rng() % n));
        }
        std::sort(cuts.begin(), cuts.end());
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
          dst[i].emplace_back(cuts[c + 1] - cuts[c] + 3, 0xee);
        }
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
          segs[i].push_back({dst[i][c].data() + 1, cuts[c + 1] - cuts[c]});
        }
        scattered.push_back({blocks[i], segs[i].data(), segs[i].size()});
      }
      Crc32cEachAndCopy(scattered.data(), n, count, got_copying.data());
      for (size_t i = 0; i < count; ++i) {
        const uint32_t want = Reference(b.data() + offsets[i], n);
        EXPECT_EQ(got[i], want) << "n " << n << " count " << count << " block " << i;
        EXPECT_EQ(got_copying[i], want) << "n " << n << " count " << count << " block " << i;
        std::vector<unsigned char> copied;
        for (const auto& d : dst[i]) {
          EXPECT_EQ(d.front(), 0xee);
          EXPECT_EQ(d[d.size() - 2], 0xee);
          EXPECT_EQ(d.back(), 0xee);
          copied.insert(copied.end(), d.begin() + 1, d.end() - 2);
        }
        EXPECT_EQ(copied,
                  std::vector<unsigned char>(b.begin() + static_cast<ptrdiff_t>(offsets[i]),
                                             b.begin() + static_cast<ptrdiff_t>(offsets[i] + n)))
            << "n " << n << " count " << count << " block " << i;
      }
    }
  }
}

}  // namespace
}  // namespace morph
