#include "runtime/protocol/wire.h"

#include <cstring>
#include <type_traits>
#include <utility>

#include "runtime/protocol/fields.h"

namespace morph {
namespace {

// An id list item meaning "a run follows" (zigzag of +1: a single id one above the previous is
// always written as a run).
constexpr uint64_t kRunItem = 2;

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  // Each id as the zigzag LEB128 varint of its difference from the previous one (wrapping):
  // worker ids are small and mostly ascending, so a 4,096-rank list takes ~1 byte per id.
  // Items: varint(zigzag(id - previous)), except that a difference of +1 (zigzag 2) means a run:
  // varint(k >= 1) follows, and the k ids from the previous + 1 ascend by one (wire.h).
  void Ids(const std::vector<int64_t>& v) {
    U32(static_cast<uint32_t>(v.size()));
    uint64_t prev = 0;
    for (size_t i = 0; i < v.size();) {
      const uint64_t x = static_cast<uint64_t>(v[i]);
      if (x == prev + 1) {
        uint64_t k = 1;
        while (i + k < v.size() && static_cast<uint64_t>(v[i + k]) == x + k) ++k;
        Varint(kRunItem);
        Varint(k);
        prev = x + k - 1;
        i += k;
        continue;
      }
      const int64_t d = static_cast<int64_t>(x - prev);
      Varint((static_cast<uint64_t>(d) << 1) ^ static_cast<uint64_t>(d >> 63));
      prev = x;
      ++i;
    }
  }
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  std::string& out() { return out_; }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class Reader {
 public:
  Reader(std::string_view in, std::string_view what) : in_(in), what_(what) {}

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  void Fail(std::string_view field, std::string_view why) {
    if (status_.ok()) {
      status_ = InvalidArgumentError(std::string(what_) + "." + std::string(field) + ": " +
                                     std::string(why));
    }
  }
  uint64_t Le(int n, std::string_view field) {
    if (!ok()) return 0;
    if (in_.size() - pos_ < static_cast<size_t>(n)) {
      Fail(field, "truncated");
      return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in_[pos_ + i])} << (8 * i);
    pos_ += n;
    return v;
  }
  uint8_t U8(std::string_view f) { return static_cast<uint8_t>(Le(1, f)); }
  uint32_t U32(std::string_view f) { return static_cast<uint32_t>(Le(4, f)); }
  uint64_t U64(std::string_view f) { return Le(8, f); }
  int32_t I32(std::string_view f) { return static_cast<int32_t>(U32(f)); }
  int64_t I64(std::string_view f) { return static_cast<int64_t>(U64(f)); }
  // A count of items of `item_bytes` each: never more than the bytes left can hold.
  uint32_t Count(std::string_view field, size_t item_bytes) {
    uint32_t n = U32(field);
    if (ok() && static_cast<uint64_t>(n) * item_bytes > in_.size() - pos_) {
      Fail(field, "count " + std::to_string(n) + " exceeds the " +
                      std::to_string(in_.size() - pos_) + " bytes left");
      return 0;
    }
    return ok() ? n : 0;
  }
  std::string Str(std::string_view field) {
    uint32_t n = Count(field, 1);
    if (!ok()) return {};
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  std::vector<int64_t> Ids(std::string_view field) {
    const uint32_t n = U32(field);
    if (!ok()) return {};
    if (n > kMaxIdList) {
      Fail(field, "count " + std::to_string(n) + " exceeds the limit of " +
                      std::to_string(kMaxIdList) + " ids");
      return {};
    }
    if (n > ids_left_) {
      Fail(field, "count " + std::to_string(n) + " takes the frame past " +
                      std::to_string(kMaxIdsPerFrame) + " ids in all");
      return {};
    }
    ids_left_ -= n;
    std::vector<int64_t> v;
    v.reserve(n);
    uint64_t prev = 0;
    bool after_run = false;
    while (v.size() < n && ok()) {
      const uint64_t z = Varint(field);
      if (!ok()) break;
      if (z == kRunItem) {
        // Two runs in a row are one run (not the shortest form).
        if (after_run) {
          Fail(field, "a run right after a run");
          break;
        }
        const uint64_t k = Varint(field);
        if (!ok()) break;
        if (k == 0 || k > n - v.size()) {
          Fail(field, "a run of " + std::to_string(k) + " ids with " +
                          std::to_string(n - v.size()) + " of the count left");
          break;
        }
        for (uint64_t j = 0; j < k; ++j) v.push_back(static_cast<int64_t>(++prev));
        after_run = true;
        continue;
      }
      prev += static_cast<uint64_t>(static_cast<int64_t>(z >> 1) ^ -static_cast<int64_t>(z & 1));
      v.push_back(static_cast<int64_t>(prev));
      after_run = false;
    }
    if (!ok()) return {};
    return v;
  }
  // Only the shortest encoding is accepted (so every accepted frame re-encodes to itself).
  uint64_t Varint(std::string_view field) {
    uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      if (!ok()) return 0;
      if (pos_ == in_.size()) {
        Fail(field, "truncated");
        return 0;
      }
      uint8_t b = static_cast<uint8_t>(in_[pos_++]);
      if (i == 9 && b > 1) {
        Fail(field, "varint overflows 64 bits");
        return 0;
      }
      v |= uint64_t{b & 0x7fu} << (7 * i);
      if (!(b & 0x80)) {
        if (b == 0 && i > 0) Fail(field, "varint not in its shortest form");
        return v;
      }
    }
    Fail(field, "varint longer than 10 bytes");
    return 0;
  }
  void End() {
    if (ok() && pos_ != in_.size()) {
      Fail("end", std::to_string(in_.size() - pos_) + " trailing bytes");
    }
  }

