#include "collectives/shm/shm_collectives.h"

#include "collectives/op_signature.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "collectives/shm/shm_layout.h"
#include "collectives/shm/shm_support.h"

namespace morph {
namespace {

using shm_support::CpuRelax;
using shm_support::RingDoorbell;
using Clock = std::chrono::steady_clock;
using shm_layout::Control;
using shm_layout::kClosed;
using shm_layout::kLeft;
using shm_layout::kLive;
using shm_layout::kMagic;
using shm_layout::kPollSlice;

// Options::spin's automatic value when the host has a core for every rank.
constexpr auto kAutoSpin = std::chrono::microseconds(20);

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

StatusOr<std::unique_ptr<ShmCollectives>> ShmCollectives::Create(int rank, int size,
                                                                 const Options& options,
                                                                 const std::string& what,
                                                                 const Allgather& allgather,
                                                                 std::string* why_not) {
  std::unique_ptr<ShmCollectives> shm(new ShmCollectives());
  shm->rank_ = rank;
  shm->size_ = size;
  if (options.spin.count() >= 0) {
    shm->spin_ = options.spin;
  } else {
    // Spinning only pays when the peers have cores to arrive on meanwhile.
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    const int n = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    shm->spin_ = size <= n ? kAutoSpin : std::chrono::microseconds(0);
  }
  shm->yield_ = std::max(options.yield, std::chrono::microseconds(0));
  shm->what_ = what;
  const size_t bytes = Segment::Bytes(size);
  std::string name;  // rank 0's, while it may still have to unlink it
  auto unlink_name = [&] {
    if (!name.empty()) shm_unlink(name.c_str());
    name.clear();
  };

  // 1. Who is on this host and willing; rank 0 creates the segment meanwhile.
  struct Hello {
    uint64_t host;
    int64_t pid;
    uint32_t enabled;
    uint32_t created;
    char name[48];
  };
  Hello mine{shm_support::HostIdentity(), getpid(), options.enable ? 1u : 0u, 0, {}};
  std::string local_why;
  if (rank == 0 && options.enable) {
    std::random_device rd;
    std::snprintf(mine.name, sizeof(mine.name), "/morph-coll-%d-%08x%08x",
                  static_cast<int>(getpid()), rd(), rd());
    const int fd = shm_open(mine.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    void* map = MAP_FAILED;
    if (fd >= 0) {
      name = mine.name;
      if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
        map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      }
      close(fd);
    }
    if (map == MAP_FAILED) {
      local_why = std::string(": ") + std::strerror(errno);
      unlink_name();
    } else {
      shm->segment_ = static_cast<Segment*>(map);
      shm->segment_bytes_ = bytes;
      shm->segment_->magic = kMagic;
      shm->segment_->size = size;
      shm->segment_->slot_bytes = static_cast<uint32_t>(kSlotBytes);
      shm->segment_->chunk_bytes = static_cast<uint32_t>(ChunkBytes(size));
      mine.created = 1;
    }
  }
  std::vector<Hello> hellos(static_cast<size_t>(size));
  Status s = allgather(&mine, hellos.data(), sizeof(Hello));
  if (!s.ok()) {
    unlink_name();
    return s.WithContext(what + ": exchanging host identities for shared memory");
  }
  std::string why;
  for (int r = 0; r < size && why.empty(); ++r) {
    if (!hellos[r].enabled) why = "shared memory disabled on rank " + std::to_string(r);
  }
  for (int r = 0; r < size && why.empty(); ++r) {
    if (hellos[r].host != mine.host) {
      why = "rank " + std::to_string(r) + " is on another host (or PID namespace, or user)";
    }
  }
  if (why.empty() && !hellos[0].created) {
    why = "rank 0 could not create a shared-memory segment" + local_why;
  }
  if (!why.empty()) {
    unlink_name();
    *why_not = why;
    return std::unique_ptr<ShmCollectives>();
  }

  // 2. Everyone maps rank 0's segment and opens pidfds of the peers in other processes.
  uint8_t ok = 1;
  if (rank != 0) {
    hellos[0].name[sizeof(hellos[0].name) - 1] = '\0';
    const int fd = shm_open(hellos[0].name, O_RDWR, 0);
    if (fd >= 0) {
      void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (map != MAP_FAILED) {
        shm->segment_ = static_cast<Segment*>(map);
        shm->segment_bytes_ = bytes;
      }
    }
    if (shm->segment_ == nullptr) {
      ok = 0;
      local_why = std::string("cannot map ") + hellos[0].name + ": " + std::strerror(errno) +
                  " (no shared /dev/shm?)";
    } else if (shm->segment_->magic != kMagic || shm->segment_->size != size ||
               shm->segment_->slot_bytes != kSlotBytes ||
               shm->segment_->chunk_bytes != ChunkBytes(size)) {
      ok = 0;
      local_why = std::string("segment ") + hellos[0].name + " has an unexpected header";
    }
  }
  shm->pidfds_.assign(static_cast<size_t>(size), -1);
  shm->pids_.assign(static_cast<size_t>(size), 0);
  for (int r = 0; r < size && ok; ++r) {
    shm->pids_[r] = static_cast<pid_t>(hellos[r].pid);
    if (r == rank || hellos[r].pid == mine.pid) continue;  // ranks as threads of one process
    shm->pidfds_[r] = shm_support::PidfdOpen(shm->pids_[r]);
    if (shm->pidfds_[r] < 0) {
      ok = 0;
      local_why = "pidfd_open(" + std::to_string(hellos[r].pid) + ") of rank " + std::to_string(r) +
                  " failed: " + std::strerror(errno) + " (needed to notice a peer's death)";
    }
  }
  std::vector<uint8_t> oks(static_cast<size_t>(size));
  s = allgather(&ok, oks.data(), 1);
  unlink_name();  // every rank has mapped it or given up
  if (!s.ok()) return s.WithContext(what + ": agreeing on shared memory");
  for (int r = 0; r < size; ++r) {
    if (oks[r]) continue;
    *why_not = "rank " + std::to_string(r) + " cannot use the shared-memory segment" +
               (r == rank ? ": " + local_why : "");
    return std::unique_ptr<ShmCollectives>();
  }
  shm->segment_->control(rank)->pid = static_cast<int32_t>(mine.pid);
  return shm;
}

ShmCollectives::~ShmCollectives() {
  for (int fd : pidfds_) {
    if (fd >= 0) close(fd);
  }
  if (segment_ != nullptr) munmap(segment_, segment_bytes_);
}

uint8_t* ShmCollectives::Data(int rank, uint64_t seq) const { return segment_->data(rank, seq); }

bool ShmCollectives::Fits(const CollectiveOp& op) const {
  const size_t bytes = op.count * DTypeSize(op.dtype);
  switch (op.kind) {
    case CollectiveOp::Kind::kBarrier:
      return true;
    case CollectiveOp::Kind::kAllreduce:
    case CollectiveOp::Kind::kBroadcast:
    case CollectiveOp::Kind::kAllgather:
      return bytes <= kSlotBytes;
    case CollectiveOp::Kind::kReduceScatter:
      return bytes * static_cast<size_t>(size_) <= kSlotBytes;
    case CollectiveOp::Kind::kSendRecv:
      return false;
  }
  return false;
}

bool ShmCollectives::Handles(const CollectiveOp& op) const {
  switch (op.kind) {
    case CollectiveOp::Kind::kBarrier:
      return true;
    case CollectiveOp::Kind::kAllreduce:
    case CollectiveOp::Kind::kBroadcast:
    case CollectiveOp::Kind::kAllgather:
    case CollectiveOp::Kind::kReduceScatter:
      return op.count > 0 && (size_ <= kLargeMaxRanks || Fits(op));
    case CollectiveOp::Kind::kSendRecv:
      return false;
  }
  return false;
}

Status ShmCollectives::Agree(const CollectiveOp& op, std::string_view kind) {
  const uint64_t k = ++seq_;
  const Clock::time_point deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(op.timeout, std::chrono::hours(24 * 365));
  const OpSignature mine = OpSignature::Of(op);
  segment_->control(rank_)->signature[k & 1] = mine;
  Publish(k);
  MORPH_RETURN_IF_ERROR(WaitForPeers(k, -1, deadline, op.timeout, kind));
  return Compare(k, mine, kind);
}

Status ShmCollectives::Compare(uint64_t k, const OpSignature& mine, std::string_view kind) const {
  for (int p = 0; p < size_; ++p) {
    const OpSignature& theirs = segment_->control(p)->signature[k & 1];
    if (p != rank_ && !(theirs == mine)) {
      return DisagreementError(what_ + ": " + std::string(kind), p, theirs, rank_, mine);
    }
  }
  return Status::Ok();
}

Status ShmCollectives::Run(const CollectiveOp& op, gloo_algorithms::Workspace& workspace,
                           std::string_view kind) {
  if (!Fits(op)) return RunLarge(op, workspace, kind);
  const uint64_t k = ++seq_;
  const size_t bytes = op.count * DTypeSize(op.dtype);
  // Clamped so that the sum cannot overflow (a year is "for ever" here).
  const Clock::time_point deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(op.timeout, std::chrono::hours(24 * 365));
  // Buffer k mod 2 last held operation k - 2, which every peer has read: each published
  // k - 1 (this rank's wait of k - 1 saw it), which it does only once done with k - 2.
  const bool root = op.kind == CollectiveOp::Kind::kBroadcast && rank_ == op.root;
  uint8_t* mine = Data(rank_, k);
  switch (op.kind) {
    case CollectiveOp::Kind::kAllreduce:
      std::memcpy(mine, op.recv, bytes);
      break;
    case CollectiveOp::Kind::kAllgather:
      std::memcpy(mine, op.send, bytes);
      break;
    case CollectiveOp::Kind::kReduceScatter:
      std::memcpy(mine, op.send, bytes * static_cast<size_t>(size_));
      break;
    case CollectiveOp::Kind::kBroadcast:
      if (root) std::memcpy(mine, op.recv, bytes);
      break;
    case CollectiveOp::Kind::kBarrier:
    case CollectiveOp::Kind::kSendRecv:
      break;
  }
  const OpSignature signature = OpSignature::Of(op);
  segment_->control(rank_)->signature[k & 1] = signature;
  Publish(k);
  // Every rank waits for every peer, a broadcast's root too: all of them compare the calls
  // (op_signature.h), so that ranks whose calls differ all fail, before any byte is read.
  MORPH_RETURN_IF_ERROR(WaitForPeers(k, -1, deadline, op.timeout, kind));
  MORPH_RETURN_IF_ERROR(Compare(k, signature, kind));
  switch (op.kind) {
    case CollectiveOp::Kind::kAllreduce:
    case CollectiveOp::Kind::kReduceScatter: {
      const size_t offset = op.kind == CollectiveOp::Kind::kAllreduce ? 0 : bytes * rank_;
      std::vector<const uint8_t*> pieces(static_cast<size_t>(size_));
      for (int p = 0; p < size_; ++p) pieces[p] = Data(p, k) + offset;
      gloo_algorithms::ReduceInRankOrder(workspace, pieces, op.count, op.dtype, op.reduce, op.recv);
      break;
    }
    case CollectiveOp::Kind::kAllgather:
      for (int p = 0; p < size_; ++p) {
        std::memcpy(static_cast<uint8_t*>(op.recv) + bytes * p, Data(p, k), bytes);
      }
      break;
    case CollectiveOp::Kind::kBroadcast:
      if (!root) std::memcpy(op.recv, Data(op.root, k), bytes);
      break;
    case CollectiveOp::Kind::kBarrier:
    case CollectiveOp::Kind::kSendRecv:
      break;
  }
  return Status::Ok();
}

void ShmCollectives::Publish(uint64_t seq) {
  // seq_cst with the waiter's `waiting` store and seq loads (WaitForPeers): either the waiter
  // sees the new seq before it sleeps, or this sees it waiting and rings. A sleeper is rung
  // only once what it waits for is complete: of several publishers finishing together the
  // last one in the seq_cst order sees all their seqs. Waking it at every publish instead
  // costs a context switch each on a shared core (a root waiting for a full ring's readers
  // was woken at every one of their operations). Taking the flag makes this the one ring for
  // that sleep (a root running ahead would otherwise ring a woken peer at every broadcast
  // until it runs).
  segment_->control(rank_)->seq.store(seq, std::memory_order_seq_cst);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Control* c = segment_->control(p);
    if (c->waiting.load(std::memory_order_seq_cst) == 0) continue;
    const uint64_t target = c->wait_seq.load(std::memory_order_relaxed);
    const int only = c->wait_only.load(std::memory_order_relaxed);
    bool complete = true;
    for (int q = 0; q < size_ && complete; ++q) {
      complete = q == p || (only >= 0 && q != only) ||
                 segment_->control(q)->seq.load(std::memory_order_seq_cst) >= target;
    }
    if (complete && c->waiting.exchange(0, std::memory_order_seq_cst) != 0) {
      RingDoorbell(&c->doorbell);
    }
  }
}

bool ShmCollectives::Published(uint64_t seq, int only) const {
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && (only < 0 || p == only) &&
        segment_->control(p)->seq.load(std::memory_order_seq_cst) < seq) {
      return false;
    }
  }
  return true;
}

