// ShmCollectives::SendRecv: point-to-point messages through the segment's pair rings
// (shm_collectives.h, shm_layout.h). One ring per ordered pair, its sender the only writer of
// `posted` and its receiver of `consumed`; a message goes as consecutive slots of up to
// kP2PSlotBytes, each with a header the receiver checks before it copies anything out. One loop
// moves every message of the operation as far as the rings allow (so that an exchange in both
// directions cannot deadlock), then waits for a peer to post or consume.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/shm/shm_collectives.h"
#include "collectives/shm/shm_layout.h"
#include "collectives/shm/shm_support.h"

namespace morph {
namespace {

using shm_layout::kLive;
using shm_layout::kPollSlice;
using shm_layout::RingHead;
using shm_layout::SlotHead;
using Clock = std::chrono::steady_clock;

struct Message {
  uint8_t* data;
  size_t bytes;
  size_t done = 0;
};

RingHead* Head(uint8_t* ring) { return reinterpret_cast<RingHead*>(ring); }
SlotHead* Slot(uint8_t* ring, uint64_t n) {
  return reinterpret_cast<SlotHead*>(ring + sizeof(RingHead) +
                                     (n % ShmCollectives::kP2PSlots) * shm_layout::kSlotStride);
}

std::string Ranks(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

void ShmCollectives::WakeP2P(int peer) {
  shm_layout::Control* c = segment_->control(peer);
  if (c->p2p_waiting.load(std::memory_order_seq_cst) != 0 &&
      c->p2p_waiting.exchange(0, std::memory_order_seq_cst) != 0) {
    shm_support::RingDoorbell(&c->p2p_doorbell);
  }
}

Status ShmCollectives::SendRecv(const CollectiveOp& op) {
  const std::string what = what_ + ": send/recv";
  std::vector<std::vector<Message>> sends(static_cast<size_t>(size_)),
      recvs(static_cast<size_t>(size_));
  for (const P2POp& p : op.p2p) {
    (p.kind == P2POp::Kind::kSend ? sends : recvs)[p.peer].push_back(
        {static_cast<uint8_t*>(p.data), p.bytes});
  }
  std::vector<size_t> next_send(static_cast<size_t>(size_), 0), next_recv(next_send);
  const Clock::time_point deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(op.timeout, std::chrono::hours(24 * 365));
  // Moves what it can; returns whether anything moved. Sets `error` on a mismatch.
  Status error;
  auto step = [&]() -> bool {
    bool moved = false;
    for (int peer = 0; peer < size_; ++peer) {
      std::vector<Message>& q = sends[peer];
      uint8_t* ring = segment_->ring(rank_, peer);
      RingHead* h = Head(ring);
      while (next_send[peer] < q.size()) {
        const uint64_t posted = h->posted.load(std::memory_order_relaxed);
        if (posted - h->consumed.load(std::memory_order_acquire) >= kP2PSlots) break;
        Message& m = q[next_send[peer]];
        const size_t len = std::min(kP2PSlotBytes, m.bytes - m.done);
        SlotHead* s = Slot(ring, posted);
        *s = SlotHead{.msg_bytes = m.bytes,
                      .offset = m.done,
                      .len = static_cast<uint32_t>(len),
                      .count = static_cast<uint32_t>(q.size()),
                      .index = static_cast<uint32_t>(next_send[peer]),
                      .pad = 0};
        if (len > 0) std::memcpy(s + 1, m.data + m.done, len);
        h->posted.store(posted + 1, std::memory_order_seq_cst);
        WakeP2P(peer);
        m.done += len;
        moved = true;
        if (m.done == m.bytes) ++next_send[peer];
      }
    }
    for (int peer = 0; peer < size_; ++peer) {
      std::vector<Message>& q = recvs[peer];
      uint8_t* ring = segment_->ring(peer, rank_);
      RingHead* h = Head(ring);
      while (next_recv[peer] < q.size()) {
        const uint64_t consumed = h->consumed.load(std::memory_order_relaxed);
        if (consumed == h->posted.load(std::memory_order_acquire)) break;
        const SlotHead* s = Slot(ring, consumed);
        Message& m = q[next_recv[peer]];
        if (s->count != q.size() || s->index != next_recv[peer] || s->msg_bytes != m.bytes ||
            s->offset != m.done || s->offset + s->len > m.bytes) {
          error = InternalError(
              what + ": peer " + std::to_string(peer) + " sends " + std::to_string(s->count) +
              " messages, this rank receives " + std::to_string(q.size()) +
              (s->count == q.size() ? " (sizes differ): its message " +
                                          std::to_string(s->index) + " holds " +
                                          std::to_string(s->msg_bytes) +
                                          " bytes, this rank expects " + std::to_string(m.bytes)
                                    : std::string()));
          return false;
        }
        if (s->len > 0) std::memcpy(m.data + m.done, s + 1, s->len);
        m.done += s->len;
        h->consumed.store(consumed + 1, std::memory_order_seq_cst);
        WakeP2P(peer);
        moved = true;
        if (m.done == m.bytes) ++next_recv[peer];
      }
    }
    return moved;
  };
  // The peers this rank still waits for: to make room, or to post.
  auto waiting_for = [&] {
    std::vector<int> peers;
    for (int peer = 0; peer < size_; ++peer) {
      if (next_send[peer] < sends[peer].size() || next_recv[peer] < recvs[peer].size()) {
        peers.push_back(peer);
      }
    }
    return peers;
  };
  while (true) {
    const bool moved = step();
    if (!error.ok()) return error;
    std::vector<int> peers = waiting_for();
    if (peers.empty()) return Status::Ok();
    if (moved) continue;
    // Could anything move now? (Checked again after the waiting flag is set.)
    auto can_progress = [&] {
      for (int peer : peers) {
        if (next_send[peer] < sends[peer].size()) {
          RingHead* h = Head(segment_->ring(rank_, peer));
          if (h->posted.load(std::memory_order_seq_cst) -
                  h->consumed.load(std::memory_order_seq_cst) <
              kP2PSlots) {
            return true;
          }
        }
        if (next_recv[peer] < recvs[peer].size()) {
          RingHead* h = Head(segment_->ring(peer, rank_));
          if (h->consumed.load(std::memory_order_seq_cst) !=
              h->posted.load(std::memory_order_seq_cst)) {
            return true;
          }
        }
      }
      return false;
    };
    MORPH_RETURN_IF_ERROR(WaitP2P(peers, can_progress, deadline, op.timeout));
  }
}

Status ShmCollectives::WaitP2P(const std::vector<int>& peers,
                               const std::function<bool()>& can_progress,
                               Clock::time_point deadline, std::chrono::milliseconds timeout) {
  const std::string what = what_ + ": send/recv";
  if (can_progress()) return Status::Ok();
  const Clock::time_point spin_end = Clock::now() + spin_;
  for (uint32_t i = 1; spin_.count() > 0 && !failed_.load(std::memory_order_relaxed); ++i) {
    if (can_progress()) return Status::Ok();
    shm_support::CpuRelax();
    if (i % 64 == 0 && Clock::now() >= spin_end) break;
  }
  const Clock::time_point yield_end = Clock::now() + yield_;
  while (yield_.count() > 0 && !failed_.load(std::memory_order_relaxed)) {
    sched_yield();
    if (can_progress()) return Status::Ok();
    if (Clock::now() >= yield_end) break;
  }
  shm_layout::Control* me = segment_->control(rank_);
  for (;;) {
    if (failed_.load(std::memory_order_acquire)) {
      return AbortedError(what + ": aborted while waiting in shared memory")
          .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}, ""});
    }
    if (can_progress()) return Status::Ok();
    // A peer gone (exited, or failed: it will post or consume nothing more). What it posted
    // before is read first: can_progress() said there is nothing left.
    std::vector<int> dead, left, dead_elsewhere;
    for (int peer : peers) {
      if (shm_support::PidfdExited(pidfds_[peer])) {
        dead.push_back(peer);
      } else if (segment_->control(peer)->state.load(std::memory_order_acquire) != kLive) {
        left.push_back(peer);
      }
    }
    // A peer waited for that left in reaction to another's death: that death is the cause.
    for (int p = 0; p < size_ && dead.empty() && !left.empty(); ++p) {
      if (p != rank_ && shm_support::PidfdExited(pidfds_[p])) dead_elsewhere.push_back(p);
    }
    if (!dead_elsewhere.empty()) dead = dead_elsewhere;
    if (!dead.empty()) {
      return UnavailableError(what + ": peer rank(s) " + Ranks(dead) + " exited (shared memory)")
          .WithCollectiveFailure({CollectiveFailure::Kind::kPeerClosed, dead, ""});
    }
    if (!left.empty()) {
      return UnavailableError(what + ": peer rank(s) " + Ranks(left) +
                              " aborted, failed or destroyed their communicator (shared memory)")
          .WithCollectiveFailure({CollectiveFailure::Kind::kPeerClosed, left, ""});
    }
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      return DeadlineExceededError(what + ": did not finish in " +
                                   std::to_string(timeout.count()) + " ms: waiting for rank(s) " +
                                   Ranks(peers) + " (shared memory)")
          .WithCollectiveFailure({CollectiveFailure::Kind::kTimeout, {}, ""});
    }
    const uint32_t bell = me->p2p_doorbell.load(std::memory_order_acquire);
    me->p2p_waiting.store(1, std::memory_order_seq_cst);
    if (!can_progress() && !failed_.load(std::memory_order_acquire)) {
      shm_support::FutexWait(&me->p2p_doorbell, bell,
                             std::min<Clock::duration>(kPollSlice, deadline - now));
    }
    me->p2p_waiting.store(0, std::memory_order_relaxed);
  }
}

}  // namespace morph
