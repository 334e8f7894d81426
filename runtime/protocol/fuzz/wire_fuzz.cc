// libFuzzer target for the control channel's wire format (runtime/protocol/wire.h): every frame
// a peer can send the coordinator or a worker. Checks, beyond "no crash, no sanitizer report":
//   - a frame DecodeFrame accepts re-encodes to exactly the same bytes (the format has one
//     encoding per message: shortest varints, booleans 0/1, no trailing bytes);
//   - an accepted header names a known type, this version, and a length within its limit
//     (kMaxHelloBody for Hello), and any error is kInvalidArgument or, for another version,
//     kFailedPrecondition;
//   - the same for a body decoded directly as the type its first byte selects (so the corpus
//     reaches every decoder without building headers);
//   - decoding allocates O(input): scripts/fuzz.sh runs this with -malloc_limit_mb.
//
//   make fuzz                           # every target, FUZZ_SECONDS each
//   ctest -R wire_fuzz                  # 60 s, from runtime/protocol/fuzz/corpus/
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <variant>

#include "runtime/protocol/wire.h"

namespace {

using namespace morph;

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "wire_fuzz: invariant broken: %s\n", what);
    std::abort();
  }
}

void CheckError(const Status& s) {
  Require(s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kFailedPrecondition,
          "decode error code");
  Require(!s.message().empty(), "decode error names what is wrong");
}

void CheckFrame(std::string_view frame) {
  StatusOr<FrameHeader> h = DecodeHeader(frame);
  if (!h.ok()) {
    CheckError(h.status());
  } else {
    Require(h->version == kWireVersion, "header version");
    Require(h->type >= 1 && h->type <= std::variant_size_v<WireMessage>, "header type");
    Require(h->length <= (h->type == static_cast<uint16_t>(WireType::kHello) ? kMaxHelloBody
                                                                             : kMaxFrameBody),
            "header length within its limit");
  }
  StatusOr<WireMessage> m = DecodeFrame(frame);
  if (!m.ok()) {
    CheckError(m.status());
    return;
  }
  Require(h.ok(), "a decoded frame has a valid header");
  Require(static_cast<uint16_t>(m->index() + 1) == h->type, "decoded type is the header's");
  Require(EncodeFrame(*m) == frame, "frame round trip: re-encodes to the same bytes");
}

void CheckBody(uint16_t type, std::string_view body) {
  FrameHeader h{
      .version = kWireVersion, .type = type, .length = static_cast<uint32_t>(body.size())};
  StatusOr<WireMessage> m = DecodeBody(h, body);
  if (!m.ok()) {
    CheckError(m.status());
    return;
  }
  Require(static_cast<uint16_t>(m->index() + 1) == type, "decoded type is the asked one");
  std::string again = EncodeFrame(*m);
  Require(std::string_view(again).substr(kFrameHeaderBytes) == body,
          "body round trip: re-encodes to the same bytes");
  StatusOr<WireMessage> twice = DecodeFrame(again);
  Require(twice.ok() && *twice == *m, "a re-encoded frame decodes to the same message");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  std::string_view data(reinterpret_cast<const char*>(bytes), size);
  CheckFrame(data);
  if (!data.empty()) {
    constexpr uint16_t kTypes = std::variant_size_v<WireMessage>;
    CheckBody(static_cast<uint16_t>(static_cast<uint8_t>(data[0]) % kTypes + 1), data.substr(1));
  }
  return 0;
}