 private:
  uint32_t ids_left_ = kMaxIdsPerFrame;  // ids the frame's lists may still hold
  std::string_view in_;
  std::string_view what_;
  size_t pos_ = 0;
  Status status_;
};

template <typename T>
struct IsVector : std::false_type {};
template <typename E>
struct IsVector<std::vector<E>> : std::true_type {};

// A layout as the builder calls that reproduce it: layer, tp dim, ZeRO, extra layers, tp
// blocks, padding, ZeRO group, and the torch.chunk flags (bit 0 ChunkTP, bit 1 ChunkDP).
constexpr uint8_t kChunkTPBit = 1, kChunkDPBit = 2;
void PutLayout(Writer& w, const Layout& l) {
  w.I32(l.layer());
  w.I32(l.tp_dim());
  w.U8(l.zero_sharded() ? 1 : 0);
  w.U32(static_cast<uint32_t>(l.extra_layers().size()));
  for (int x : l.extra_layers()) w.I32(x);
  w.I32(l.tp_blocks());
  w.I32(l.pad_multiple());
  w.I32(l.zero_group());
  w.U8((l.tp_chunked() ? kChunkTPBit : 0) | (l.dp_chunked() ? kChunkDPBit : 0));
}
constexpr size_t kMinLayoutBytes = 4 + 4 + 1 + 4 + 4 + 4 + 4 + 1;

uint8_t GetBool(Reader& r, const std::string& field) {
  uint8_t b = r.U8(field);
  if (r.ok() && b > 1) r.Fail(field, "not a boolean");
  return b;
}
std::vector<int> GetInts(Reader& r, const std::string& field) {
  uint32_t n = r.Count(field, 4);
  std::vector<int> v;
  v.reserve(n);
  for (uint32_t i = 0; i < n && r.ok(); ++i) v.push_back(r.I32(field));
  return v;
}
// Only the encoding is checked here; what the values mean is ValidateManifest's, on the
// coordinator.
Layout GetLayout(Reader& r, const std::string& f) {
  const int layer = r.I32(f + ".layer");
  const int tp_dim = r.I32(f + ".tp_dim");
  const uint8_t zero = GetBool(r, f + ".zero");
  const std::vector<int> extra = GetInts(r, f + ".extra_layers");
  const int blocks = r.I32(f + ".tp_blocks");
  const int pad = r.I32(f + ".pad_multiple");
  const int group = r.I32(f + ".zero_group");
  const uint8_t chunks = r.U8(f + ".chunks");
  if (r.ok() && (chunks & ~(kChunkTPBit | kChunkDPBit)) != 0) r.Fail(f + ".chunks", "unknown bits");
  // The builders in the order that reproduces every field (SplitTPBlocks sets tp_dim too;
  // ZeroShard(group) sets zero).
  Layout l = Layout::Layer(layer);
  for (int x : extra) l = l.AlsoOnLayer(x);
  l = blocks != 1 ? l.SplitTPBlocks(tp_dim, blocks) : l.SplitTP(tp_dim);
  if (pad != 0) l = l.PadToMultiple(pad);
  if (chunks & kChunkTPBit) l = l.ChunkTP(tp_dim);
  if (zero == 1) {
    l = group != 0 ? l.ZeroShard(group) : l.ZeroShard(true);
    if (chunks & kChunkDPBit) l = l.ChunkDP(group);
  } else if (r.ok() && group != 0) {
    r.Fail(f + ".zero_group", "set without ZeRO");
  } else if (r.ok() && (chunks & kChunkDPBit)) {
    r.Fail(f + ".chunks", "ChunkDP set without DP sharding");
  }
  return l;
}

// Encodes every field in its field list's order (fields.h).
struct Encoder {
  Writer& w;
  template <typename T>
  void operator()(std::string_view, const T& x) {
    if constexpr (std::is_same_v<T, bool>) {
      w.U8(x ? 1 : 0);
    } else if constexpr (std::is_same_v<T, int32_t>) {
      w.I32(x);
    } else if constexpr (std::is_same_v<T, int64_t>) {
      w.I64(x);
    } else if constexpr (std::is_same_v<T, uint64_t>) {
      w.U64(x);
    } else if constexpr (std::is_same_v<T, std::string>) {
      w.Str(x);
    } else if constexpr (std::is_same_v<T, DType> || std::is_same_v<T, RecoverySource>) {
      w.U8(static_cast<uint8_t>(x));
    } else if constexpr (std::is_same_v<T, Layout>) {
      PutLayout(w, x);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      w.Ids(x);
    } else if constexpr (IsVector<T>::value) {
      w.U32(static_cast<uint32_t>(x.size()));
      for (const auto& e : x) (*this)("", e);
    } else {
      fields::Fields(*this, x);
    }
  }
};

// The fewest bytes a value of T encodes to (its lists empty): a bound on the count of a list of
// them that the bytes left can hold.
struct MinBytes {
  size_t n = 0;
  template <typename T>
  void operator()(std::string_view, const T& x) {
    if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, DType> ||
                  std::is_same_v<T, RecoverySource>) {
      n += 1;
    } else if constexpr (std::is_same_v<T, int32_t>) {
      n += 4;
    } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
      n += 8;
    } else if constexpr (std::is_same_v<T, std::string> || IsVector<T>::value) {
      n += 4;
    } else if constexpr (std::is_same_v<T, Layout>) {
      n += kMinLayoutBytes;
    } else {
      fields::Fields(*this, x);
    }
  }
};
template <typename T>
size_t MinWireBytes() {
  MinBytes m;
  m("", T{});
  return m.n;
}

