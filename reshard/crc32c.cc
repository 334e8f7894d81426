#include "reshard/crc32c.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace morph {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

uint32_t Software(uint32_t c, const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Hardware(uint32_t c, const unsigned char* p, size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = __builtin_ia32_crc32di(c64, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n > 0) {
    c32 = __builtin_ia32_crc32qi(c32, *p++);
    --n;
  }
  return c32;
}
// Three lanes: the crc32 instruction takes 3 cycles but starts one per cycle, so one chain
// uses a third of it. Blocks of 3 x kLane bytes are cut into three lanes CRCed interleaved;
// the register update is linear over GF(2) (no inversion inside), so
// crc(c, A|B|C) = Z(Z(crc(c, A)) ^ crc(0, B)) ^ crc(0, C), Z = appending kLane zero bytes,
// applied through four 256-entry tables (one per byte of the register).
constexpr size_t kLane = 4096;

struct ZeroShift {
  uint32_t t[4][256];
};

__attribute__((target("sse4.2"))) const ZeroShift& Zeros() {
  static const ZeroShift z = [] {
    ZeroShift s{};
    static const unsigned char zeros[kLane] = {};
    for (int k = 0; k < 4; ++k) {
      for (uint32_t v = 0; v < 256; ++v) s.t[k][v] = Hardware(v << (8 * k), zeros, kLane);
    }
    return s;
  }();
  return z;
}

inline uint32_t ShiftByLane(const ZeroShift& z, uint32_t c) {
  return z.t[0][c & 0xff] ^ z.t[1][(c >> 8) & 0xff] ^ z.t[2][(c >> 16) & 0xff] ^ z.t[3][c >> 24];
}

__attribute__((target("sse4.2"))) uint32_t Hardware3(uint32_t c, const unsigned char* p,
                                                     size_t n) {
  if (n < 3 * kLane) return Hardware(c, p, n);
  const ZeroShift& z = Zeros();
  while (n >= 3 * kLane) {
    uint64_t a = c, b = 0, d = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t va, vb, vd;
      std::memcpy(&va, p + i, 8);
      std::memcpy(&vb, p + kLane + i, 8);
      std::memcpy(&vd, p + 2 * kLane + i, 8);
      a = __builtin_ia32_crc32di(a, va);
      b = __builtin_ia32_crc32di(b, vb);
      d = __builtin_ia32_crc32di(d, vd);
    }
    c = ShiftByLane(z, ShiftByLane(z, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
        static_cast<uint32_t>(d);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  return Hardware(c, p, n);
}

// Three independent CRCs (initial state ~0 each) of n bytes at a, b and d, interleaved.
__attribute__((target("sse4.2"))) void Hardware3Buffers(const unsigned char* a,
                                                        const unsigned char* b,
                                                        const unsigned char* d, size_t n,
                                                        uint32_t* out) {
  uint64_t ca = ~0u, cb = ~0u, cd = ~0u;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t va, vb, vd;
    std::memcpy(&va, a + i, 8);
    std::memcpy(&vb, b + i, 8);
    std::memcpy(&vd, d + i, 8);
    ca = __builtin_ia32_crc32di(ca, va);
    cb = __builtin_ia32_crc32di(cb, vb);
    cd = __builtin_ia32_crc32di(cd, vd);
  }
  const size_t left = n - i;
  out[0] = ~Hardware(static_cast<uint32_t>(ca), a + i, left);
  out[1] = ~Hardware(static_cast<uint32_t>(cb), b + i, left);
  out[2] = ~Hardware(static_cast<uint32_t>(cd), d + i, left);
}

// One block being CRCed and copied: where it is read, and the segment being written.
struct ScatterChain {
  const unsigned char* src;
  uint64_t crc;
  const CopySegment* seg;
  unsigned char* dst;  // in *seg
  size_t seg_left;     // bytes of *seg still to write
  size_t left;         // bytes of the block still to read

  void Start(const ScatteredBlock& b, size_t n) {
    src = static_cast<const unsigned char*>(b.data);
    crc = ~0u;
    seg = b.segments;
    left = n;
    Enter();
  }
  void Enter() {  // skips empty segments
    while (left > 0 && seg->bytes == 0) ++seg;
    if (left > 0) {
      dst = static_cast<unsigned char*>(seg->dst);
      seg_left = seg->bytes;
    } else {
      seg_left = 0;
    }
  }
  void Advance(size_t k) {
    src += k;
    dst += k;
    seg_left -= k;
    left -= k;
    if (seg_left == 0 && left > 0) {
      ++seg;
      Enter();
    }
  }
};

// CRC and copy of up to 15 bytes of one chain (the rest of its segment, or of a short one).
__attribute__((target("sse4.2"))) void ScatterTail(ScatterChain& c, size_t k) {
  std::memcpy(c.dst, c.src, k);
  c.crc = Hardware(static_cast<uint32_t>(c.crc), c.src, k);
  c.Advance(k);
}

// Three ScatterChains in step: 16-byte loads, the crc32 of both halves, 16-byte stores, for as
// long as every chain's segment lasts; a chain whose segment has fewer than 16 bytes left does
// them alone. Ends when all three blocks are read.
__attribute__((target("sse4.2"))) void Hardware3Scatter(ScatterChain* c) {
  while (c[0].left > 0 || c[1].left > 0 || c[2].left > 0) {
    size_t run = SIZE_MAX;
    bool stepped = false;
    for (int j = 0; j < 3; ++j) {
      if (c[j].left == 0) continue;
      if (c[j].seg_left < 16) {
        ScatterTail(c[j], c[j].seg_left);
        stepped = true;
      } else {
        run = std::min(run, c[j].seg_left);
      }
    }
    if (stepped) continue;
    if (c[0].left == 0 || c[1].left == 0 || c[2].left == 0) {  // blocks of unequal length
      for (int j = 0; j < 3; ++j) {
        if (c[j].left > 0) ScatterTail(c[j], std::min<size_t>(c[j].seg_left, 8));
      }
      continue;
    }
    run &= ~size_t{15};
    uint64_t ca = c[0].crc, cb = c[1].crc, cd = c[2].crc;
    const unsigned char *a = c[0].src, *b = c[1].src, *d = c[2].src;
    unsigned char *oa = c[0].dst, *ob = c[1].dst, *od = c[2].dst;
    for (size_t i = 0; i < run; i += 16) {
      const __m128i xa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i));
      const __m128i xb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i));
      const __m128i xd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i));
      ca = __builtin_ia32_crc32di(ca, static_cast<uint64_t>(_mm_cvtsi128_si64(xa)));
      cb = __builtin_ia32_crc32di(cb, static_cast<uint64_t>(_mm_cvtsi128_si64(xb)));
      cd = __builtin_ia32_crc32di(cd, static_cast<uint64_t>(_mm_cvtsi128_si64(xd)));
      ca = __builtin_ia32_crc32di(ca, static_cast<uint64_t>(_mm_extract_epi64(xa, 1)));
      cb = __builtin_ia32_crc32di(cb, static_cast<uint64_t>(_mm_extract_epi64(xb, 1)));
      cd = __builtin_ia32_crc32di(cd, static_cast<uint64_t>(_mm_extract_epi64(xd, 1)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(oa + i), xa);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + i), xb);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(od + i), xd);
    }
    c[0].crc = ca, c[1].crc = cb, c[2].crc = cd;
    for (int j = 0; j < 3; ++j) c[j].Advance(run);
  }
}

