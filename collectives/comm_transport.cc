#include "collectives/comm_transport.h"

#include <cstdio>
#include <string>
#include <vector>

namespace morph {
namespace {

// Message identity (transport.h): ahead of its payload, each group sends every peer it sends to
// one 16-byte record {count, FNV-1a of the tags in posting order} of the messages it sends that
// peer, and receives the same record from every peer it receives from; Wait compares it with
// the tags of the receives posted here. Both records lead their pair's messages of the group, so
// the backend's in-order matching pairs record with record.
struct TagRecord {
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
};
constexpr size_t kTagRecordBytes = 16;

std::string Hex(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

class CommTransportWork : public TransportWork {
 public:
  CommTransportWork(std::unique_ptr<Work> work, std::vector<unsigned char> out,
                    std::vector<unsigned char> in, std::vector<int> from,
                    std::vector<TagRecord> expected)
      : work_(std::move(work)),
        out_(std::move(out)),
        in_(std::move(in)),
        from_(std::move(from)),
        expected_(std::move(expected)) {}
  Status Wait(Deadline deadline) override {
    MORPH_RETURN_IF_ERROR(work_->Wait(deadline));
    for (size_t i = 0; i < from_.size(); ++i) {
      const TagRecord got = TagRecord::Load(in_.data() + i * kTagRecordBytes);
      const TagRecord& want = expected_[i];
      if (got.count != want.count || got.hash != want.hash) {
        return FailedPreconditionError(
            "message tag mismatch: peer " + std::to_string(from_[i]) + " sent " +
            std::to_string(got.count) + " messages with tag hash " + Hex(got.hash) +
            ", the receives posted here expect " + std::to_string(want.count) + " with " +
            Hex(want.hash) + " (the two sides run different plans or steps)");
      }
    }
    return Status();
  }

 private:
  std::unique_ptr<Work> work_;
  std::vector<unsigned char> out_, in_;  // tag records; must outlive work_'s Wait
  std::vector<int> from_;
  std::vector<TagRecord> expected_;
};

}  // namespace

StatusOr<std::unique_ptr<TransportWork>> CommTransport::Start(std::span<const SendOp> sends,
                                                              std::span<const RecvOp> recvs) {
  // SupportsStridedOps() is false: contiguous buffers only.
  for (const SendOp& s : sends) {
    if (s.strided != nullptr) return InvalidArgumentError("strided send op to a CommTransport");
  }
  for (const RecvOp& r : recvs) {
    if (r.strided != nullptr) return InvalidArgumentError("strided receive op to a CommTransport");
  }
  const int n = size();
  auto check_peer = [&](int peer, const char* what) -> Status {
    if (peer < 0 || peer >= n || peer == rank()) {
      return InvalidArgumentError(std::string(what) + " peer " + std::to_string(peer) +
                                  " from rank " + std::to_string(rank()) + " of " +
                                  std::to_string(n));
    }
    return Status();
  };
  std::vector<TagRecord> to(static_cast<size_t>(n)), from(static_cast<size_t>(n));
  std::vector<bool> sends_to(static_cast<size_t>(n)), recvs_from(static_cast<size_t>(n));
  for (const SendOp& s : sends) {
    MORPH_RETURN_IF_ERROR(check_peer(s.peer, "send to"));
    to[static_cast<size_t>(s.peer)].Add(s.tag);
    sends_to[static_cast<size_t>(s.peer)] = true;
  }
  for (const RecvOp& r : recvs) {
    MORPH_RETURN_IF_ERROR(check_peer(r.peer, "receive from"));
    from[static_cast<size_t>(r.peer)].Add(r.tag);
    recvs_from[static_cast<size_t>(r.peer)] = true;
  }
  std::vector<int> out_peers, in_peers;
  std::vector<TagRecord> expected;
  for (int p = 0; p < n; ++p) {
    if (sends_to[static_cast<size_t>(p)]) out_peers.push_back(p);
    if (recvs_from[static_cast<size_t>(p)]) {
      in_peers.push_back(p);
      expected.push_back(from[static_cast<size_t>(p)]);
    }
  }
  std::vector<unsigned char> out(out_peers.size() * kTagRecordBytes),
      in(in_peers.size() * kTagRecordBytes);
  std::vector<P2POp> ops;
  ops.reserve(sends.size() + recvs.size() + out_peers.size() + in_peers.size());
  for (size_t i = 0; i < out_peers.size(); ++i) {
    to[static_cast<size_t>(out_peers[i])].Store(out.data() + i * kTagRecordBytes);
    ops.push_back(
        {P2POp::Kind::kSend, out_peers[i], out.data() + i * kTagRecordBytes, kTagRecordBytes});
  }
  for (size_t i = 0; i < in_peers.size(); ++i) {
    ops.push_back(
        {P2POp::Kind::kRecv, in_peers[i], in.data() + i * kTagRecordBytes, kTagRecordBytes});
  }
  for (const SendOp& s : sends) {
    ops.push_back({P2POp::Kind::kSend, s.peer, const_cast<void*>(s.data), s.bytes});
  }
  for (const RecvOp& r : recvs) ops.push_back({P2POp::Kind::kRecv, r.peer, r.data, r.bytes});
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<Work> work,
                         comm_->Start(CollectiveOp::SendRecv(std::move(ops), timeout_)),
                         "transport");
  return std::unique_ptr<TransportWork>(new CommTransportWork(
      std::move(work), std::move(out), std::move(in), std::move(in_peers), std::move(expected)));
}

}  // namespace morph
