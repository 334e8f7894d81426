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
#include <vector>

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

// One transport group's records: for each peer this side sends to (ascending), the record of
// its sends there, stored in `out`; for each peer it receives from (ascending), the record its
// receives there expect, and `in` sized for the ones that arrive. Peers for which `skip(peer)`
// holds carry no record (same-host shared-memory peers). Sends and receives: anything with
// `peer` and `tag` (reshard/transport.h SendOp, RecvOp).
struct TagRecords {
  std::vector<int> out_peers;
  std::vector<unsigned char> out;
  std::vector<int> in_peers;
  std::vector<TagRecord> expected;
  std::vector<unsigned char> in;
};
template <typename Sends, typename Recvs, typename Skip>
TagRecords MakeTagRecords(int n, const Sends& sends, const Recvs& recvs, Skip skip) {
  std::vector<TagRecord> to(static_cast<size_t>(n)), from(static_cast<size_t>(n));
  std::vector<bool> sends_to(static_cast<size_t>(n)), recvs_from(static_cast<size_t>(n));
  for (const auto& s : sends) {
    if (skip(s.peer)) continue;
    to[static_cast<size_t>(s.peer)].Add(s.tag);
    sends_to[static_cast<size_t>(s.peer)] = true;
  }
  for (const auto& r : recvs) {
    if (skip(r.peer)) continue;
    from[static_cast<size_t>(r.peer)].Add(r.tag);
    recvs_from[static_cast<size_t>(r.peer)] = true;
  }
  TagRecords t;
  for (int p = 0; p < n; ++p) {
    if (sends_to[static_cast<size_t>(p)]) t.out_peers.push_back(p);
    if (recvs_from[static_cast<size_t>(p)]) {
      t.in_peers.push_back(p);
      t.expected.push_back(from[static_cast<size_t>(p)]);
    }
  }
  t.out.resize(t.out_peers.size() * TagRecord::kBytes);
  for (size_t i = 0; i < t.out_peers.size(); ++i) {
    to[static_cast<size_t>(t.out_peers[i])].Store(t.out.data() + i * TagRecord::kBytes);
  }
  t.in.resize(t.in_peers.size() * TagRecord::kBytes);
  return t;
}

}  // namespace morph

#endif  // MORPH_COLLECTIVES_TAG_RECORD_H_
