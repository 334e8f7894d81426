#include "collectives/shm/shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include "base/logging.h"
#include "collectives/shm/shm_support.h"
#include "reshard/strided_copy.h"

namespace morph {
namespace {

constexpr uint64_t kMagic = 0x326d7368'70726f6dull;  // "morphsm2"
constexpr uint64_t kRing = 16;                       // descriptors in flight per direction
constexpr int kMaxIov = 1024;                        // IOV_MAX
constexpr size_t kMaxBatchBytes = size_t{64} << 20;  // per process_vm_readv call
constexpr auto kPollInterval = std::chrono::milliseconds(20);

}  // namespace

// A message as the sender describes it to the receiver (lives in the sender's mailbox).
struct ShmChannel::Descriptor {
  uint64_t seq;
  uint64_t tag;
  uint64_t bytes;
  uint64_t base;  // sender's address
  int32_t strided;
  int32_t elem_size;
  int64_t begin;
  int64_t end;
  CopyGeometry geometry;
  // The sender's ShmArena segment holding the message (seg_fd < 0: none; read by
  // process_vm_readv): its fd in the sender, memfd inode, address and size in the sender.
  int32_t seg_fd;
  int32_t pad;
  uint64_t seg_inode;
  uint64_t seg_base;
  uint64_t seg_size;
};

namespace {
using Descriptor = ShmChannel::Descriptor;

// One direction of one pair: written by the sender (descriptors, posted) and by the receiver
// (consumed).
struct alignas(64) Ring {
  std::atomic<uint64_t> posted;
  char pad0[56];
  std::atomic<uint64_t> consumed;
  char pad1[56];
  Descriptor slots[kRing];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

using shm_support::FutexWait;
using shm_support::HostIdentity;
using shm_support::ReadFirstLine;
using shm_support::RingDoorbell;

// The byte runs of a message in one process's memory, in message order.
class Runs {
 public:
  Runs(uint64_t base, size_t bytes, bool strided, const CopyGeometry& g, bool src_side, int es,
       int64_t begin, int64_t end)
      : base_(base),
        bytes_(bytes),
        strided_(strided),
        g_(g),
        src_(src_side),
        es_(es),
        pos_(begin),
        end_(end) {
    if (!strided_) return;
    row_index_ = begin / std::max<int64_t>(1, g_.row);
    int64_t rem = row_index_;
    for (int k = g_.outer_rank - 1; k >= 0; --k) {
      idx_[k] = rem % g_.outer_shape[k];
      rem /= g_.outer_shape[k];
    }
  }
  // The next run, or false at the end.
  bool Next(uint64_t* addr, size_t* len) {
    if (!strided_) {
      if (done_ || bytes_ == 0) return false;
      done_ = true;
      *addr = base_;
      *len = bytes_;
      return true;
    }
    if (pos_ >= end_) return false;
    int64_t off = src_ ? g_.src_offset : g_.dst_offset;
    for (int k = 0; k < g_.outer_rank; ++k)
      off += idx_[k] * (src_ ? g_.src_stride : g_.dst_stride)[k];
    const int64_t row_begin = row_index_ * g_.row;
    const int64_t n = std::min(end_, row_begin + g_.row) - pos_;
    *addr = base_ + static_cast<uint64_t>((off + pos_ - row_begin) * es_);
    *len = static_cast<size_t>(n * es_);
    pos_ += n;
    ++row_index_;
    for (int k = g_.outer_rank - 1; k >= 0; --k) {
      if (++idx_[k] < g_.outer_shape[k]) break;
      idx_[k] = 0;
    }
    return true;
  }

 private:
  uint64_t base_;
  size_t bytes_;
  bool strided_;
  CopyGeometry g_;
  bool src_;
  int64_t es_;
  int64_t pos_, end_;
  int64_t row_index_ = 0;
  int64_t idx_[kMaxCopyDims] = {};
  bool done_ = false;
};

}  // namespace

struct ShmChannel::Mailbox {
  uint64_t magic;
  int32_t pid;
  int32_t num_rings;
  alignas(64) std::atomic<uint32_t> aborted;
  alignas(64) std::atomic<uint32_t> doorbell;
  alignas(64) char rings_start[1];  // Ring rings[num_rings] from here (Ring is 64-aligned)