Status ShmCollectives::WaitForPeers(uint64_t seq, int only, Clock::time_point deadline,
                                    std::chrono::milliseconds timeout, std::string_view kind) {
  auto what = [&] { return what_ + ": " + std::string(kind); };
  auto ready = [&] { return Published(seq, only); };
  if (ready()) return Status::Ok();
  const Clock::time_point spin_end = Clock::now() + spin_;
  for (uint32_t i = 1; spin_.count() > 0 && !failed_.load(std::memory_order_relaxed); ++i) {
    if (ready()) return Status::Ok();
    CpuRelax();
    if (i % 64 == 0 && Clock::now() >= spin_end) break;
  }
  const Clock::time_point yield_end = Clock::now() + yield_;
  while (yield_.count() > 0 && !failed_.load(std::memory_order_relaxed)) {
    sched_yield();
    if (ready()) return Status::Ok();
    if (Clock::now() >= yield_end) break;
  }
  Control* me = segment_->control(rank_);
  for (;;) {
    if (failed_.load(std::memory_order_acquire)) {
      return AbortedError(what() + ": aborted while waiting in shared memory")
          .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}, ""});
    }
    if (ready()) return Status::Ok();
    MORPH_RETURN_IF_ERROR(PeerFailure(seq, only, kind));
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      std::vector<int> late;
      for (int p = 0; p < size_; ++p) {
        if (p != rank_ && (only < 0 || p == only) &&
            segment_->control(p)->seq.load(std::memory_order_acquire) < seq) {
          late.push_back(p);
        }
      }
      return DeadlineExceededError(what() + ": did not finish in " +
                                   std::to_string(timeout.count()) + " ms: rank(s) " +
                                   RankList(late) + " had not arrived (shared memory)")
          .WithCollectiveFailure({CollectiveFailure::Kind::kTimeout, {}, ""});
    }
    const uint32_t bell = me->doorbell.load(std::memory_order_acquire);
    me->wait_seq.store(seq, std::memory_order_relaxed);
    me->wait_only.store(only, std::memory_order_relaxed);
    me->waiting.store(1, std::memory_order_seq_cst);  // publishes the two above with it
    if (!ready() && !failed_.load(std::memory_order_acquire)) {
      shm_support::FutexWait(&me->doorbell, bell,
                             std::min<Clock::duration>(kPollSlice, deadline - now));
    }
    me->waiting.store(0, std::memory_order_relaxed);
  }
}

