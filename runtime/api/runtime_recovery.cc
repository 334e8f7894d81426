#include <glog/logging.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "runtime/api/runtime_impl.h"

namespace morph {
void Runtime::Impl::AbortCollectives(const std::string& why, int64_t generation) {
  // An abort of an older generation (this worker already switched on) is not for these.
  const LiveGroups::Aborted a = live.AbortAll(generation);
  if (a == LiveGroups::Aborted::kOtherGeneration) return;
  int64_t expected = 0;
  aborted_at_ns.compare_exchange_strong(
      expected, SteadyClock::now().time_since_epoch() / std::chrono::nanoseconds(1));
  if (a == LiveGroups::Aborted::kAborted) {
    MORPH_LOG(WARNING, agent->log()) << "aborted generation " << gen.id
                 << "'s collectives: " << why;
  }
  // A snapshot round waiting on a dead peer would hold the training thread in BeginStep.
  if (snapshots) snapshots->Abort();
}

void Runtime::Impl::StartSnapshots() {
  const int rank = gen.RankOf(agent->id());
  snapshot_warned = false;
  if (!snapshots || rank < 0 || !store) return;
  // Bounded more tightly than a change: it runs in the switch's stall, and a peer that died
  // right after the switch would hold the training thread here (the abort cannot reach it).
  Deadline d = Deadline::AfterMs(std::min<int64_t>(opts.change_timeout_ms, 30000));
  Status st = [&]() -> Status {
    char name[256] = {};
    std::string host = opts.host;
    if (host.empty() && gethostname(name, sizeof(name) - 1) == 0) host = name;
    if (host.empty()) host = "localhost";
    MORPH_RETURN_IF_ERROR(store->Set("snapshot/host/" + std::to_string(rank), host, d));
    SnapshotGeneration g{.generation = gen.id, .rank = rank};
    for (int r = 0; r < gen.config.world(); ++r) {
      MORPH_ASSIGN_OR_RETURN(std::string h, store->Get("snapshot/host/" + std::to_string(r), d));
      g.hosts.push_back(std::move(h));
    }
    return snapshots->StartGeneration(*store, g, d);
  }();
  if (!st.ok()) {
    snapshot_warned = true;
    MORPH_LOG(WARNING, agent->log()) << "generation " << gen.id
                 << ": buddy snapshots off for this generation: " << st;
  }
}

SnapshotHoldings Runtime::Impl::EndSnapshots() {
  SnapshotHoldings h;
  if (!snapshots) return h;
  // A round in flight is cut off but not waited for (its thread is joined by the next
  // StartGeneration): it writes only into copies that are incomplete, which are not reported,
  // and an exchange with a dead peer took up to 0.1 s more to unwind on a loaded host, which
  // the whole recovery waited for.
  snapshots->Abort();
  const std::vector<int64_t> local = snapshots->LocalSteps(gen.id);
  const std::vector<int64_t> held = snapshots->HeldSteps(gen.id);
  if (!local.empty()) h.local_step = local[0];
  if (local.size() > 1) h.local_prev_step = local[1];
  if (!held.empty() && snapshots->held_generation() == gen.id) {
    h.held_step = held[0];
    if (held.size() > 1) h.held_prev_step = held[1];
    h.held_rank = snapshots->held_rank();
    h.held_tensors = snapshots->HeldTensors(gen.id);
    // A list the report cannot carry (more tensors than a wire id list holds): the held copies
    // are not offered; the recovery then has the other sources.
    if (h.held_tensors.size() > kMaxIdList) {
      MORPH_LOG(WARNING, agent->log()) << "the held snapshot copies hold "
                   << h.held_tensors.size() << " tensors, more than a report carries ("
                   << kMaxIdList << "); not offered to the recovery";
      h.held_step = h.held_prev_step = h.held_rank = -1;
      h.held_tensors.clear();
    }
  }
  return h;
}

}  // namespace morph
