// The reshard executor: runs one participant's LocalPlan. It copies pieces that stay on this
// participant from old to new storage, packs strided boxes into contiguous staging buffers,
// exchanges them through a Transport with grouped sends/receives, and unpacks them into the new
// shards, pipelining over rounds of messages (pack round k+1 while round k is in flight, unpack
// round k-1) within a staging-memory bound.
//
//   std::vector<OldShardData> old = {{"w1", DType::kF32, old_w1.view()}, ...};
//   MORPH_ASSIGN_OR_RETURN(ExecutorOptions opts, ExecutorOptions::FromEnv());
//   MORPH_ASSIGN_OR_RETURN(ReshardResult r,
//       Reshard(plan, old, transport, HostAllocator(), opts, Deadline::AfterMs(60000)));
//   // success: r.new_buffers[i] holds plan.new_shards[i]; only now free the old buffers.
//
// Message boundaries. For each peer, the pieces exchanged with it (in plan order) are cut into
// messages of at most EffectiveChunkBytes(options, n) bytes, at element boundaries; a piece of at
// least 1/8 of that size starts a fresh message and ends its last one, smaller pieces share
// messages. Both sides derive the same cuts from the
// plan lists, the tensors' dtypes and the options, which must be equal on all participants (per
// local_plan.h). Message k from participant a to b (offset s = (b - a) mod n) belongs to group
// (k / MessagesPerGroup, (s - 1) / PeersPerGroup): one grouped Transport::Start, posted in key
// order and skipped where this participant has nothing in it; both ends of a message put it in
// the same group, which holds the same consecutive messages of each pair on both sides. A
// direction of a pair that is in place at both ends (every message sent from and received into
// the shard buffers as they are; each side says so in the handshake, so both ends know) takes
// 1024 messages per group instead of MessagesPerGroup: its groups stage nothing, and fewer
// groups mean fewer synchronizing round trips (DP 4 -> 3 ZeRO over Gloo TCP: 0.72-0.81 of raw
// p2p -> 0.86-0.95). A transport's per-group timeout (CommTransport's `timeout`; the runtime
// passes its whole change timeout) must then cover up to 1,024 messages of each in-place pair. A message that is a single contiguous range of the old (new) buffer is sent from
// (received into) place, without staging. With a transport that SupportsStridedOps() and host
// buffers, so is a message that is a single segment of one strided piece: it is posted as a
// strided op and the transport copies straight between the sender's old and the receiver's new
// layout (ExecutorOptions::strided_messages). Which messages go strided is decided by each side
// alone and does not change the cuts.
//
// Agreement. Before the first data byte, each pair of participants that exchanges pieces swaps
// one fixed-size handshake message per direction: the plan digest (LocalPlan::digest plus
// MessageLayoutDigest, see WithMessageLayout) and a hash of the pieces listed for the pair in
// each direction. A mismatch is kFailedPrecondition naming the differing digest part (or the
// pair's piece lists) and the peer, and nothing else moves. Every data message then carries a
// transport tag derived from the digest, the pair, both sides' per-execution nonces (swapped in
// the handshake) and the message index (transport.h), so a stray message (another plan, an
// earlier execution, another position) fails the receiving group.
// A pair whose plans do not even agree that they exchange anything is not detected here (one
// side waits for a handshake that never comes, until its deadline); the runtime's commit digest
// covers that case.
//
// Failure: any error of this participant (validation included, before anything moved), a
// transport error, a peer that is gone, an abort or the deadline stop the execution; the
// executor then aborts the transport, so that peers fail promptly too (they see kUnavailable /
// kAborted naming this participant). A participant whose validation failed first offers its
// reason to the peers its plan names in a failed handshake (for up to 250 ms), so peers that are
// already waiting fail at once with kAborted "participant P failed before the exchange: why".
// The transport cannot be used after a failure. Old buffers are never written, so the old local
// data stays intact; new buffers hold partial data and must be discarded.
//
// Buffer lifetime: ExecutePlan returns only after every transport group it started has been
// waited for, and a transport's Wait returns only once it no longer touches that group's
// buffers (transport.h). So when ExecutePlan returns — OK or not — no buffer it handed to the
// transport (old, new, staging) is in use, and Reshard may free its new buffers on error.
//
// Completion: success here means this participant's part is done, not that the reshard is.
// Peers may still be exchanging over the same communicator, and a Gloo peer that closes its
// connections looks like a failed one to them. So every participant — leavers included — ends
// a reshard with a barrier on the transport's communicator (or a coordinator acknowledgement)
// before it tears anything down; only then may a leaver exit and old buffers be freed
// (tests/reshard_gloo_test.cc does this; without it a fast finisher failed peers in 3 of 15 runs).
#ifndef MORPH_RESHARD_EXECUTOR_H_
#define MORPH_RESHARD_EXECUTOR_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "reshard/buffer.h"
#include "reshard/local_plan.h"
#include "reshard/transport.h"

namespace morph {

struct ExecutorOptions {
  // Largest message to one peer. Must be equal on all participants (checked: it is part of the
  // digest every pair compares before the exchange, see "Agreement").
  uint64_t chunk_bytes = uint64_t{4} << 20;
  // Bound on this participant's staging memory (send and receive staging together; one group
  // is always allowed, see PeersPerGroup). Must be equal on all participants (checked like
  // chunk_bytes).
  uint64_t staging_bytes = uint64_t{256} << 20;
  // Groups (rounds) posted but not yet completed. Deeper pipelines only add staging memory
  // (which is first-touched, i.e. slow, when fresh); may differ between participants.
  int max_rounds_in_flight = 3;
  // With a transport that SupportsStridedOps() and host buffers, a message that is one segment
  // of one strided piece is sent from (received into) the shard buffer in place as a strided op
  // (the transport gathers / scatters it), instead of being packed into (unpacked from) staging.
  // Does not change message cutting; may differ between participants.
  bool strided_messages = true;