  ::morph::Ring* ring(int i) { return reinterpret_cast<::morph::Ring*>(rings_start) + i; }
  static size_t SizeFor(int rings) {
    return offsetof(Mailbox, rings_start) + sizeof(::morph::Ring) * static_cast<size_t>(rings);
  }
};

struct ShmChannel::Peer {
  int rank = 0;
  pid_t pid = 0;
  int pidfd = -1;
  Mailbox* mailbox = nullptr;  // the peer's, mapped here
  size_t mailbox_size = 0;
  ::morph::Ring* out = nullptr;  // in our mailbox: our messages to the peer
  ::morph::Ring* in = nullptr;   // in its mailbox: its messages to us
  std::deque<Descriptor> unpublished;
  uint64_t sends_posted = 0;
  uint64_t published = 0;
  std::deque<MessageRegion> recvs;  // posted, not yet done
  uint64_t recvs_posted = 0;
  uint64_t received = 0;
  // The peer's segments mapped here (read-only) during a Wait; dropped when no receive from the
  // peer is pending, so a freed segment's pages are never kept.
  struct Mapping {
    uint64_t inode;
    uint64_t base;  // in the peer
    uint64_t size;
    const char* map;
  };
  std::vector<Mapping> mappings;
  bool getfd_refused = false;  // pidfd_getfd failed once: process_vm_readv from then on

