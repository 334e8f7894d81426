#include "runtime/plan/choose_recovery.h"

#include <algorithm>
#include <map>
#include <set>

#include "runtime/plan/plan_input.h"
#include "runtime/plan/snapshot_plan.h"

namespace morph {
namespace {

std::string Ids(const std::vector<WorkerId>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

// The first piece nobody holds when `stale` participants' state is not used, or nullopt when
// every new shard is covered. Also returns the digest of that change.
struct Coverage {
  std::optional<std::string> missing;  // "tensor 'T' box B"
  uint64_t digest = 0;
};

StatusOr<Coverage> Check(const JobManifest& manifest, const Generation& from,
                         const Generation& next, ChangeParticipants change,
                         std::vector<WorkerId> stale) {
  change.stale = std::move(stale);
  MORPH_ASSIGN_OR_RETURN(ChangePlan plan, PlanForChange(manifest, from, next, change));
  Coverage out;
  out.digest = plan.digest;
  if (!plan.planner) return out;
  // Only what the gone ranks held is looked at (PlanAll over every participant took 9-12 s at
  // 4,096 ranks in coordinator_bench).
  if (std::optional<Planner::LostPiece> m = plan.planner->FirstLostPiece()) {
    const std::string name = plan.planner->input().tensors.at(static_cast<size_t>(m->tensor)).name;
    out.missing = "tensor '" + name + "' box " + m->box.ToString() + " (needed by worker " +
                  (m->participant >= 0
                       ? std::to_string(plan.participants[static_cast<size_t>(m->participant)])
                       : "of new rank " + std::to_string(m->new_rank)) +
                  ")";
  }
  return out;
}

// Option 2: the newest step k at which every old rank's state survives in a buddy snapshot: its
// own worker alive with its local copy of k, else a survivor holding its copy of k (its buddy).
// nullopt when no step qualifies (`why` says what was missing at the newest candidate).
StatusOr<std::optional<RecoveryChoice>> ChooseSnapshot(
    const JobManifest& manifest, const Generation& from, const Generation& next,
    const ChangeParticipants& change, const std::vector<WorkerId>& old_alive,
    const std::map<WorkerId, const StepReportMsg*>& by_worker, std::string& why) {
  std::set<int64_t, std::greater<>> steps;
  for (const auto& [w, r] : by_worker) {
    for (int64_t s : {r->snapshots.local_step, r->snapshots.local_prev_step, r->snapshots.held_step,
                      r->snapshots.held_prev_step}) {
      if (s >= 0) steps.insert(s);
    }
  }
  if (steps.empty()) {
    why = "no survivor reported a snapshot";
    return std::optional<RecoveryChoice>();
  }
  auto alive = [&](WorkerId w) {
    return std::find(old_alive.begin(), old_alive.end(), w) != old_alive.end();
  };
  for (int64_t k : steps) {
    std::vector<WorkerId> holders(from.ranks.size(), -1);
    std::vector<std::vector<int64_t>> held_tensors(from.ranks.size());
    std::vector<WorkerId> stale;
    std::string missing;
    bool any_own = false;
    for (size_t r = 0; r < from.ranks.size(); ++r) {
      const WorkerId w = from.ranks[r];
      if (alive(w) && by_worker.at(w)->snapshots.HasLocal(k)) {
        holders[r] = w;
        any_own = true;
        continue;
      }
      // Its buddy's copy holds its pieces with no other copy; with none, every piece it held
      // must be in another rank's own copy (the rounds' coverage below decides).
      for (const auto& [b, rep] : by_worker) {
        if (rep->snapshots.held_rank == static_cast<int64_t>(r) && rep->snapshots.HasHeld(k)) {
          holders[r] = b;
          held_tensors[r] = rep->snapshots.held_tensors;
          break;
        }
      }
      if (alive(w)) stale.push_back(w);
    }
    if (!any_own) missing = "no survivor holds its own copy of step " + std::to_string(k);
    if (missing.empty()) {
      ChangeParticipants c = change;
      c.stale = stale;
      MORPH_ASSIGN_OR_RETURN(SnapshotChangePlan plan,
                             PlanForSnapshot(manifest, from, next, c, holders, held_tensors));
      for (size_t p = 0; p < plan.own.participants.size() && missing.empty(); ++p) {
        StatusOr<SnapshotRounds> rounds = PlanSnapshotRounds(plan, static_cast<int32_t>(p));
        if (rounds.status().code() == StatusCode::kDataLoss) {
          missing = std::string(rounds.status().message());
        } else if (!rounds.ok()) {
          return rounds.status();
        }
      }
      if (missing.empty()) {
        RecoveryChoice out;
        out.resume_step = k;
        out.stale = std::move(stale);
        out.plan_digest = plan.digest;
        out.decision.source = RecoveryDecision::Source::kSnapshot;
        out.decision.snapshot_holders = std::move(holders);
        out.explanation = "from snapshot of step " + std::to_string(k) + " (holders " +
                          Ids(out.decision.snapshot_holders) + ", lost " + Ids(change.lost) + ")";
        return std::optional<RecoveryChoice>(std::move(out));
      }
    }
    if (why.empty()) why = missing;
  }
  return std::optional<RecoveryChoice>();
}

}  // namespace

StatusOr<RecoveryChoice> ChooseRecovery(const JobManifest& manifest, const Generation& from,
                                        const Generation& next, const ChangeParticipants& change,
                                        std::span<const StepReportMsg> reports,
                                        const std::optional<RecoveryCheckpoint>& checkpoint) {
  const std::string gen = "recovery into generation " + std::to_string(next.id);
  std::vector<WorkerId> old_alive;
  for (WorkerId w : from.ranks) {
    if (std::find(change.lost.begin(), change.lost.end(), w) == change.lost.end()) {
      old_alive.push_back(w);
    }
  }
  std::map<WorkerId, const StepReportMsg*> by_worker;
  for (const StepReportMsg& r : reports) {
    if (std::find(old_alive.begin(), old_alive.end(), r.worker) == old_alive.end()) {
      return InvalidArgumentError(gen + ": report of worker " + std::to_string(r.worker) +
                                  ", which is no surviving old rank");
    }
    if (!by_worker.emplace(r.worker, &r).second) {
      return InvalidArgumentError(gen + ": two reports of worker " + std::to_string(r.worker));
    }
  }
  for (WorkerId w : old_alive) {
    if (!by_worker.count(w)) {
      return InvalidArgumentError(gen + ": no report of surviving old rank worker " +
                                  std::to_string(w));
    }
  }
  RecoveryChoice out;
  // The commit votes (Runtime::CommitUpdate): the vote of step p passed if it completed on any
  // survivor, or a survivor's state is past p (it could begin p + 1 only after the vote of p
  // completed on it). Every rank then voted, so every survivor whose vote of p is undecided
  // holds all its update needs: it applies it on a commit that resumes at p + 1.
  int64_t committed = -1;
  for (const auto& [w, r] : by_worker) {
    committed = std::max({committed, r->committed_step, r->state_step - 1});
  }
  auto rolls_forward = [&](const StepReportMsg& r) {
    return r.vote_step >= 0 && r.state_ok && r.state_step == r.vote_step &&
           r.vote_step <= committed;
  };
  int64_t newest = from.start_step;
  std::set<int64_t, std::greater<>> steps;  // whole states, newest first
  for (const auto& [w, r] : by_worker) {
    newest = std::max(newest, r->state_step);
    if (r->state_ok && r->state_step >= 0) steps.insert(r->state_step);
    if (r->undo_step >= 0) steps.insert(r->undo_step);
    if (rolls_forward(*r)) {
      steps.insert(r->vote_step + 1);
      newest = std::max(newest, r->vote_step + 1);
    }
  }
  out.decision.newest_step = newest;
  // Whether worker `r` can hold step `v`'s values: its live state, its undo copy (put back
  // before the exchange; runtime.cc, Switch), or its state once it applied the update of a
  // step whose vote passed (CommitUpdate returns OK to it when the commit resumes at v).
  auto holds = [&](const StepReportMsg& r, int64_t v) {
    return (r.state_ok && r.state_step == v) || r.undo_step == v ||
           (rolls_forward(r) && r.vote_step + 1 == v);
  };
  std::string first_missing;
  for (int64_t v : steps) {
    std::vector<WorkerId> stale;
    for (WorkerId w : old_alive) {
      if (!holds(*by_worker.at(w), v)) stale.push_back(w);
    }
    MORPH_ASSIGN_OR_RETURN(Coverage c, Check(manifest, from, next, change, stale), gen);
    if (!c.missing) {
      out.resume_step = v;
      out.stale = std::move(stale);
      out.plan_digest = c.digest;
      out.decision.source = RecoveryDecision::Source::kReplicas;
      out.explanation = "from the survivors' state at step " + std::to_string(v) + " (stale " +
                        Ids(out.stale) + ", lost " + Ids(change.lost) + ")";
      return out;
    }
    if (first_missing.empty()) first_missing = *c.missing;
  }
  if (steps.empty()) {
    first_missing = "the state (every survivor's is torn: its step failed during the update)";
  }
  std::string snapshot_missing;
  MORPH_ASSIGN_OR_RETURN(
      std::optional<RecoveryChoice> snap,
      ChooseSnapshot(manifest, from, next, change, old_alive, by_worker, snapshot_missing), gen);
  // A newer complete checkpoint loses fewer steps than an older snapshot (a tie: the snapshot,
  // served from memory).
  if (snap && !(checkpoint && checkpoint->step > snap->resume_step)) {
    snap->decision.newest_step = newest;
    snap->explanation += ": no surviving copy of " + first_missing;
    return *std::move(snap);
  }
  if (checkpoint) {
    MORPH_ASSIGN_OR_RETURN(Coverage c, Check(manifest, from, next, change, old_alive), gen);
    out.resume_step = checkpoint->step;
    out.stale = old_alive;
    out.plan_digest = c.digest;
    out.decision.source = RecoveryDecision::Source::kCheckpoint;
    out.decision.checkpoint = checkpoint->path;
    out.explanation = "from checkpoint " + checkpoint->path + " at step " +
                      std::to_string(checkpoint->step) + ": no surviving copy of " + first_missing;
    return out;
  }
  return DataLossError(gen + ": no copy of " + first_missing + " survives (lost workers " +
                       Ids(change.lost) + "; the survivors' whole states are at steps " +
                       [&] {
                         std::string s;
                         for (int64_t v : steps) s += (s.empty() ? "" : ",") + std::to_string(v);
                         return s.empty() ? std::string("none") : s;
                       }() +
                       "; snapshots: " + snapshot_missing +
                       "; no complete checkpoint (MORPH_CHECKPOINT_DIR))");
}

}  // namespace morph
