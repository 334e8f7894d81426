// Message identity over a communicator (reshard/transport.h "tags"): ahead of its payload, each
// transport group sends every peer it sends to one 16-byte record {count, FNV-1a of the tags in
// posting order} of the messages it sends that peer, and receives the same record from every
// peer it receives from; Wait compares it with the tags of the receives posted there. Both
// records lead their pair's messages of the group, so the backend's in-order matching pairs
// record with record. Shared by CommTransport and DeviceTransport; internal.
#ifndef MORPH_COLLECTIVES_TAG_RECORD_H_
#define MORPH_COLLECTIVES_TAG_RECORD_H_

#include <cstdint>
#include <cstdio>
#include <string>

namespace morph {

struct TagRecord {
  static constexpr size_t kBytes = 16;
  uint64_t count = 0;
  uint64_t hash = 14695981039346656037ull;
  void Add(uint64_t tag) {
    ++count;
    for (int i = 0; i < 8; ++i) hash = (hash ^ ((tag >> (8 * i)) & 0xff)) * 1099511628211ull;
  }
  void Store(unsigned char* out) const {
    for (int i = 0; i < 8; ++i) {
      out[i] = static_cast<unsigned char>(count >> (8 * i));
      out[8 + i] = static_cast<unsigned char>(hash >> (8 * i));
    }
  }
  static TagRecord Load(const unsigned char* in) {
    TagRecord r;
    r.count = r.hash = 0;
    for (int i = 0; i < 8; ++i) {
      r.count |= uint64_t{in[i]} << (8 * i);
      r.hash |= uint64_t{in[8 + i]} << (8 * i);
    }
    return r;
  }
  bool operator==(const TagRecord&) const = default;
};

inline std::string TagHex(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// "message tag mismatch: peer 3 sent 2 messages with tag hash 0x..., the receives posted here
// expect 2 with 0x... (the two sides run different plans or steps)"
inline std::string TagMismatch(int peer, const TagRecord& got, const TagRecord& want) {
  return "message tag mismatch: peer " + std::to_string(peer) + " sent " +
         std::to_string(got.count) + " messages with tag hash " + TagHex(got.hash) +
         ", the receives posted here expect " + std::to_string(want.count) + " with " +
         TagHex(want.hash) + " (the two sides run different plans or steps)";
}

}  // namespace morph

#endif  // MORPH_COLLECTIVES_TAG_RECORD_H_
