// The control channel's wire format: how the messages of messages.h (and registration and
// heartbeats) travel between a worker's agent and the coordinator over one TCP connection.
//
// A frame is a 12-byte header and a body:
//   magic   u32  0x4850524d ("MRPH" in little-endian byte order)
//   version u16  kWireVersion; a peer with another version is refused at Hello
//   type    u16  WireType
//   length  u32  body bytes, at most kMaxFrameBody (a header announcing more is refused before
//                anything is allocated)
// All integers little-endian; a list is a u32 count then its items; a string a u32 length then
// bytes; a list of ids (worker ids, ranks, tensor dimensions) a u32 count (at most kMaxIdList)
// then items, each a zigzag LEB128 varint (shortest form only) of an id's difference from the
// previous id (the first from 0; 64-bit wrapping), except that the item 2 (a difference of +1)
// starts a run: a varint k >= 1 follows, and the next k ids each ascend by one (a single id one
// above the previous is also a run, of 1, and a run never follows a run). So a 4,096-rank
// generation's ranks take a few bytes, and scattered ids about one byte each. Every count of
// fixed-size items is checked against the bytes left in the body before anything is
// allocated, so a frame of n bytes never makes the decoder allocate more than O(n) plus its id
// lists (at most kMaxIdList ids each, kMaxIdsPerFrame in all); trailing bytes are an error.
//
//   std::string bytes = EncodeFrame(WireMessage{CommitMsg{...}});
//   MORPH_ASSIGN_OR_RETURN(FrameHeader h, DecodeHeader(first_12_bytes));
//   MORPH_ASSIGN_OR_RETURN(WireMessage m, DecodeBody(h, body));
//
// Pure functions; any thread.
#ifndef MORPH_RUNTIME_PROTOCOL_WIRE_H_
#define MORPH_RUNTIME_PROTOCOL_WIRE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include "morph/status.h"
#include "runtime/protocol/messages.h"

