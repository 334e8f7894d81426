// The TCP store's wire format, encode/decode only: no sockets, no clock, so that unit tests
// and the fuzz target (collectives/store/fuzz/) drive exactly what the server runs.
//
// Frames are u32 little-endian length + body. A client's first frame is its token (the hello);
// then one request at a time, each answered by one response.
//
//   store_wire::FrameReader reader(store_wire::kMaxHelloBytes);
//   std::span<char> space = reader.Prepare(64 << 10);   // read into it, then
//   MORPH_RETURN_IF_ERROR(reader.Commit(n));
//   if (reader.has_frame()) { auto req = store_wire::DecodeRequest(reader.frame()); ... }
//
// Every decoder bounds every count by the bytes that remain, so a body of n bytes never makes
// it allocate more than about n bytes. All functions are pure and thread-safe.
#ifndef MORPH_COLLECTIVES_STORE_PROTOCOL_H_
#define MORPH_COLLECTIVES_STORE_PROTOCOL_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "morph/status.h"
#include "collectives/store/store.h"

namespace morph::store_wire {

// The largest hello body a server reads before authentication (a token of up to ~4 KiB).
constexpr uint32_t kMaxHelloBytes = 4096;
// Timeouts that requests carry are clamped to [0, kMaxTimeoutMs] (365 days, what a client with
// an infinite deadline sends), so that the server's timer arithmetic cannot overflow.
constexpr int64_t kMaxTimeoutMs = int64_t{365} * 24 * 3600 * 1000;

void PutU32(std::string& out, uint32_t v);
void PutU64(std::string& out, uint64_t v);
void PutStr(std::string& out, std::string_view s);

// u32 length + body.
std::string Frame(std::string_view body);

std::string EncodeHello(std::string_view token);
// The token. kInvalidArgument describing the defect for a malformed hello.
StatusOr<std::string> DecodeHello(std::string_view body);

struct WireRequest {
  KvTable::Request request;
  int64_t timeout_ms = 0;  // clamped to [0, kMaxTimeoutMs]
};
std::string EncodeRequest(const KvTable::Request& r, int64_t timeout_ms);
// kInvalidArgument naming the defect (unknown op, a count larger than the body can hold,
// truncated or trailing bytes).
StatusOr<WireRequest> DecodeRequest(std::string_view body);

std::string EncodeResponse(const KvTable::Response& r);
// kInvalidArgument naming the defect.
StatusOr<KvTable::Response> DecodeResponse(std::string_view body);

// Constant time in the content, so the token cannot be guessed byte by byte.
bool TokensEqual(std::string_view a, std::string_view b);

// Assembles frames from bytes as they arrive. The body buffer grows with the bytes received,
// never from what a header announces, and is released when a large frame has been consumed.
// Not thread-safe (one per connection).
class FrameReader {
 public:
  explicit FrameReader(uint32_t max_body) : max_body_(max_body) {}

  // Bodies announced above this are refused by Commit (e.g. after authentication).
  void set_max_body(uint32_t max_body) { max_body_ = max_body; }
  uint32_t max_body() const { return max_body_; }

  // Where the next bytes go: at most `chunk` bytes, never past the end of the current frame.
  // Empty while a complete frame waits to be consumed.
  std::span<char> Prepare(size_t chunk);
  // `n` bytes were written at the start of the span Prepare returned. kInvalidArgument naming
  // both sizes when a header announces a body above max_body; the reader is then unusable.
  Status Commit(size_t n);

  bool has_frame() const { return header_filled_ == 4 && body_filled_ == announced_; }
  // The complete frame's body (valid until Pop).
  std::string_view frame() const { return std::string_view(body_.data(), announced_); }
  // Consumes the complete frame.
  void Pop();
  // Bytes of memory this reader holds.
  size_t held() const { return body_.capacity(); }
  // Whether a frame has begun arriving (a header byte or more).
  bool mid_frame() const { return header_filled_ > 0; }

 private:
  uint32_t max_body_;
  char header_[4] = {};
  size_t header_filled_ = 0;
  uint32_t announced_ = 0;
  std::string body_;
  size_t body_filled_ = 0;
};

}  // namespace morph::store_wire

#endif  // MORPH_COLLECTIVES_STORE_PROTOCOL_H_