Status ShmCollectives::PeerFailure(uint64_t seq, int only, std::string_view kind) const {
  auto what = [&] { return what_ + ": " + std::string(kind); };
  // A peer that exited is the cause; one that left (failed, aborted, destroyed) may have left
  // in reaction to it, so it is named only when no peer is dead.
  std::vector<int> dead, left;
  bool dead_blocks = false, closed = false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Control* c = segment_->control(p);
    const uint32_t state = c->state.load(std::memory_order_acquire);
    const bool blocks = (only < 0 || p == only) && c->seq.load(std::memory_order_acquire) < seq;
    if (shm_support::PidfdExited(pidfds_[p])) {
      dead.push_back(p);
      dead_blocks = dead_blocks || blocks;
    } else if (state != kLive && blocks) {
      left.push_back(p);
      closed = closed || state == kClosed;
    }
  }
  // A dead peer that already published this operation fails only the next one, unless a peer
  // that left in reaction to its death blocks this one.
  if (!dead.empty() && (dead_blocks || !left.empty())) {
    std::string pids;
    for (int p : dead) pids += (pids.empty() ? "" : ", ") + std::to_string(pids_[p]);
    return UnavailableError(what() + ": peer rank(s) " + RankList(dead) + " (pid " + pids +
                            ") exited (shared memory)")
        .WithCollectiveFailure({CollectiveFailure::Kind::kPeerClosed, dead, ""});
  }
  if (!left.empty()) {
    return UnavailableError(
               what() + ": peer rank(s) " + RankList(left) +
               (closed ? " destroyed their communicator or failed" : " aborted or failed") +
               " before this operation (shared memory)")
        .WithCollectiveFailure({CollectiveFailure::Kind::kPeerClosed, left, ""});
  }
  return Status::Ok();
}

void ShmCollectives::SetState(uint32_t state) {
  uint32_t live = kLive;
  segment_->control(rank_)->state.compare_exchange_strong(live, state, std::memory_order_acq_rel);
  for (int p = 0; p < size_; ++p) {
    RingDoorbell(&segment_->control(p)->doorbell);
    RingDoorbell(&segment_->control(p)->p2p_doorbell);
  }
}

void ShmCollectives::Fail() {
  failed_.store(true, std::memory_order_release);
  SetState(kLeft);  // also rings this rank's own doorbell: its waiter returns now
}

void ShmCollectives::Close() { SetState(kClosed); }

}  // namespace morph