  void DropMappings() {
    for (const Mapping& m : mappings) munmap(const_cast<char*>(m.map), m.size);
    mappings.clear();
  }
  ~Peer() {
    DropMappings();
    if (pidfd >= 0) close(pidfd);
    if (mailbox != nullptr) munmap(mailbox, mailbox_size);
  }
};

StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Create(Communicator& comm, bool enable,
                                                         Deadline deadline, const ShmArena* arena) {
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  ch->arena_ = arena;
  const int n = comm.size(), me = comm.rank();
  ch->rank_ = me;
  ch->name_ = "shm channel (rank " + std::to_string(me) + " of " + std::to_string(n) + ")";
  ch->slot_of_.assign(static_cast<size_t>(n), -1);
  if (!enable) {
    ch->why_ = "shared memory disabled";
    return ch;
  }
  if (n == 1) return ch;
  auto timeout = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline.Remaining()));
  };
  LogContext log("shm");
  log.Set(comm.generation(), me, n);

  // 1. Who shares this host (kernel, PID namespace, user)?
  struct Identity {
    uint64_t host;
    int64_t pid;
  };
  Identity mine{HostIdentity(), getpid()};
  std::vector<Identity> ids(static_cast<size_t>(n));
  MORPH_RETURN_IF_ERROR(comm.Allgather(&mine, ids.data(), sizeof(Identity), DType::kU8, timeout()))
      << "shm channel: exchanging host identities";
  std::vector<int> group;  // same-host ranks, this one included, ascending
  for (int r = 0; r < n; ++r) {
    if (ids[static_cast<size_t>(r)].host == mine.host) group.push_back(r);
  }
  const int gsize = static_cast<int>(group.size());
  auto pos_in_group = [&](int r) {
    return static_cast<int>(std::lower_bound(group.begin(), group.end(), r) - group.begin());
  };
  // Ring index of `to` in `from`'s mailbox: `to`'s place among the group without `from`.
  auto ring_index = [&](int from, int to) {
    const int p = pos_in_group(to);
    return p - (pos_in_group(from) < p ? 1 : 0);
  };

  // 2. Mailboxes: each creates its own, publishes its name and address.
  struct Address {
    char name[56];
    uint64_t mailbox;
  };
  Address my_addr{};
  std::string why;
  if (gsize > 1) {
    std::random_device rd;
    std::snprintf(my_addr.name, sizeof(my_addr.name), "/morph-shm-%d-%08x%08x",
                  static_cast<int>(getpid()), rd(), rd());
    const size_t size = Mailbox::SizeFor(gsize - 1);
    const int fd = shm_open(my_addr.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    void* map = MAP_FAILED;
    if (fd >= 0) {
      if (ftruncate(fd, static_cast<off_t>(size)) == 0) {
        map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      }
      close(fd);
    }
    if (map == MAP_FAILED) {
      why = std::string("creating a shared-memory mailbox failed: ") + std::strerror(errno);
      if (fd >= 0) shm_unlink(my_addr.name);
      my_addr.name[0] = '\0';
    } else {
      ch->own_ = static_cast<Mailbox*>(map);
      ch->own_size_ = size;
      ch->own_->magic = kMagic;
      ch->own_->pid = static_cast<int32_t>(getpid());
      ch->own_->num_rings = gsize - 1;
      my_addr.mailbox = reinterpret_cast<uint64_t>(ch->own_);
    }
  }
  std::vector<Address> addrs(static_cast<size_t>(n));
  Status s = comm.Allgather(&my_addr, addrs.data(), sizeof(Address), DType::kU8, timeout());
  if (!s.ok() && my_addr.name[0] != '\0') shm_unlink(my_addr.name);
  MORPH_RETURN_IF_ERROR(s) << "shm channel: exchanging mailbox names";

  // 3. Open the peers' mailboxes and probe process_vm_readv on them; agree on who is local.
  std::vector<std::unique_ptr<Peer>> peers;
  uint8_t ok = gsize > 1 && ch->own_ != nullptr ? 1 : 0;
  if (gsize == 1) why = "no other rank on this host";
  for (int r : group) {
    if (r == me || !ok) continue;
    const Address& a = addrs[static_cast<size_t>(r)];
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->pid = static_cast<pid_t>(ids[static_cast<size_t>(r)].pid);
    const size_t size = Mailbox::SizeFor(gsize - 1);
    const int fd = a.name[0] != '\0' ? shm_open(a.name, O_RDWR, 0) : -1;
    if (fd >= 0) {
      void* map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (map != MAP_FAILED) {
        p->mailbox = static_cast<Mailbox*>(map);
        p->mailbox_size = size;
      }
    }
    if (p->mailbox == nullptr || p->mailbox->magic != kMagic) {
      ok = 0;
      why = "cannot open rank " + std::to_string(r) + "'s shared-memory mailbox " + a.name + ": " +
            std::strerror(errno) + " (no shared /dev/shm?)";
      break;
    }
    uint64_t probe = 0;
    iovec local{&probe, sizeof(probe)};
    iovec remote{reinterpret_cast<void*>(a.mailbox), sizeof(probe)};
    if (process_vm_readv(p->pid, &local, 1, &remote, 1, 0) != sizeof(probe) || probe != kMagic) {
      ok = 0;
      const std::string scope = ReadFirstLine("/proc/sys/kernel/yama/ptrace_scope");
      why = "process_vm_readv of rank " + std::to_string(r) + " (pid " + std::to_string(p->pid) +
            ") failed: " + std::strerror(errno) +
            (scope.empty() ? "" : " (kernel.yama.ptrace_scope = " + scope + ")");
      break;
    }
    p->pidfd = static_cast<int>(syscall(SYS_pidfd_open, p->pid, 0));
    p->out = ch->own_->ring(ring_index(me, r));
    p->in = p->mailbox->ring(ring_index(r, me));
    peers.push_back(std::move(p));
  }
  std::vector<uint8_t> oks(static_cast<size_t>(n));
  s = comm.Allgather(&ok, oks.data(), 1, DType::kU8, timeout());
  // Every peer has opened this mailbox (or given up): the name can go.
  if (my_addr.name[0] != '\0') shm_unlink(my_addr.name);
  MORPH_RETURN_IF_ERROR(s) << "shm channel: agreeing on local peers";
  if (ok) {
    for (auto& p : peers) {
      if (!oks[static_cast<size_t>(p->rank)]) {
        if (why.empty()) why = "rank " + std::to_string(p->rank) + " cannot use shared memory";
        continue;
      }
      ch->slot_of_[static_cast<size_t>(p->rank)] = static_cast<int>(ch->local_.size());
      ch->local_.push_back(std::move(p));
    }
  }
  ch->why_ = why;
  if (ch->local_.empty() && ch->own_ != nullptr) {
    munmap(ch->own_, ch->own_size_);
    ch->own_ = nullptr;
  }
  MORPH_LOG(INFO, log) << "reshard transport: " << ch->local_.size() << " of " << gsize - 1
                       << " same-host peers by cross-memory attach, " << n - 1 - ch->local_.size()
                       << " by TCP" << (why.empty() ? "" : "; " + why);
  return ch;
}

ShmChannel::~ShmChannel() {
  local_.clear();
  if (own_ != nullptr) munmap(own_, own_size_);
}

bool ShmChannel::IsLocal(int peer) const {
  return peer >= 0 && peer < static_cast<int>(slot_of_.size()) &&
         slot_of_[static_cast<size_t>(peer)] >= 0;
}

