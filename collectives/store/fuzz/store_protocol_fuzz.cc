// libFuzzer target for the TCP store's wire format (collectives/store/store_protocol.h): everything a
// client can send the server before and after authentication. Checks, beyond "no crash, no
// sanitizer report": a decoded request re-encodes to an equivalent one; FrameReader holds no
// more memory than about twice the bytes it was fed plus a read chunk.
//
//   make fuzz                       # FUZZ_SECONDS=600 by default
//   ctest -R store_fuzz             # 60 s, from collectives/store/fuzz/corpus/
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "collectives/store/store_protocol.h"

namespace {

using namespace morph::store_wire;

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "store_protocol_fuzz: invariant broken: %s\n", what);
    std::abort();
  }
}

void CheckRequest(std::string_view body) {
  morph::StatusOr<WireRequest> w = DecodeRequest(body);
  if (!w.ok()) {
    Require(w.status().code() == morph::StatusCode::kInvalidArgument, "request error code");
    return;
  }
  Require(w->timeout_ms >= 0 && w->timeout_ms <= kMaxTimeoutMs, "timeout clamped");
  Require(w->request.keys.size() <= body.size() / 4, "key count bounded by the body");
  morph::StatusOr<WireRequest> again = DecodeRequest(EncodeRequest(w->request, w->timeout_ms));
  Require(again.ok(), "re-encoded request decodes");
  Require(again->request.op == w->request.op && again->request.keys == w->request.keys &&
              again->request.value == w->request.value &&
              again->request.expected == w->request.expected &&
              again->request.number == w->request.number &&
              again->request.generation == w->request.generation &&
              again->timeout_ms == w->timeout_ms,
          "request round trip");
}

// Feeds `data` to a reader in chunks whose sizes come from the data itself, decoding every
// frame as the server would (hello first, then requests).
void CheckFrames(std::string_view data) {
  if (data.empty()) return;
  const size_t chunk = 1 + static_cast<uint8_t>(data[0]) * 64;
  data.remove_prefix(1);
  FrameReader reader(kMaxHelloBytes);
  bool authenticated = false;
  size_t fed = 0;
  while (!data.empty()) {
    std::span<char> space = reader.Prepare(chunk);
    if (space.empty()) break;
    size_t n = std::min(space.size(), data.size());
    std::memcpy(space.data(), data.data(), n);
    data.remove_prefix(n);
    fed += n;
    if (!reader.Commit(n).ok()) return;
    // A string grows by doubling, and Pop keeps a buffer of up to 64 KiB for the next frame.
    Require(reader.held() <= 2 * (fed + chunk) + (64u << 10),
            "reader memory bounded by the bytes fed");
    if (reader.has_frame()) {
      if (!authenticated) {
        (void)DecodeHello(reader.frame());
        authenticated = true;
        reader.set_max_body(1u << 20);
      } else {
        CheckRequest(reader.frame());
      }
      reader.Pop();
      fed = 0;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  std::string_view data(reinterpret_cast<const char*>(bytes), size);
  CheckRequest(data);
  (void)DecodeHello(data);
  morph::StatusOr<morph::KvTable::Response> r = DecodeResponse(data);
  if (r.ok()) {
    morph::StatusOr<morph::KvTable::Response> again = DecodeResponse(EncodeResponse(*r));
    Require(again.ok() && again->value == r->value && again->number == r->number &&
                again->status.code() == r->status.code(),
            "response round trip");
  }
  CheckFrames(data);
  return 0;
}
