// The reshard executor's messages (executor.h, "Message boundaries"): pieces resolved against
// the buffers, cut into messages, and the messages grouped into transport groups. Internal to
// the executor (not installed).
#ifndef MORPH_RESHARD_EXECUTOR_MESSAGES_H_
#define MORPH_RESHARD_EXECUTOR_MESSAGES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reshard/plan_handshake.h"
#include "reshard/strided_copy.h"

namespace morph::executor_internal {

// A piece of the plan, resolved against the buffers.
struct Piece {
  int tensor = 0;
  int peer = 0;
  int elem_size = 1;
  int64_t elements = 0;
  StridedView view;   // the box in this side's buffer (old for sends, new for recvs)
  CopyGeometry geom;  // pack: view -> contiguous; unpack: contiguous -> view
  char* base = nullptr;
};

// Elements [begin, end) of one piece, at byte `offset` of its message.
struct Segment {
  int piece = 0;
  int64_t begin = 0;
  int64_t end = 0;
  size_t offset = 0;
};

struct Message {
  int peer = 0;
  int64_t index = 0;  // k: the k-th message between this pair in this direction
  size_t bytes = 0;
  std::vector<Segment> segments;
  char* direct = nullptr;  // set when the message is one contiguous range of the shard buffer
  bool strided = false;    // one segment of a strided piece, posted as a strided op in place
};

// Cuts the pieces exchanged with each peer into messages of at most `chunk` bytes at element
// boundaries. Depends only on the piece order, sizes and dtypes: equal on both sides.
std::vector<std::vector<Message>> CutMessages(const std::vector<Piece>& pieces, int n,
                                              size_t chunk);

// Messages per group of a direction that is in place at both ends (executor.h): as many as
// MessagesPerGroup's cap. 1024 messages of up to EffectiveChunkBytes each, posted as one
// transport group, use no staging; the transport holds only their descriptors.
constexpr int64_t kInPlaceMessagesPerGroup = 1024;

// The messages of one transport group (see "Message boundaries" in executor.h): at most
// MessagesPerGroup per peer and direction, consecutive in that pair's order.
struct Group {
  std::vector<const Message*> sends, recvs;
  size_t staged = 0;  // staging it needs, bytes
};

// Groups of messages in the order every participant posts them: by (block of message indices
// k, block of peer offsets). Message k from a to b has offset s = (b - a) mod n at both ends, so
// both put it into the group with the same key; posting in key order is what makes the exchange
// deadlock-free (docs/reshard-executor.md). Groups without messages here are left out.
// A direction of a pair whose messages need no staging at either end (both sides said so in
// the handshake, so both know) takes kInPlaceMessagesPerGroup messages per group instead of
// `messages_per_group`: its groups hold no staging, and fewer groups mean fewer round trips and
// fewer points where the pair waits for the participant's other peers.
std::vector<Group> GroupMessages(const std::vector<std::vector<Message>>& send_msgs,
                                 const std::vector<std::vector<Message>>& recv_msgs, int me, int n,
                                 int peers_per_group, int messages_per_group, size_t chunk,
                                 const PlanHandshake& agreed);

}  // namespace morph::executor_internal

#endif  // MORPH_RESHARD_EXECUTOR_MESSAGES_H_
