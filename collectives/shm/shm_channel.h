// ShmChannel: point-to-point messages between processes on one host without TCP, for
// CommTransport (comm_transport.h). The receiver copies straight out of the sender's buffer: one
// copy, from the sender's layout into the receiver's, strided on both sides if need be. How it
// reads the sender's memory, chosen per message:
//   - the sender's buffer is a segment of its ShmArena (shm_arena.h): the receiver duplicates the
//     segment's memfd (pidfd_getfd), maps it read-only for the rest of its Wait and copies with
//     plain (streaming) memcpy;
//   - any other buffer, or where pidfd_getfd is refused: process_vm_readv (cross-memory attach),
//     which pins both sides' pages on every call and runs at 0.3-0.45 of memcpy on our VMs.
// A small shared-memory mailbox per process (POSIX shm, one ring of message descriptors per peer
// and direction, a futex doorbell) carries the addresses and the acknowledgements, so the
// sender's buffer stays alive until the receiver has read it.
//
//   MORPH_ASSIGN_OR_RETURN(auto ch, ShmChannel::Create(comm, /*enable=*/true, deadline));
//   if (ch->IsLocal(peer)) {
//     uint64_t s = ch->PostSend(peer, MessageRegion{...});         // Start: never blocks
//     MORPH_RETURN_IF_ERROR(ch->Wait({{peer, s}}, {}, deadline));   // until the peer read it
//   }
//
// Which peers are local is decided once, in Create, and is symmetric: same boot id, same PID
// namespace and uid, each other's mailbox opened, and a probe process_vm_readv of each other's
// memory succeeded (Yama ptrace_scope, seccomp or containers can forbid it: then the pair uses
// TCP, and an INFO line says why). Messages between a pair match in posting order, like the
// communicator's.
//
// Failures: a peer that exits (pidfd), unmaps its buffer (EFAULT) or aborts (a flag in its
// mailbox) makes Wait return kUnavailable / kAborted naming it, within ~20 ms; the deadline
// gives kDeadlineExceeded; a size mismatch kInternal, a tag mismatch kFailedPrecondition; a
// segment descriptor whose runs leave the segment kInternal. Any error sets this process's own
// abort flag before Wait returns, so a peer that is still reading from this process's buffer
// discards what it read (it checks the flag after every read) — a failed sender may free its
// buffer as soon as its Wait returned (a receiver that mapped the segment holds its own
// reference to the pages, so a freed segment is never a fault; it unmaps at the end of its Wait).
//
// Mailbox names (/dev/shm/morph-shm-<pid>-<random>) are unlinked as soon as every peer has
// opened them, at the end of Create; only a process killed inside Create leaves one behind.
//
// Thread-safety: one owner thread calls Post*/Wait; Abort() from any thread.
#ifndef MORPH_COLLECTIVES_SHM_CHANNEL_H_
#define MORPH_COLLECTIVES_SHM_CHANNEL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "collectives/communicator.h"
#include "collectives/shm/shm_arena.h"
#include "reshard/strided_copy.h"

namespace morph {

// Where a message lies in this process's memory: `bytes` contiguous at `base`, or, when
// `strided`, elements [begin, end) of one side of `geometry` over `base` (the source side for a
// send, the destination side for a receive), as in reshard/transport.h's StridedLayout.
struct MessageRegion {
  char* base = nullptr;
  size_t bytes = 0;
  bool strided = false;
  CopyGeometry geometry;
  int elem_size = 1;
  int64_t begin = 0;
  int64_t end = 0;
  // Message identity, checked by the receiver against its own (kFailedPrecondition on a
  // mismatch, as transport.h says).
  uint64_t tag = 0;
};

// One posted message: the peer and its sequence number between the pair in that direction.
struct ShmHandle {
  int peer = 0;
  uint64_t seq = 0;
};

class ShmChannel {
 public:
  // Collective over `comm` (three small allgathers) when `enable`: every rank calls it with the
  // same `enable`; with false nothing is exchanged and no peer is local. Errors: the
  // communicator's (kDeadlineExceeded, kUnavailable, kAborted). Trouble with shared memory or
  // cross-memory attach is no error: it makes peers non-local. Owner thread of `comm`.
  // `arena` (may be null; must outlive the channel): this process's buffers from it are sent as
  // mappable segments (see the file comment); it may differ between ranks.
  static StatusOr<std::unique_ptr<ShmChannel>> Create(Communicator& comm, bool enable,
                                                      Deadline deadline,
                                                      const ShmArena* arena = nullptr);
  ~ShmChannel();

  bool IsLocal(int peer) const;
  int num_local_peers() const { return static_cast<int>(local_.size()); }
  // Why peers are not local, for logs ("" when every same-host peer is).
  const std::string& why_not_local() const { return why_; }

  // Queues a message to / from a local peer. The send's memory must stay valid, and the
  // receive's must stay valid and unread, until a Wait covering the handle returned. Owner
  // thread; never blocks.
  ShmHandle PostSend(int peer, const MessageRegion& region);
  ShmHandle PostRecv(int peer, const MessageRegion& region);

  // Progresses every queued message and returns once the given ones are done: sends read by
  // their receiver, receives copied in. Status as in the file comment. Owner thread.
  Status Wait(std::span<const ShmHandle> sends, std::span<const ShmHandle> recvs,
              Deadline deadline);

  // Messages this process received, by how it read them (counted when the copy completed).
  struct Stats {
    uint64_t mapped_messages = 0;  // from a peer's ShmArena segment, by memcpy
    uint64_t mapped_bytes = 0;
    uint64_t vm_readv_messages = 0;  // by process_vm_readv
    uint64_t vm_readv_bytes = 0;
    double copy_seconds = 0;  // inside the copies (both paths), mapping included
  };
  const Stats& stats() const { return stats_; }

  // Raises this process's abort flag: its Waits, and peers' Waits on messages with it, return
  // kAborted promptly. Any thread.
  void Abort();

  struct Mailbox;     // shared-memory layout (shm_channel.cc)
  struct Descriptor;  // one message as its sender describes it, in the sender's mailbox

 private:
  struct Peer;
  ShmChannel() = default;
  Status Publish(Peer& p);
  Status ReceiveNext(Peer& p);
  const char* MapSegment(Peer& p, const Descriptor& d);
  Status FinishReceive(Peer& p, const std::string& what);
  Status WaitLoop(std::span<const ShmHandle> sends, std::span<const ShmHandle> recvs,
                  Deadline deadline);
  Status PeerFailure(const Peer& p) const;
  Status Fail(Status s);

  int rank_ = 0;
  std::string name_;  // for messages: "shm channel (rank 2 of 4)"
  Mailbox* own_ = nullptr;
  size_t own_size_ = 0;
  std::vector<int> slot_of_;  // per rank: its ring index in local mailboxes, -1 if not local
  std::vector<std::unique_ptr<Peer>> local_;  // indexed by slot
  std::string why_;
  const ShmArena* arena_ = nullptr;
  Stats stats_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_SHM_CHANNEL_H_
