#include "reshard/crc32c.h"

#include <array>
#include <cstring>

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

}  // namespace morph