// What a decoded struct's fields must agree on, beyond each field's encoding. `f` is the
// struct's path ("" for a message, else "next." and so on).
template <typename T>
void Check(Reader&, const std::string&, const T&) {}
void Check(Reader& r, const std::string& f, const ParallelConfig& c) {
  Status s = c.Validate();
  if (!s.ok()) r.Fail(f.substr(0, f.size() - 1), s.message());
}
void Check(Reader& r, const std::string& f, const Generation& g) {
  // Generation 0 (none yet: a change from nothing) has no ranks.
  if (!(g.id == 0 && g.ranks.empty()) &&
      static_cast<int64_t>(g.ranks.size()) != g.config.world()) {
    r.Fail(f + "ranks", std::to_string(g.ranks.size()) + " ranks for a world of " +
                            std::to_string(g.config.world()));
  }
}
void Check(Reader& r, const std::string&, const WelcomeMsg& m) {
  if (m.current.id != m.generation) {
    r.Fail("current", "generation " + std::to_string(m.current.id) + " is not generation " +
                          std::to_string(m.generation));
  }
}
void Check(Reader& r, const std::string&, const ErrorMsg& m) {
  if (m.code <= 0 || m.code > static_cast<int32_t>(StatusCode::kUnauthenticated)) {
    r.Fail("code", "not a status code: " + std::to_string(m.code));
  }
}
template <typename M>
requires std::is_same_v<M, PrepareMsg> || std::is_same_v<M, CommitMsg>
void Check(Reader& r, const std::string&, const M& m) {
  if (m.from.id != m.from_generation) {
    r.Fail("from", "generation " + std::to_string(m.from.id) + " is not from_generation " +
                       std::to_string(m.from_generation));
  }
}
void Check(Reader& r, const std::string& f, const AppliedMsg::Phases& p) {
  for (auto [name, v] : {std::pair{"communicators_us", p.communicators_us},
                         std::pair{"plan_us", p.plan_us}, std::pair{"transfer_us", p.transfer_us},
                         std::pair{"resume_us", p.resume_us}, std::pair{"stall_us", p.stall_us}}) {
    if (v < 0) r.Fail(f + name, "negative duration");
  }
}