ShmHandle ShmChannel::PostSend(int peer, const MessageRegion& r) {
  Peer& p = *local_[static_cast<size_t>(slot_of_[static_cast<size_t>(peer)])];
  Descriptor d{};
  d.seq = p.sends_posted++;
  d.tag = r.tag;
  d.bytes = r.bytes;
  d.base = reinterpret_cast<uint64_t>(r.base);
  d.strided = r.strided ? 1 : 0;
  d.elem_size = r.elem_size;
  d.begin = r.begin;
  d.end = r.end;
  d.geometry = r.geometry;
  d.seg_fd = -1;
  if (arena_ != nullptr) {
    if (std::optional<ShmArena::Segment> seg = arena_->Find(r.base)) {
      d.seg_fd = seg->fd;
      d.seg_inode = seg->inode;
      d.seg_base = seg->base;
      d.seg_size = seg->size;
    }
  }
  p.unpublished.push_back(d);
  (void)Publish(p);
  return {peer, d.seq};
}

ShmHandle ShmChannel::PostRecv(int peer, const MessageRegion& r) {
  Peer& p = *local_[static_cast<size_t>(slot_of_[static_cast<size_t>(peer)])];
  p.recvs.push_back(r);
  return {peer, p.recvs_posted++};
}

Status ShmChannel::Publish(Peer& p) {
  bool any = false;
  while (!p.unpublished.empty() &&
         p.published - p.out->consumed.load(std::memory_order_acquire) < kRing) {
    p.out->slots[p.published % kRing] = p.unpublished.front();
    p.unpublished.pop_front();
    p.out->posted.store(++p.published, std::memory_order_release);
    any = true;
  }
  if (any) RingDoorbell(&p.mailbox->doorbell);
  return Status::Ok();
}

Status ShmChannel::PeerFailure(const Peer& p) const {
  if (p.pidfd >= 0) {
    pollfd pfd{p.pidfd, POLLIN, 0};
    if (poll(&pfd, 1, 0) > 0) {
      return UnavailableError(name_ + ": peer rank " + std::to_string(p.rank) + " (pid " +
                              std::to_string(p.pid) + ") exited")
          .WithCollectiveFailure({CollectiveFailure::Kind::kPeerClosed, {p.rank}});
    }
  }
  // The peer names itself, so the caller can tell whom (status.failed_peers()).
  if (p.mailbox->aborted.load(std::memory_order_acquire) != 0) {
    return AbortedError(name_ + ": peer rank " + std::to_string(p.rank) + " aborted")
        .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {p.rank}});
  }
  return Status::Ok();
}

Status ShmChannel::Fail(Status s) {
  Abort();
  return s;
}

void ShmChannel::Abort() {
  if (own_ == nullptr) return;
  own_->aborted.store(1, std::memory_order_release);
  RingDoorbell(&own_->doorbell);
  for (auto& p : local_) RingDoorbell(&p->mailbox->doorbell);
}

