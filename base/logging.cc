#include "base/logging.h"

#include <mutex>

namespace morph {
namespace {
constexpr uint64_t kGenBits = 24, kRankBits = 20, kWorldBits = 20;
constexpr uint64_t kGenMask = (1ull << kGenBits) - 1;
constexpr uint64_t kRankMask = (1ull << kRankBits) - 1;
constexpr uint64_t kWorldMask = (1ull << kWorldBits) - 1;
}  // namespace

uint64_t LogContext::Pack(int64_t g, int r, int w) {
  // All-ones in a field means unknown.
  uint64_t gg = (g < 0 || static_cast<uint64_t>(g) >= kGenMask) ? kGenMask : uint64_t(g);
  uint64_t rr = (r < 0 || static_cast<uint64_t>(r) >= kRankMask) ? kRankMask : uint64_t(r);
  uint64_t ww = (w < 0 || static_cast<uint64_t>(w) >= kWorldMask) ? kWorldMask : uint64_t(w);
  return gg | (rr << kGenBits) | (ww << (kGenBits + kRankBits));
}

LogContext::Fields LogContext::Unpack(uint64_t v) {
  uint64_t gg = v & kGenMask, rr = (v >> kGenBits) & kRankMask,
           ww = (v >> (kGenBits + kRankBits)) & kWorldMask;
  return {gg == kGenMask ? -1 : int64_t(gg), rr == kRankMask ? -1 : int(rr),
          ww == kWorldMask ? -1 : int(ww)};
}

std::string LogContext::Prefix() const {
  Fields f = Unpack(packed_.load(std::memory_order_relaxed));
  std::string s = "[g";
  s += f.g < 0 ? "-" : std::to_string(f.g);
  s += " r";
  s += f.r < 0 ? "-" : std::to_string(f.r);
  s += "/";
  s += f.w < 0 ? "-" : std::to_string(f.w);
  s += " ";
  s += component_;
  s += "] ";
  return s;
}

std::ostream& operator<<(std::ostream& os, const LogContext& ctx) { return os << ctx.Prefix(); }

void InitLogging(const char* argv0) {
  static std::once_flag once;
  std::call_once(once, [argv0] {
    if (std::getenv("GLOG_logtostderr") == nullptr) FLAGS_logtostderr = true;
    google::InitGoogleLogging(argv0);
  });
}

}  // namespace morph
