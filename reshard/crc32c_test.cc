#include "reshard/crc32c.h"

#include <gtest/gtest.h>

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

// Independent blocks: any count (groups of three and a rest), any length, unaligned and
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
      std::vector<uint32_t> got(count, 0xdeadbeef);
      Crc32cEach(blocks.data(), n, count, got.data());
      for (size_t i = 0; i < count; ++i) {
        EXPECT_EQ(got[i], Reference(b.data() + offsets[i], n))
            << "n " << n << " count " << count << " block " << i;
      }
    }
  }
}

}  // namespace
}  // namespace morph