namespace morph {

inline constexpr uint32_t kWireMagic = 0x4850524d;
// 2: full layouts in Register (extra layers, TP blocks, padding, hybrid ZeRO group), recovery
//    fields (change.recovery/stale, the commit's RecoveryDecision, the step report's state),
//    FailureReport, Abort.
// 3: StepReportMsg::undo_step.
// 4: the step report's SnapshotHoldings (both copies of each side, whose copy is held) and the
//    commit's RecoveryDecision::snapshot_holders.
// 5: JobManifest::backend (the step communicators' backend) in Register.
// 6: id lists run-length coded (ascending runs: a few bytes instead of a byte per id).
// 7: SnapshotHoldings::held_tensors (a held copy holds only its ward's pieces with no other
//    copy); RecoveryDecision::snapshot_holders may hold -1.
// 8: StepReportMsg::vote_step and committed_step (Runtime::CommitUpdate's commit vote).
// 9: WelcomeMsg::first_generation (checkpoint retention keeps to the job's own generations).
// 10: layouts carry the torch.chunk flags (ChunkTP, ChunkDP).
// 11: RegisterMsg::resume (coordinator failover: a worker reconnects to a successor as itself).
// 12: DoneMsg also coordinator -> worker: the acknowledgment of a worker's Done.
inline constexpr uint16_t kWireVersion = 12;
inline constexpr size_t kFrameHeaderBytes = 12;
// Largest body: a commit for 2^20 ranks (8 MiB of worker ids) fits with room to spare.
inline constexpr uint32_t kMaxFrameBody = 32u << 20;
// The most ids one list may hold (twice the planner's largest world, kMaxPlanWorld: an old and a
// new world's participants), and all id lists of one frame together (8 MiB decoded): a run of k
// ids costs a few bytes, so these, not the frame's size, bound what id lists may allocate.
inline constexpr uint32_t kMaxIdList = 1u << 17;
inline constexpr uint32_t kMaxIdsPerFrame = 1u << 20;
// Largest Hello: sent before authentication, so it is kept small.
inline constexpr uint32_t kMaxHelloBody = 4096;

// Worker -> coordinator, first frame: authenticates and registers.
struct HelloMsg {
  std::string token;
  std::string host;
  int64_t pid = 0;
  uint64_t capabilities = 0;  // bit 0: CUDA device memory
  WorkerId resume_id = 0;     // reconnecting worker's id, 0 for a new one
  friend bool operator==(const HelloMsg&, const HelloMsg&) = default;
};
// Worker -> coordinator, second frame (only after a Hello with the right token): what this
// worker registers (tensors, scalars, model constraints, dataset). Bounded by kMaxFrameBody.
// The job's manifest is the first registration's (or the coordinator's configured one); a
// worker whose manifest differs is refused with an ErrorMsg naming the first difference.
// Coordinator failover: a worker that reconnects to a successor (HelloMsg::resume_id = its
// worker id) says where it stands (the decider's Rejoin event).
struct ResumeState {
  int64_t generation = 0;        // the generation it trains in (0: none yet)
  int64_t step = 0;              // the step it will begin next
  int64_t awaiting_outcome = 0;  // a committed change whose switch failed here, outcome unknown
  int64_t prepared = 0;          // a proposal it reported for, no commit or abandon yet
  bool done = false;             // its training loop ended (it sent Done)
  bool leaving = false;          // it asked to leave
  friend bool operator==(const ResumeState&, const ResumeState&) = default;
};
struct RegisterMsg {
  JobManifest manifest;
  ResumeState resume;  // only read when the Hello's resume_id is set
  friend bool operator==(const RegisterMsg&, const RegisterMsg&) = default;
};
// Coordinator -> worker, the answer to Hello + Register: registered as `worker`.
struct WelcomeMsg {
  WorkerId worker = 0;
  int64_t generation = 0;  // the current generation's id (0 before the first) == current.id
  // "host:port" of the TcpStoreServer the coordinator hosts (same job token).
  std::string store_address;
  // The job's current generation, whole (id 0, empty, before the first).
  Generation current;
  // The job's first generation id: its checkpoint folders are those of generation >= it (a job
  // numbers its generations above an earlier run's on the same folder), the only ones its
  // retention may delete (runtime/recovery/checkpointer.h, PruneCheckpoints).
  int64_t first_generation = 0;
  friend bool operator==(const WelcomeMsg&, const WelcomeMsg&) = default;
};
struct HeartbeatMsg {
  int64_t step = 0;  // informational: the last step begun
  friend bool operator==(const HeartbeatMsg&, const HeartbeatMsg&) = default;
};
// Worker -> coordinator: it asks to leave (SIGTERM, Leave()).
struct LeaveMsg {
  std::string reason;
  friend bool operator==(const LeaveMsg&, const LeaveMsg&) = default;
};
// Worker -> coordinator: this worker's training loop ended normally. Once every member of the
// current generation sent Done (or closed its connection after it), the job is complete and
// the coordinator proposes no further change. Coordinator -> worker: the Done is recorded (with
// failover, persisted): a worker's Finish waits for this before its process may exit.
struct DoneMsg {
  friend bool operator==(const DoneMsg&, const DoneMsg&) = default;
};
// Either way: the sender closes the connection after this frame.
struct ErrorMsg {
  int32_t code = 0;  // a StatusCode
  std::string message;
  friend bool operator==(const ErrorMsg&, const ErrorMsg&) = default;
};

using WireMessage =
    std::variant<HelloMsg, WelcomeMsg, HeartbeatMsg, LeaveMsg, ErrorMsg, PrepareMsg, StepReportMsg,
                 CommitMsg, AbandonMsg, AppliedMsg, OutcomeMsg, ReleaseMsg, RegisterMsg, DoneMsg,
                 FailureReportMsg, AbortMsg>;
// The frame type of each alternative is its index + 1 (0 is never valid).
enum class WireType : uint16_t {
  kHello = 1,
  kWelcome,
  kHeartbeat,
  kLeave,
  kError,
  kPrepare,
  kStepReport,
  kCommit,
  kAbandon,
  kApplied,
  kOutcome,
  kRelease,
  kRegister,
  kDone,
  kFailureReport,
  kAbort,
};
std::string_view WireTypeName(uint16_t type);

struct FrameHeader {
  uint16_t version = 0;
  uint16_t type = 0;
  uint32_t length = 0;
};

// The whole frame (header + body) of `m`.
std::string EncodeFrame(const WireMessage& m);

// kInvalidArgument naming what is wrong: fewer than 12 bytes, bad magic, unknown type, a body
// longer than kMaxFrameBody (kMaxHelloBody for Hello); kFailedPrecondition for another version.
StatusOr<FrameHeader> DecodeHeader(std::string_view header);
// kInvalidArgument naming the message and field: a truncated body, a count larger than the
// bytes left could hold, an invalid value (a negative count of ranks, an unknown status code),
// trailing bytes.
StatusOr<WireMessage> DecodeBody(const FrameHeader& header, std::string_view body);
// Both, on a complete frame.
StatusOr<WireMessage> DecodeFrame(std::string_view frame);

}  // namespace morph

#endif  // MORPH_RUNTIME_PROTOCOL_WIRE_H_
