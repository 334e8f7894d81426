// CRC32C (Castagnoli), as used by the checkpoint format to detect corrupted blocks. Uses the
// SSE4.2 crc32 instruction when the CPU has it, a table otherwise; both give the same values.
//
//   uint32_t c = Crc32c(data, n);                  // one shot
//   uint32_t c2 = Crc32cExtend(Crc32c(a, n), b, m); // == Crc32c of a followed by b
//   Crc32cEach(blocks, 4096, count, crcs);          // crcs[i] = Crc32c(blocks[i], 4096)
#ifndef MORPH_RESHARD_CRC32C_H_
#define MORPH_RESHARD_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace morph {

// Continues `crc` (the CRC of earlier bytes; 0 for none) over `n` more bytes. Thread-safe.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

// out[i] = Crc32c(blocks[i], n) for i in [0, count): `count` independent buffers of `n` bytes
// each (checksum blocks of a file), CRCed three at a time in interleaved chains, so short blocks
// (where one buffer cannot be cut into lanes) still keep the crc32 unit busy. Thread-safe.
void Crc32cEach(const void* const* blocks, size_t n, size_t count, uint32_t* out);
// Same, and copies each block's bytes to where they go in the same pass (each byte is read
// once): a checkpoint load verifies and places a block for the price of the copy alone. A
// block's bytes go, in order, to its segments (a block that spans rows of the destination has
// one segment per row); segment lengths add up to the block's `n` bytes. Blocks and
// destinations must not overlap.
struct CopySegment {
  void* dst;
  size_t bytes;
};
struct ScatteredBlock {
  const void* data;
  const CopySegment* segments;
  size_t num_segments;
};
void Crc32cEachAndCopy(const ScatteredBlock* blocks, size_t n, size_t count, uint32_t* out);

}  // namespace morph

#endif  // MORPH_RESHARD_CRC32C_H_