// Decodes every field in its field list's order, naming a bad one by its path
// ("commit.next.ranks"), then checks each struct (Check).
struct Decoder {
  Reader& r;
  std::string path;
  template <typename T>
  void operator()(std::string_view name, T& x) {
    const std::string f = path + std::string(name);
    if constexpr (std::is_same_v<T, bool>) {
      x = GetBool(r, f) == 1;
    } else if constexpr (std::is_same_v<T, int32_t>) {
      x = r.I32(f);
    } else if constexpr (std::is_same_v<T, int64_t>) {
      x = r.I64(f);
    } else if constexpr (std::is_same_v<T, uint64_t>) {
      x = r.U64(f);
    } else if constexpr (std::is_same_v<T, std::string>) {
      x = r.Str(f);
    } else if constexpr (std::is_same_v<T, DType>) {
      const uint8_t v = r.U8(f);
      if (r.ok() && v > static_cast<uint8_t>(DType::kU8)) {
        r.Fail(f, "not a dtype: " + std::to_string(v));
      }
      x = static_cast<DType>(v);
    } else if constexpr (std::is_same_v<T, RecoverySource>) {
      const uint8_t v = r.U8(f);
      if (r.ok() && v > static_cast<uint8_t>(RecoverySource::kCheckpoint)) {
        r.Fail(f, "not a source: " + std::to_string(v));
      }
      x = static_cast<RecoverySource>(v);
    } else if constexpr (std::is_same_v<T, Layout>) {
      x = GetLayout(r, f);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      x = r.Ids(f);
    } else if constexpr (std::is_same_v<T, std::vector<int>>) {
      x = GetInts(r, f);
    } else if constexpr (IsVector<T>::value) {
      using E = typename T::value_type;
      const uint32_t n = r.Count(f, MinWireBytes<E>());
      x.clear();
      x.reserve(n);
      Decoder items{r, f + "."};
      for (uint32_t i = 0; i < n && r.ok(); ++i) {
        E e;
        fields::Fields(items, e);
        if (r.ok()) Check(r, items.path, e);
        x.push_back(std::move(e));
      }
    } else {
      Decoder nested{r, f + "."};
      fields::Fields(nested, x);
      if (r.ok()) Check(r, nested.path, x);
    }
  }
};

