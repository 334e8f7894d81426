// The control protocol's messages as values: what the coordinator and a worker's agent say to
// each other about membership and generations (docs/design.md, "Planned change"). The wire
// encoding (versioned, length-framed, bounded) is separate; these structs are what the pure
// state machines on both sides (runtime/coordinator/decider.h, runtime/agent/agent_core.h)
// consume and produce, so a deterministic simulation can drive them without sockets.
//
// Plain values; thread-compatible.
#ifndef MORPH_RUNTIME_PROTOCOL_MESSAGES_H_
#define MORPH_RUNTIME_PROTOCOL_MESSAGES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "base/parallel_config.h"

namespace morph {

// A worker's identity for the whole job, assigned by the coordinator at registration and never
// reused. Ranks change with generations; worker ids do not.
using WorkerId = int64_t;

// One committed membership and configuration. Once committed, never changes.
struct Generation {
  int64_t id = 0;
  // The first step trained in this generation (the switch step S).
  int64_t start_step = 0;
  ParallelConfig config;
  // ranks[r] = the worker that holds rank r; size config.world().
  std::vector<WorkerId> ranks;
  // Digest of everything that shapes the state exchange into this generation (plan inputs and
  // options); every participant checks it before the first byte moves.
  uint64_t plan_digest = 0;

  int RankOf(WorkerId w) const;  // -1 when `w` holds no rank
  friend bool operator==(const Generation&, const Generation&) = default;
};

// The workers taking part in a change from generation `from` to the proposed one, numbered as
// the reshard planner and transport number participants: old ranks' workers in old-rank order
// (lost ones excluded), then new ranks' workers that held no old rank, in worker-id order.
struct ChangeParticipants {
  std::vector<WorkerId> participants;
  // Old ranks that hold no new rank: they send their state away (then exit if in `exiting`,
  // else stay as standby spares).
  std::vector<WorkerId> leavers;
  // Workers that leave the job once the change applied: asked to leave (SIGTERM, Leave(), a
  // resize's remove) or beyond a smaller world size.
  std::vector<WorkerId> exiting;
  std::vector<WorkerId> lost;  // old ranks whose state is gone
  friend bool operator==(const ChangeParticipants&, const ChangeParticipants&) = default;
};

// Coordinator -> every participant (and joiners): build generation `next` beside the running
// one; old ranks answer with a StepReport and do not begin a step past the one they report.
struct PrepareMsg {
  Generation next;  // start_step not decided yet (0)
  int64_t from_generation = 0;
  // The generation the change starts from, whole (from.id == from_generation): joiners derive
  // the reshard plan from it.
  Generation from;
  ChangeParticipants change;
  friend bool operator==(const PrepareMsg&, const PrepareMsg&) = default;
};

// Old rank -> coordinator: the highest step it may begin in the old generation without a
// decision (it waits in BeginStep before any later step until the commit or an abandon).
struct StepReportMsg {
  WorkerId worker = 0;
  int64_t generation = 0;  // the proposed generation this answers
  int64_t last_free_step = 0;
  friend bool operator==(const StepReportMsg&, const StepReportMsg&) = default;
};

// Coordinator -> every participant: generation `next` starts at step next.start_step.
struct CommitMsg {
  Generation next;
  int64_t from_generation = 0;
  Generation from;  // as in PrepareMsg
  ChangeParticipants change;
  friend bool operator==(const CommitMsg&, const CommitMsg&) = default;
};

// Coordinator -> participants of a proposal that will not be committed (a participant was lost
// before the commit): drop what was built for it; old ranks may step on freely again.
struct AbandonMsg {
  int64_t generation = 0;
  friend bool operator==(const AbandonMsg&, const AbandonMsg&) = default;
};

// Participant -> coordinator: it finished switching to `generation` (state exchanged, closing
// barrier passed), or failed to (its old state is intact).
struct AppliedMsg {
  WorkerId worker = 0;
  int64_t generation = 0;
  bool ok = true;
  std::string error;  // when !ok
  // This participant's phases of the switch, in microseconds (what /v1/status and /metrics
  // show per change: the maximum over participants).
  struct Phases {
    int64_t communicators_us = 0, plan_us = 0, transfer_us = 0, resume_us = 0, stall_us = 0;
    friend bool operator==(const Phases&, const Phases&) = default;
  } phases;
  friend bool operator==(const AppliedMsg&, const AppliedMsg&) = default;
};

// Coordinator -> every surviving participant, once every one of them answered Applied (or was
// lost): whether `generation` took effect. Applied if any participant passed its closing barrier
// (then every participant's exchange had completed); otherwise every participant keeps its old
// state and stays in the old generation. A leaver that gets applied = true is done.
struct OutcomeMsg {
  int64_t generation = 0;
  bool applied = false;
  friend bool operator==(const OutcomeMsg&, const OutcomeMsg&) = default;
};

// Coordinator -> a worker that holds no rank and asked to leave (or is no longer needed): it
// may exit now. Finished() becomes true.
struct ReleaseMsg {
  int64_t generation = 0;  // the current generation when it was released
  friend bool operator==(const ReleaseMsg&, const ReleaseMsg&) = default;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_PROTOCOL_MESSAGES_H_
