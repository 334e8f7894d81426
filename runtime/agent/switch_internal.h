// What the switch engine's files (switch.cc, switch_snapshot.cc) share; not part of its API.
#ifndef MORPH_RUNTIME_AGENT_SWITCH_INTERNAL_H_
#define MORPH_RUNTIME_AGENT_SWITCH_INTERNAL_H_

#include <string>
#include <vector>

#include "base/deadline.h"
#include "base/status.h"
#include "runtime/agent/switch.h"
#include "runtime/protocol/messages.h"

namespace morph {

// "participant 2 (worker 12), participant 3 (worker 5)" for the peers a failure names
// (Status::failed_peers are participant indices of `participants`).
std::string NamePeers(const Status& s, const std::vector<WorkerId>& participants);

// ExecuteSwitch for a recovery from buddy snapshots (switch.h "Recovery"; switch_snapshot.cc).
StatusOr<SwitchStats> RestoreFromSnapshots(PreparedSwitch& sw, const CommitMsg& commit,
                                           State& state, Deadline deadline);

}  // namespace morph

#endif  // MORPH_RUNTIME_AGENT_SWITCH_INTERNAL_H_