// Copies the next message from the peer (its descriptor must be posted) into the oldest posted
// receive, with process_vm_readv from the sender's layout into ours.
Status ShmChannel::ReceiveNext(Peer& p) {
  const MessageRegion& r = p.recvs.front();
  const Descriptor d = p.in->slots[p.received % kRing];
  const std::string what =
      name_ + ": message " + std::to_string(p.received) + " from rank " + std::to_string(p.rank);
  if (d.seq != p.received) {
    return InternalError(what + ": descriptor carries sequence " + std::to_string(d.seq));
  }
  if (d.bytes != r.bytes) {
    return InternalError(what + ": peer sends " + std::to_string(d.bytes) +
                         " bytes, this rank receives " + std::to_string(r.bytes));
  }
  if (d.tag != r.tag) {
    return FailedPreconditionError(what + ": message tag " + std::to_string(d.tag) +
                                   ", the receive posted here expects " + std::to_string(r.tag) +
                                   " (the two sides run different plans or steps)");
  }
  const auto copy_start = std::chrono::steady_clock::now();
  auto copied = [&] {
    stats_.copy_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
  };
  Runs local(reinterpret_cast<uint64_t>(r.base), r.bytes, r.strided, r.geometry,
             /*src_side=*/false, r.elem_size, r.begin, r.end);
  Runs remote(d.base, d.bytes, d.strided != 0, d.geometry, /*src_side=*/true, d.elem_size, d.begin,
              d.end);
  if (const char* map = d.seg_fd >= 0 ? MapSegment(p, d) : nullptr) {
    // The sender's segment is mapped here: plain copies, run by run. A large message streams
    // (non-temporal stores) whatever its runs' sizes: a strided one of 2 KiB rows too.
    const bool stream = r.bytes >= kStreamingCopyMinBytes;
    uint64_t lp = 0, rp = 0;
    size_t ll = 0, rl = 0, done = 0;
    while (done < r.bytes) {
      if (ll == 0 && !local.Next(&lp, &ll)) break;
      if (rl == 0 && !remote.Next(&rp, &rl)) break;
      const size_t t = std::min(ll, rl);
      if (rp < d.seg_base || rp - d.seg_base > d.seg_size || t > d.seg_size - (rp - d.seg_base)) {
        return InternalError(what + ": bytes at sender address " + std::to_string(rp) +
                             " lie outside its segment [" + std::to_string(d.seg_base) + ", +" +
                             std::to_string(d.seg_size) + ")");
      }
      if (stream) {
        StreamCopy(reinterpret_cast<void*>(lp), map + (rp - d.seg_base), t);
      } else {
        std::memcpy(reinterpret_cast<void*>(lp), map + (rp - d.seg_base), t);
      }
      lp += t, ll -= t, rp += t, rl -= t, done += t;
    }
    if (stream) StoreFence();
    if (done != r.bytes) {
      return InternalError(what + ": layouts cover fewer bytes than the message's " +
                           std::to_string(r.bytes));
    }
    copied();
    ++stats_.mapped_messages;
    stats_.mapped_bytes += r.bytes;
    return FinishReceive(p, what);
  }
  iovec liov[kMaxIov], riov[kMaxIov];
  uint64_t lp = 0, rp = 0;
  size_t ll = 0, rl = 0, done = 0;
  while (done < r.bytes) {
    int ln = 0, rn = 0;
    size_t batch = 0;
    while (done + batch < r.bytes && batch < kMaxBatchBytes) {
      if (ll == 0 && !local.Next(&lp, &ll)) break;
      if (rl == 0 && !remote.Next(&rp, &rl)) break;
      const size_t t = std::min({ll, rl, kMaxBatchBytes - batch});
      const bool l_ext =
          ln > 0 && reinterpret_cast<uint64_t>(liov[ln - 1].iov_base) + liov[ln - 1].iov_len == lp;
      const bool r_ext =
          rn > 0 && reinterpret_cast<uint64_t>(riov[rn - 1].iov_base) + riov[rn - 1].iov_len == rp;
      if ((!l_ext && ln == kMaxIov) || (!r_ext && rn == kMaxIov)) break;
      if (l_ext) {
        liov[ln - 1].iov_len += t;
      } else {
        liov[ln++] = {reinterpret_cast<void*>(lp), t};
      }
      if (r_ext) {
        riov[rn - 1].iov_len += t;
      } else {
        riov[rn++] = {reinterpret_cast<void*>(rp), t};
      }
      lp += t, ll -= t, rp += t, rl -= t, batch += t;
    }
    if (batch == 0) {
      return InternalError(what + ": layouts cover fewer bytes than the message's " +
                           std::to_string(r.bytes));
    }
    const ssize_t got = process_vm_readv(p.pid, liov, static_cast<unsigned long>(ln), riov,
                                         static_cast<unsigned long>(rn), 0);
    if (got != static_cast<ssize_t>(batch)) {
      const int err = got < 0 ? errno : EFAULT;
      MORPH_RETURN_IF_ERROR(PeerFailure(p));
      return UnavailableError(what + " (pid " + std::to_string(p.pid) +
                              "): process_vm_readv failed: " + std::strerror(err));
    }
    done += batch;
  }
  copied();
  ++stats_.vm_readv_messages;
  stats_.vm_readv_bytes += r.bytes;
  return FinishReceive(p, what);
}

