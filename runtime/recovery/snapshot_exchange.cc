// BuddySnapshotter's exchange with its buddy and ward (snapshot.h "A round"): a header, the
// description of what is sent, the payload in pipelined groups of messages with their
// CRC32C computed while the next group moves, and a trailer with the sender's CRC32C.
#include <algorithm>
#include <cstring>
#include <deque>
#include <string>
#include <utility>

#include "reshard/crc32c.h"
#include "runtime/recovery/snapshot.h"

namespace morph {
namespace {

constexpr uint64_t kMagic = 0x50414e5348504d52ull;  // "RMPHSNAP"
struct Header {
  uint64_t magic = kMagic;
  int64_t generation = 0;
  int64_t step = 0;
  int32_t rank = 0;
  uint32_t crc = 0;
  uint64_t meta_bytes = 0;
  uint64_t payload_bytes = 0;
  uint64_t chunk_bytes = 0;
  uint64_t reserved = 0;
};
static_assert(sizeof(Header) == 64);

// After the payload: its CRC32C, computed while it moved.
constexpr uint64_t kTrailerMagic = 0x4c52545053504d52ull;  // "RMPSPTRL"
struct Trailer {
  uint64_t magic = kTrailerMagic;
  uint64_t payload_bytes = 0;
  uint32_t crc = 0;
  uint32_t reserved = 0;
};

// The description of what goes to the buddy (shards, offsets, scalar sizes, config) as int64
// words; a tensor not sent (`sent[i]` false) is described as an empty shard.
std::vector<int64_t> EncodeMeta(const SnapshotData& d, const void* base,
                                const std::vector<bool>& sent) {
  std::vector<int64_t> m;
  const ParallelConfig& c = d.config;
  m.insert(m.end(), {c.dp, c.tp, c.pp, c.zero_stage, c.micro_batches,
                     static_cast<int64_t>(c.stage_of_layer.size())});
  for (int s : c.stage_of_layer) m.push_back(s);
  m.push_back(static_cast<int64_t>(d.shards.size()));
  for (size_t i = 0; i < d.shards.size(); ++i) {
    if (!sent[i]) {
      m.insert(m.end(), {0, 0, 0, 0, 0});  // rank 0, flat [0, 0), no bytes
      continue;
    }
    const Shard& s = d.shards[i];
    m.push_back(s.frame.rank());
    for (const Interval& iv : s.frame.dims()) m.insert(m.end(), {iv.begin, iv.end});
    m.insert(m.end(), {s.flat_begin, s.flat_end});
    const ConstBufferView& v = d.tensors[i];
    m.push_back(v.bytes == 0 ? 0
                             : static_cast<const char*>(v.data) - static_cast<const char*>(base));
    m.push_back(static_cast<int64_t>(v.bytes));
  }
  m.push_back(static_cast<int64_t>(d.scalars.size()));
  for (const auto& s : d.scalars) {
    m.push_back(
        s.empty() ? 0 : reinterpret_cast<const char*>(s.data()) - static_cast<const char*>(base));
    m.push_back(static_cast<int64_t>(s.size()));
  }
  return m;
}

// The inverse, with views into `base` (payload of `bytes`). kDataLoss when inconsistent.
Status DecodeMeta(const std::vector<int64_t>& m, const char* base, int64_t bytes, SnapshotData& d) {
  size_t i = 0;
  auto next = [&](int64_t& v) {
    if (i >= m.size()) return false;
    v = m[i++];
    return true;
  };
  const auto bad = [](const std::string& what) {
    return DataLossError("snapshot description is inconsistent: " + what);
  };
  auto view_ok = [&](int64_t off, int64_t n) { return off >= 0 && n >= 0 && off + n <= bytes; };
  int64_t dp, tp, pp, zs, mb, nl;
  if (!next(dp) || !next(tp) || !next(pp) || !next(zs) || !next(mb) || !next(nl) || nl < 0) {
    return bad("config");
  }
  d.config = ParallelConfig{
      .dp = static_cast<int>(dp), .tp = static_cast<int>(tp), .pp = static_cast<int>(pp)};
  d.config.zero_stage = static_cast<int>(zs);
  d.config.micro_batches = static_cast<int>(mb);
  for (int64_t k = 0; k < nl; ++k) {
    int64_t s;
    if (!next(s)) return bad("stage_of_layer");
    d.config.stage_of_layer.push_back(static_cast<int>(s));
  }
  int64_t nt;
  if (!next(nt) || nt < 0) return bad("tensor count");
  d.shards.clear();
  d.tensors.clear();
  for (int64_t t = 0; t < nt; ++t) {
    int64_t rank;
    if (!next(rank) || rank < 0 || rank > 16) return bad("tensor " + std::to_string(t));
    std::vector<Interval> dims(static_cast<size_t>(rank));
    for (Interval& iv : dims) {
      if (!next(iv.begin) || !next(iv.end)) return bad("tensor " + std::to_string(t));
    }
    Shard s;
    s.frame = Box(std::move(dims));
    int64_t off, n;
    if (!next(s.flat_begin) || !next(s.flat_end) || !next(off) || !next(n) || !view_ok(off, n)) {
      return bad("tensor " + std::to_string(t));
    }
    d.shards.push_back(std::move(s));
    d.tensors.emplace_back(n == 0 ? nullptr : base + off, static_cast<size_t>(n),
                           MemoryKind::kHost);
  }
  int64_t ns;
  if (!next(ns) || ns < 0) return bad("scalar count");
  d.scalars.clear();
  for (int64_t k = 0; k < ns; ++k) {
    int64_t off, n;
    if (!next(off) || !next(n) || !view_ok(off, n)) return bad("scalar " + std::to_string(k));
    d.scalars.emplace_back(reinterpret_cast<const std::byte*>(base + off), static_cast<size_t>(n));
  }
  if (i != m.size()) return bad("trailing words");
  return Status::Ok();
}

}  // namespace

Status BuddySnapshotter::Exchange(int64_t step, int64_t generation, Slot& local, size_t hs,
                                  const std::vector<bool>& sent) {
  Slot& held = held_[hs];
  const std::string buddy_name =
      "rank " + std::to_string(buddy_) + " (host " + hosts_[static_cast<size_t>(buddy_)] + ")";
  const std::string ward_name =
      "rank " + std::to_string(ward_) + " (host " + hosts_[static_cast<size_t>(ward_)] + ")";
  const std::string what = "snapshot of step " + std::to_string(step);
  const bool same = from_ward_ == nullptr;
  const int buddy_peer = rank_ < buddy_ ? 1 : 0;  // the buddy's rank in the pair communicator
  const int ward_peer = rank_ < ward_ ? 1 : 0;
  Communicator& ward_comm = same ? *to_buddy_ : *from_ward_;
  auto tag = [&](Status s, bool sending) {
    const int peer = sending ? buddy_ : ward_;
    CollectiveFailure f;
    if (const CollectiveFailure* cf = s.collective_failure()) f = *cf;
    f.peers = {peer};
    f.group = PairName(rank_, peer);
    return s
        .WithContext(sending ? what + ": sending to buddy " + buddy_name
                             : what + ": receiving the copy of " + ward_name)
        .WithCollectiveFailure(std::move(f));
  };
  // One started piece of the exchange: messages to the buddy and/or from the ward, as one
  // send/recv group per communicator (every message of a group is posted at once).
  struct Started {
    std::unique_ptr<Work> send, recv;
    uint64_t send_end = 0, recv_end = 0;  // payload bytes sent / received once it is done
    std::vector<uint64_t> chunk_ends;     // for after_chunk_sent
  };
  auto start = [&](std::vector<P2POp> sends, std::vector<P2POp> recvs) -> StatusOr<Started> {
    Started st;
    if (same) {
      sends.insert(sends.end(), recvs.begin(), recvs.end());
      if (sends.empty()) return st;
      StatusOr<std::unique_ptr<Work>> w =
          to_buddy_->Start(CollectiveOp::SendRecv(std::move(sends), options_.timeout));
      if (!w.ok()) return tag(w.status(), true);
      st.send = std::move(w).value();
      return st;
    }
    if (!sends.empty()) {
      StatusOr<std::unique_ptr<Work>> w =
          to_buddy_->Start(CollectiveOp::SendRecv(std::move(sends), options_.timeout));
      if (!w.ok()) return tag(w.status(), true);
      st.send = std::move(w).value();
    }
    if (!recvs.empty()) {
      StatusOr<std::unique_ptr<Work>> w =
          ward_comm.Start(CollectiveOp::SendRecv(std::move(recvs), options_.timeout));
      if (!w.ok()) {
        if (st.send) (void)st.send->Wait(Deadline::After(options_.timeout));
        return tag(w.status(), false);
      }
      st.recv = std::move(w).value();
    }
    return st;
  };
  auto finish = [&](Started& st) -> Status {
    const Status ss = st.send ? st.send->Wait(Deadline::After(options_.timeout)) : Status::Ok();
    const Status rs = st.recv ? st.recv->Wait(Deadline::After(options_.timeout)) : Status::Ok();
    if (same && !ss.ok()) return tag(ss, true);  // one group both ways: the same peer
    if (!rs.ok()) return tag(rs, false);         // the ward's failure first: it is what we lose
    if (!ss.ok()) return tag(ss, true);
    return Status::Ok();
  };
  auto send_op = [&](const void* p, size_t n) {
    return P2POp{P2POp::Kind::kSend, buddy_peer, const_cast<void*>(p), n};
  };
  auto recv_op = [&](void* p, size_t n) { return P2POp{P2POp::Kind::kRecv, ward_peer, p, n}; };
  auto transfer = [&](const void* send, size_t send_n, void* recv, size_t recv_n) -> Status {
    MORPH_ASSIGN_OR_RETURN(Started st, start({send_op(send, send_n)}, {recv_op(recv, recv_n)}));
    return finish(st);
  };

  // What goes out: the copy's suffix from sent_offset (offsets in the description are from
  // there).
  const char* base = static_cast<const char*>(local.buffer.data()) + local.data.sent_offset;
  const std::vector<int64_t> meta = EncodeMeta(local.data, base, sent);
  Header mine;
  mine.generation = generation;
  mine.step = step;
  mine.rank = rank_;
  mine.meta_bytes = meta.size() * sizeof(int64_t);
  mine.payload_bytes = static_cast<uint64_t>(local.data.sent_bytes);
  mine.chunk_bytes = options_.chunk_bytes;
  Header theirs;
  MORPH_RETURN_IF_ERROR(transfer(&mine, sizeof(mine), &theirs, sizeof(theirs)));
  if (theirs.magic != kMagic || theirs.generation != generation || theirs.step != step ||
      theirs.rank != ward_ || theirs.meta_bytes % sizeof(int64_t) != 0 || theirs.chunk_bytes == 0 ||
      theirs.meta_bytes > (uint64_t{64} << 20)) {
    return FailedPreconditionError(
        what + ": " + ward_name + " sent a snapshot of generation " +
        std::to_string(theirs.generation) + " step " + std::to_string(theirs.step) + " rank " +
        std::to_string(theirs.rank) +
        " (every rank must snapshot the same steps of the same generation)");
  }
  std::vector<int64_t> their_meta(theirs.meta_bytes / sizeof(int64_t));
  MORPH_RETURN_IF_ERROR(
      transfer(meta.data(), mine.meta_bytes, their_meta.data(), theirs.meta_bytes));
  MORPH_RETURN_IF_ERROR(EnsureSize(held.buffer, static_cast<size_t>(theirs.payload_bytes)))
      << what << ": buffer for the copy of " << ward_name;
  char* in = static_cast<char*>(held.buffer.data());

  // The payload, pipelined: groups of chunks_per_group chunks, the next group queued on the
  // communicators before this thread waits for the previous one, so the wire never waits for
  // a handshake; while a group moves, this thread checksums what it sends and what arrived.
  // The checksums (CRC32C of the whole payload) follow in a trailer.
  const uint64_t group_chunks = std::max<uint64_t>(1, options_.chunks_per_group);
  uint64_t posted_sent = 0, posted_got = 0, crc_sent = 0;
  uint32_t my_crc = 0, their_crc = 0;
  uint64_t checked_got = 0;
  std::deque<Started> flight;
  Status failed;
  // After an error: stop what is still queued or moving. Not waited for: a Gloo wait the abort
  // does not wake would hold this round (and the recovery that ends it) for the op timeout; the
  // buffers stay allocated, the generation's snapshots are broken, and its communicators are
  // destroyed (their op threads joined) before any later round reuses them.
  auto drain = [&]() {
    to_buddy_->Abort();
    if (from_ward_) from_ward_->Abort();
    flight.clear();
  };
  auto complete_front = [&]() -> Status {
    Started st = std::move(flight.front());
    flight.pop_front();
    MORPH_RETURN_IF_ERROR(finish(st));
    if (st.recv_end > checked_got) {
      their_crc = Crc32cExtend(their_crc, in + checked_got, st.recv_end - checked_got);
      checked_got = st.recv_end;
    }
    if (options_.after_chunk_sent) {
      for (uint64_t e : st.chunk_ends) options_.after_chunk_sent(step, static_cast<int64_t>(e));
    }
    return Status::Ok();
  };
  while (posted_sent < mine.payload_bytes || posted_got < theirs.payload_bytes) {
    std::vector<P2POp> sends, recvs;
    std::vector<uint64_t> chunk_ends;
    for (uint64_t c = 0; c < group_chunks; ++c) {
      const uint64_t sn = std::min<uint64_t>(mine.chunk_bytes, mine.payload_bytes - posted_sent);
      const uint64_t rn = std::min<uint64_t>(theirs.chunk_bytes, theirs.payload_bytes - posted_got);
      if (sn > 0) {
        sends.push_back(send_op(base + posted_sent, static_cast<size_t>(sn)));
        posted_sent += sn;
        chunk_ends.push_back(posted_sent);
      }
      if (rn > 0) {
        recvs.push_back(recv_op(in + posted_got, static_cast<size_t>(rn)));
        posted_got += rn;
      }
    }
    StatusOr<Started> st = start(std::move(sends), std::move(recvs));
    if (!st.ok()) {
      drain();
      return st.status();
    }
    st->send_end = posted_sent;
    st->recv_end = posted_got;
    st->chunk_ends = std::move(chunk_ends);
    flight.push_back(std::move(st).value());
    // While it moves: the checksum of what it sends (the local copy does not change).
    my_crc = Crc32cExtend(my_crc, base + crc_sent, posted_sent - crc_sent);
    crc_sent = posted_sent;
    if (flight.size() > 1) {
      if (Status s = complete_front(); !s.ok()) {
        drain();
        return s;
      }
    }
  }
  while (!flight.empty()) {
    if (Status s = complete_front(); !s.ok()) {
      drain();
      return s;
    }
  }
  Trailer my_trailer{.payload_bytes = mine.payload_bytes, .crc = my_crc};
  Trailer their_trailer;
  MORPH_RETURN_IF_ERROR(
      transfer(&my_trailer, sizeof(my_trailer), &their_trailer, sizeof(their_trailer)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    local.data.crc32c = my_crc;
  }
  if (their_trailer.magic != kTrailerMagic || their_trailer.payload_bytes != theirs.payload_bytes) {
    return DataLossError(what + ": the copy of " + ward_name + " ended with a bad trailer");
  }
  if (their_crc != their_trailer.crc) {
    return DataLossError(what + ": the copy of " + ward_name + " arrived with CRC32C " +
                         std::to_string(their_crc) + ", sent with " +
                         std::to_string(their_trailer.crc));
  }
  SnapshotData d;
  d.generation = generation;
  d.step = step;
  d.rank = ward_;
  d.bytes = static_cast<int64_t>(theirs.payload_bytes);
  d.crc32c = their_crc;
  MORPH_RETURN_IF_ERROR(DecodeMeta(their_meta, in, d.bytes, d))
      << what << ": the copy of " << ward_name;
  std::lock_guard<std::mutex> lock(mu_);
  held.data = std::move(d);
  return Status::Ok();
}

}  // namespace morph