template <typename M>
void Put(Writer& w, const M& m) {
  Encoder e{w};
  fields::Fields(e, m);
}
template <typename M>
void Get(Reader& r, M& m) {
  Decoder d{r, ""};
  fields::Fields(d, m);
  if (r.ok()) Check(r, "", m);
}

template <size_t I = 0>
StatusOr<WireMessage> DecodeAs(size_t index, std::string_view body) {
  if constexpr (I < std::variant_size_v<WireMessage>) {
    if (index == I) {
      std::variant_alternative_t<I, WireMessage> m;
      Reader r(body, WireTypeName(static_cast<uint16_t>(I + 1)));
      Get(r, m);
      r.End();
      if (!r.ok()) return r.status();
      return WireMessage(std::move(m));
    }
    return DecodeAs<I + 1>(index, body);
  } else {
    return InvalidArgumentError("frame: unknown type");
  }
}

}  // namespace

std::string_view WireTypeName(uint16_t type) {
  static constexpr std::string_view kNames[] = {
      "?",           "hello",  "welcome", "heartbeat", "leave",   "error",  "prepare",
      "step_report", "commit", "abandon", "applied",   "outcome", "release", "register",
      "done",        "failure_report", "abort"};
  return type < std::size(kNames) ? kNames[type] : "?";
}

std::string EncodeFrame(const WireMessage& m) {
  Writer body;
  std::visit([&](const auto& msg) { Put(body, msg); }, m);
  Writer w;
  w.U32(kWireMagic);
  w.U16(kWireVersion);
  w.U16(static_cast<uint16_t>(m.index() + 1));
  w.U32(static_cast<uint32_t>(body.out().size()));
  w.out().append(body.out());
  return std::move(w.out());
}

StatusOr<FrameHeader> DecodeHeader(std::string_view header) {
  if (header.size() < kFrameHeaderBytes) {
    return InvalidArgumentError("frame: header of " + std::to_string(header.size()) +
                                " bytes, expected 12");
  }
  Reader r(header.substr(0, kFrameHeaderBytes), "frame");
  uint32_t magic = r.U32("magic");
  FrameHeader h;
  h.version = static_cast<uint16_t>(r.Le(2, "version"));
  h.type = static_cast<uint16_t>(r.Le(2, "type"));
  h.length = r.U32("length");
  if (magic != kWireMagic) return InvalidArgumentError("frame: bad magic (not a morph peer)");
  if (h.version != kWireVersion) {
    return FailedPreconditionError("frame: wire version " + std::to_string(h.version) +
                                   ", this side speaks " + std::to_string(kWireVersion));
  }
  if (h.type == 0 || h.type > std::variant_size_v<WireMessage>) {
    return InvalidArgumentError("frame: unknown type " + std::to_string(h.type));
  }
  uint32_t limit =
      h.type == static_cast<uint16_t>(WireType::kHello) ? kMaxHelloBody : kMaxFrameBody;
  if (h.length > limit) {
    return InvalidArgumentError("frame: " + std::string(WireTypeName(h.type)) + " body of " +
                                std::to_string(h.length) + " bytes exceeds " +
                                std::to_string(limit));
  }
  return h;
}

StatusOr<WireMessage> DecodeBody(const FrameHeader& header, std::string_view body) {
  if (body.size() != header.length) {
    return InvalidArgumentError("frame: body of " + std::to_string(body.size()) +
                                " bytes, header says " + std::to_string(header.length));
  }
  return DecodeAs(header.type - 1, body);
}

StatusOr<WireMessage> DecodeFrame(std::string_view frame) {
  MORPH_ASSIGN_OR_RETURN(FrameHeader h, DecodeHeader(frame));
  return DecodeBody(h, frame.substr(kFrameHeaderBytes));
}

}  // namespace morph