// Maps the sender's segment that holds message `d` (or finds it mapped by this Wait): its memfd
// duplicated by pidfd_getfd, checked to be the same file (inode, size). Null: not mappable, read
// the message by process_vm_readv instead.
const char* ShmChannel::MapSegment(Peer& p, const Descriptor& d) {
  if (p.getfd_refused || p.pidfd < 0) return nullptr;
  for (const Peer::Mapping& m : p.mappings) {
    if (m.inode == d.seg_inode && m.base == d.seg_base && m.size == d.seg_size) return m.map;
  }
  const int fd = static_cast<int>(syscall(SYS_pidfd_getfd, p.pidfd, d.seg_fd, 0));
  if (fd < 0) {
    // Refused (no permission, old kernel): never again for this peer. EBADF and the like: the
    // sender's fd is gone; this message only.
    if (errno == EPERM || errno == EACCES || errno == ENOSYS) {
      p.getfd_refused = true;
      VLOG(1) << name_ << ": pidfd_getfd on rank " << p.rank << " refused (" << std::strerror(errno)
              << "): process_vm_readv for its messages";
    }
    return nullptr;
  }
  struct stat st {};
  void* map = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_ino) == d.seg_inode &&
      static_cast<uint64_t>(st.st_size) >= d.seg_size) {
    // A segment of at least 2 MiB may be backed by huge pages (ShmArena::Options::huge_pages):
    // aligned, each maps with one entry.
    map = d.seg_size >= shm_support::kHugePage
              ? shm_support::MapHugeAligned(fd, d.seg_size, PROT_READ)
              : mmap(nullptr, d.seg_size, PROT_READ, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (map == MAP_FAILED) return nullptr;
  p.mappings.push_back({d.seg_inode, d.seg_base, d.seg_size, static_cast<const char*>(map)});
  return static_cast<const char*>(map);
}

// After a message's bytes were copied in: checks the sender did not abort meanwhile and
// acknowledges the message.
Status ShmChannel::FinishReceive(Peer& p, const std::string& what) {
  // The sender sets its abort flag before it lets go of its buffer after a failure: checked
  // after the copy, so what was read came from live memory.
  if (p.mailbox->aborted.load(std::memory_order_acquire) != 0) {
    return AbortedError(what + ": the sender aborted during the copy");
  }
  ++p.received;
  p.recvs.pop_front();
  p.in->consumed.store(p.received, std::memory_order_release);
  RingDoorbell(&p.mailbox->doorbell);
  return Status::Ok();
}

Status ShmChannel::Wait(std::span<const ShmHandle> sends, std::span<const ShmHandle> recvs,
                        Deadline deadline) {
  Status s = WaitLoop(sends, recvs, deadline);
  // Segments stay mapped while receives from their peer are pending (later groups' messages
  // often come from the same segments), and no longer, so that no freed segment's pages are kept
  // and each reshard maps what it reads afresh. After an error nothing of this channel is read
  // again.
  for (auto& p : local_) {
    if (p->recvs.empty() || !s.ok()) p->DropMappings();
  }
  return s;
}

Status ShmChannel::WaitLoop(std::span<const ShmHandle> sends, std::span<const ShmHandle> recvs,
                            Deadline deadline) {
  for (;;) {
    if (own_ != nullptr && own_->aborted.load(std::memory_order_acquire) != 0) {
      return AbortedError(name_ + ": aborted");
    }
    const uint32_t bell = own_ != nullptr ? own_->doorbell.load(std::memory_order_acquire) : 0;
    bool progress = false;
    for (auto& p : local_) MORPH_RETURN_IF_ERROR(Publish(*p));
    bool done = true;
    for (const ShmHandle& h : recvs) {
      Peer& p = *local_[static_cast<size_t>(slot_of_[static_cast<size_t>(h.peer)])];
      while (p.received <= h.seq && p.in->posted.load(std::memory_order_acquire) > p.received) {
        Status s = ReceiveNext(p);
        if (!s.ok()) return Fail(std::move(s));
        progress = true;
      }
      if (p.received <= h.seq) done = false;
    }
    for (const ShmHandle& h : sends) {
      Peer& p = *local_[static_cast<size_t>(slot_of_[static_cast<size_t>(h.peer)])];
      if (p.out->consumed.load(std::memory_order_acquire) <= h.seq) done = false;
    }
    if (done) return Status::Ok();
    if (progress) continue;
    // Nothing of these handles can move yet: copy in what later groups already can, rather than
    // sleep (their senders then finish sooner; the copies would be done here anyway).
    for (auto& p : local_) {
      if (!p->recvs.empty() && p->in->posted.load(std::memory_order_acquire) > p->received) {
        Status s = ReceiveNext(*p);
        if (!s.ok()) return Fail(std::move(s));
        progress = true;
        break;
      }
    }
    if (progress) continue;
    for (const auto* list : {&sends, &recvs}) {
      for (const ShmHandle& h : *list) {
        Status s = PeerFailure(*local_[static_cast<size_t>(slot_of_[static_cast<size_t>(h.peer)])]);
        if (!s.ok()) return Fail(std::move(s));
      }
    }
    if (deadline.Expired()) {
      return Fail(DeadlineExceededError(name_ + ": deadline passed waiting for " +
                                        std::to_string(sends.size()) + " sends and " +
                                        std::to_string(recvs.size()) + " receives"));
    }
    FutexWait(&own_->doorbell, bell,
              std::min<std::chrono::nanoseconds>(kPollInterval, deadline.Remaining()));
  }
}

}  // namespace morph