bool HasHardware() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (HasHardware()) return ~Hardware3(c, p, n);
#endif
  return ~Software(c, p, n);
}

void Crc32cEach(const void* const* blocks, size_t n, size_t count, uint32_t* out) {
  size_t i = 0;
#if defined(__x86_64__)
  if (HasHardware()) {
    for (; i + 3 <= count; i += 3) {
      Hardware3Buffers(static_cast<const unsigned char*>(blocks[i]),
                       static_cast<const unsigned char*>(blocks[i + 1]),
                       static_cast<const unsigned char*>(blocks[i + 2]), n, out + i);
    }
  }
#endif
  for (; i < count; ++i) out[i] = Crc32c(blocks[i], n);
}

void Crc32cEachAndCopy(const ScatteredBlock* blocks, size_t n, size_t count, uint32_t* out) {
  size_t i = 0;
#if defined(__x86_64__)
  if (HasHardware()) {
    for (; i + 3 <= count; i += 3) {
      ScatterChain c[3];
      for (int j = 0; j < 3; ++j) c[j].Start(blocks[i + static_cast<size_t>(j)], n);
      Hardware3Scatter(c);
      for (int j = 0; j < 3; ++j) out[i + static_cast<size_t>(j)] = ~static_cast<uint32_t>(c[j].crc);
    }
  }
#endif
  for (; i < count; ++i) {
    out[i] = Crc32c(blocks[i].data, n);
    const char* src = static_cast<const char*>(blocks[i].data);
    for (size_t k = 0; k < blocks[i].num_segments; ++k) {
      const CopySegment& seg = blocks[i].segments[k];
      if (seg.bytes > 0) std::memcpy(seg.dst, src, seg.bytes);
      src += seg.bytes;
    }
  }
}

}  // namespace morph