  // From MORPH_RESHARD_CHUNK_BYTES and MORPH_RESHARD_STAGING_BYTES; kInvalidArgument naming
  // the variable when one does not parse.
  static StatusOr<ExecutorOptions> FromEnv();
};

// The message size actually used: min(chunk_bytes, staging_bytes / 4), at least 4 KiB, a
// multiple of 64. Independent of the number of participants (the argument is ignored; kept so
// that callers need not change): the staging bound is kept by grouping, see PeersPerGroup.
uint64_t EffectiveChunkBytes(const ExecutorOptions& options, int num_participants);

// The options that cut messages (chunk_bytes, staging_bytes, the effective chunk for `n`
// participants and the cutting rule's version) as a digest part: participants whose values are
// equal cut alike. Never 0.
uint64_t MessageLayoutDigest(const ExecutorOptions& options, int num_participants);
// `digest` with its kMessageLayout part set: the whole agreement a reshard depends on, what
// ExecutePlan checks with every peer and what a coordinator can put in its commit.
PlanDigest WithMessageLayout(PlanDigest digest, const ExecutorOptions& options,
                             int num_participants);
// How many peer offsets one transport group spans: min(n - 1, staging_bytes / (4 C)), at
// least 1, with C = EffectiveChunkBytes; and how many consecutive messages of each pair it
// holds: staging_bytes / (4 C PeersPerGroup), 1 to 1024. A group then stages at most
// 2 * PeersPerGroup * MessagesPerGroup * C <= staging_bytes / 2 (or one send and one receive),
// so two groups overlap; with few participants and small pieces, fewer groups (each a round
// trip between the peers on Gloo) carry the same messages.
int PeersPerGroup(const ExecutorOptions& options, int num_participants);
int MessagesPerGroup(const ExecutorOptions& options, int num_participants);

// A tensor's old local shard, as the caller holds it.
struct OldShardData {
  std::string name;
  DType dtype = DType::kF32;
  ConstBufferView data;  // bytes == old shard's elements * dtype size; empty if no old shard
};
// Where a tensor's new local shard goes.
struct NewShardData {
  std::string name;
  DType dtype = DType::kF32;
  BufferView data;  // bytes == new shard's elements * dtype size
};

struct ExecutorStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t bytes_copied = 0;  // local copies old -> new
  int64_t messages_sent = 0;
  int64_t messages_received = 0;
  int64_t messages_zero_copy = 0;  // sent or received without staging (includes strided)
  int64_t messages_strided = 0;    // of those, sent or received as strided ops
  int64_t rounds = 0;  // transport groups posted (see "Message boundaries")
  int64_t staging_peak_bytes = 0;
  double copy_seconds = 0;  // local copies
  double pack_seconds = 0;
  double unpack_seconds = 0;
  double wait_seconds = 0;  // blocked on the transport
  double total_seconds = 0;
  std::string ToString() const;
};

// Runs `plan` on this participant. `old_shards` and `new_shards` name every tensor of the plan
// that has an old (new) shard here, in any order. All buffers must be of one memory kind; CUDA
// buffers need a CUDA build and a transport with SupportsDeviceMemory() for any exchange.
// Padded tensors (TensorInfo::padded_shape): coverage is of each new shard's state, and the
// shard's padding elements are zero-filled (no piece moves padding).
// Returns:
//   kInvalidArgument  plan and buffers disagree (unknown or duplicate tensor name, dtype
//                     mismatch, buffer size differs from the shard's, a piece outside its shard,
//                     new shards (their state) not covered exactly once by recvs +
//                     local_copies + lost, naming tensor and box; a frame outside the
//                     tensor's (padded) shape; peer out of range, transport rank/size not the
//                     plan's); no data was sent or received, and the transport was aborted;
//   kFailedPrecondition a peer runs a different plan (digest part or the pair's piece lists
//                     differ; names the part and the peer), or a message's tag was not its
//                     receive's (transport);
//   kAborted          also: a peer failed before the exchange (names it and its reason);
//   kFailedPrecondition device buffers with a host-only transport or a build without CUDA;
//   kDeadlineExceeded / kAborted / kUnavailable / kInternal  from the transport (deadline,
//                     abort, peer gone, size mismatch between peers' plans), with context.
// Called by the thread that owns `transport`; all participants of the plan must call it.
StatusOr<ExecutorStats> ExecutePlan(const LocalPlan& plan, std::span<const OldShardData> old_shards,
                                    std::span<const NewShardData> new_shards, Transport& transport,
                                    const ExecutorOptions& options, Deadline deadline);

struct ReshardResult {
  std::vector<Buffer> new_buffers;  // indexed like plan.tensors; empty Buffer where no shard
  ExecutorStats stats;
};

// Allocates the new shards with `allocator`, then ExecutePlan. Same Status codes, plus the
// allocator's (kResourceExhausted). On error the new buffers are freed.
StatusOr<ReshardResult> Reshard(const LocalPlan& plan, std::span<const OldShardData> old_shards,
                                Transport& transport, const Allocator& allocator,
                                const ExecutorOptions& options, Deadline deadline);

}  // namespace morph

#endif  // MORPH_RESHARD_EXECUTOR_H_
