#include "collectives/store/store_protocol.h"

#include <algorithm>

namespace morph::store_wire {
namespace {

// Bytes of a request body after its key list: value length, has_expected, expected length,
// number.
constexpr size_t kRequestTail = 4 + 1 + 4 + 8;

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool U8(uint8_t& v) {
    if (data_.size() < 1) return false;
    v = static_cast<uint8_t>(data_[0]);
    data_.remove_prefix(1);
    return true;
  }
  bool U32(uint32_t& v) {
    if (data_.size() < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(data_[i])} << (8 * i);
    data_.remove_prefix(4);
    return true;
  }
  bool I64(int64_t& v) {
    if (data_.size() < 8) return false;
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u |= uint64_t{static_cast<uint8_t>(data_[i])} << (8 * i);
    v = static_cast<int64_t>(u);
    data_.remove_prefix(8);
    return true;
  }
  // A length-prefixed string; the length is checked against what remains before any copy.
  bool Str(std::string& s) {
    uint32_t n = 0;
    if (!U32(n) || data_.size() < n) return false;
    s.assign(data_.substr(0, n));
    data_.remove_prefix(n);
    return true;
  }
  size_t remaining() const { return data_.size(); }
  bool done() const { return data_.empty(); }

 private:
  std::string_view data_;
};

Status Malformed(std::string_view what, std::string_view body) {
  return InvalidArgumentError("store: malformed " + std::string(what) + " of " +
                              std::to_string(body.size()) + " bytes");
}

}  // namespace

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutStr(std::string& out, std::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

std::string Frame(std::string_view body) {
  std::string out;
  out.reserve(body.size() + 4);
  PutU32(out, static_cast<uint32_t>(body.size()));
  out.append(body);
  return out;
}

std::string EncodeHello(std::string_view token) {
  std::string out;
  PutStr(out, token);
  return out;
}

StatusOr<std::string> DecodeHello(std::string_view body) {
  Reader in(body);
  std::string token;
  if (!in.Str(token) || !in.done()) return Malformed("hello", body);
  return token;
}

std::string EncodeRequest(const KvTable::Request& r, int64_t timeout_ms) {
  std::string out;
  out.push_back(static_cast<char>(r.op));
  PutU64(out, static_cast<uint64_t>(r.generation));
  PutU64(out, static_cast<uint64_t>(timeout_ms));
  PutU32(out, static_cast<uint32_t>(r.keys.size()));
  for (const std::string& k : r.keys) PutStr(out, k);
  PutStr(out, r.value);
  out.push_back(r.expected.has_value() ? 1 : 0);
  PutStr(out, r.expected.value_or(""));
  PutU64(out, static_cast<uint64_t>(r.number));
  return out;
}

StatusOr<WireRequest> DecodeRequest(std::string_view body) {
  Reader in(body);
  WireRequest w;
  KvTable::Request& r = w.request;
  uint8_t op = 0, has_expected = 0;
  uint32_t nkeys = 0;
  if (!in.U8(op)) return Malformed("request", body);
  if (op < 1 || op > static_cast<uint8_t>(KvTable::Op::kAdvance)) {
    return InvalidArgumentError("store: request of unknown operation " + std::to_string(op));
  }
  r.op = static_cast<KvTable::Op>(op);
  if (!in.I64(r.generation) || !in.I64(w.timeout_ms) || !in.U32(nkeys)) {
    return Malformed("request", body);
  }
  w.timeout_ms = std::clamp<int64_t>(w.timeout_ms, 0, kMaxTimeoutMs);
  // Each key takes at least its 4-byte length: a count the body cannot hold is refused before
  // anything is allocated for it.
  const size_t room = in.remaining() < kRequestTail ? 0 : (in.remaining() - kRequestTail) / 4;
  if (nkeys > room) {
    return InvalidArgumentError("store: request announces " + std::to_string(nkeys) +
                                " keys but its remaining " + std::to_string(in.remaining()) +
                                " bytes hold at most " + std::to_string(room));
  }
  r.keys.resize(nkeys);
  for (std::string& k : r.keys) {
    if (!in.Str(k)) return Malformed("request", body);
  }
  std::string expected;
  if (!in.Str(r.value) || !in.U8(has_expected) || !in.Str(expected) || !in.I64(r.number)) {
    return Malformed("request", body);
  }
  if (has_expected > 1) return Malformed("request", body);
  if (!in.done()) {
    return InvalidArgumentError("store: request has " + std::to_string(in.remaining()) +
                                " trailing bytes");
  }
  if (has_expected) r.expected = std::move(expected);
  return w;
}

std::string EncodeResponse(const KvTable::Response& r) {
  std::string out;
  out.push_back(static_cast<char>(r.status.code()));
  PutStr(out, r.status.message());
  PutStr(out, r.value);
  PutU64(out, static_cast<uint64_t>(r.number));
  return out;
}

StatusOr<KvTable::Response> DecodeResponse(std::string_view body) {
  Reader in(body);
  KvTable::Response r;
  uint8_t code = 0;
  std::string message;
  if (!in.U8(code) || code > static_cast<uint8_t>(StatusCode::kUnauthenticated)) {
    return Malformed("response", body);
  }
  if (!in.Str(message) || !in.Str(r.value) || !in.I64(r.number) || !in.done()) {
    return Malformed("response", body);
  }
  r.status = Status(static_cast<StatusCode>(code), message);
  return r;
}

bool TokensEqual(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

std::span<char> FrameReader::Prepare(size_t chunk) {
  if (has_frame() || chunk == 0) return {};
  if (header_filled_ < 4) {
    return std::span<char>(header_ + header_filled_, std::min(chunk, 4 - header_filled_));
  }
  size_t want = std::min<size_t>(chunk, announced_ - body_filled_);
  if (body_.size() < body_filled_ + want) body_.resize(body_filled_ + want);
  return std::span<char>(body_.data() + body_filled_, want);
}

Status FrameReader::Commit(size_t n) {
  if (header_filled_ < 4) {
    header_filled_ += n;
    if (header_filled_ < 4) return Status::Ok();
    announced_ = 0;
    for (int i = 0; i < 4; ++i) {
      announced_ |= uint32_t{static_cast<uint8_t>(header_[i])} << (8 * i);
    }
    if (announced_ > max_body_) {
      return InvalidArgumentError("store: frame of " + std::to_string(announced_) +
                                  " bytes exceeds the limit of " + std::to_string(max_body_));
    }
    body_filled_ = 0;
    return Status::Ok();
  }
  body_filled_ += n;
  return Status::Ok();
}

void FrameReader::Pop() {
  header_filled_ = 0;
  announced_ = 0;
  body_filled_ = 0;
  // Keep a small buffer for the next request; give a large one back.
  if (body_.capacity() > (64u << 10)) {
    std::string().swap(body_);
  } else {
    body_.clear();
  }
}

}  // namespace morph::store_wire
