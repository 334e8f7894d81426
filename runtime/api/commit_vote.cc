// Runtime::CommitUpdate: the step's commit vote and what a worker does when its vote did not
// complete (docs/design.md §9 "Failures, as built", consistency). Why it keeps every survivor
// at one step without an undo copy:
//   - a rank votes only after its step's last collective, so every rank that voted holds what
//     its update needs, and it writes the state only after its own vote completed;
//   - the vote (an allreduce of one element) completes on a rank only once every rank of the
//     generation contributed: if it completed on any survivor, every survivor voted;
//   - a survivor whose vote did not complete reports vote_step; every other survivor reports
//     committed_step (or a state past the step). ChooseRecovery resumes at step + 1 exactly when
//     some survivor's vote completed, and the undecided ones then apply their update
//     (CommitUpdate returns OK to them) before the switch: every piece holds step + 1's values.
//     Otherwise no survivor wrote anything of the step, and it resumes at the step itself.
#include <glog/logging.h>

#include <algorithm>
#include <atomic>

#include "runtime/api/runtime_impl.h"
#include "runtime/api/test_hooks.h"

#if MORPH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace morph {
namespace {

std::atomic<int64_t>& DroppedVoteStep() {
  static std::atomic<int64_t> step{-1};
  return step;
}

}  // namespace

namespace testing_hooks {
void DropCommitVoteResult(int64_t step) { DroppedVoteStep().store(step); }
}  // namespace testing_hooks

Status Runtime::Impl::Vote(int64_t step) {
  GroupSet* groups = live.get();
  if (!groups) {
    return FailedPreconditionError("commit vote of step " + std::to_string(step) +
                                   ": this worker holds no communicators");
  }
  Communicator& world = groups->world();
  int64_t votes = 1;
  if (world.capabilities().host_memory) {
    MORPH_RETURN_IF_ERROR(
        world.Allreduce(&votes, 1, DType::kI64, ReduceOp::kSum, kDefaultCollectiveTimeout));
  } else {
#if MORPH_WITH_CUDA
    // NCCL takes device memory only: 8 bytes on the data plane's device (current on the
    // training thread), kept for the runtime's life.
    static thread_local void* dev = nullptr;
    if (dev == nullptr) {
      if (cudaError_t e = cudaMalloc(&dev, sizeof(votes)); e != cudaSuccess) {
        return InternalError(std::string("commit vote: cudaMalloc: ") + cudaGetErrorString(e));
      }
    }
    if (cudaError_t e = cudaMemcpy(dev, &votes, sizeof(votes), cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      return InternalError(std::string("commit vote: cudaMemcpy: ") + cudaGetErrorString(e));
    }
    MORPH_RETURN_IF_ERROR(
        world.Allreduce(dev, 1, DType::kI64, ReduceOp::kSum, kDefaultCollectiveTimeout));
    if (cudaError_t e = cudaMemcpy(&votes, dev, sizeof(votes), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return InternalError(std::string("commit vote: cudaMemcpy: ") + cudaGetErrorString(e));
    }
#else
    return InternalError("commit vote: the world communicator takes no host memory");
#endif
  }
  if (votes != gen.config.world()) {
    return InternalError("commit vote of step " + std::to_string(step) + ": " +
                         std::to_string(votes) + " votes in a world of " +
                         std::to_string(gen.config.world()));
  }
  if (DroppedVoteStep().load() == step) {
    DroppedVoteStep().store(-1);
    return AbortedError("commit vote of step " + std::to_string(step) +
                        ": result dropped (testing_hooks::DropCommitVoteResult)");
  }
  return Status();
}

Status Runtime::CommitUpdate() {
  Impl& m = *impl_;
  const int64_t s = m.next_step;
  MORPH_RETURN_IF_ERROR(m.core.CanVote(s));
  Status vote = m.Vote(s);
  if (vote.ok()) {
    m.committed_step = s;
    BeginUpdate();
    return Status();
  }
  // Undecided here: every other rank may or may not have the result.
  m.vote_step = s;
  if (Status ab = AbortStep(vote); !ab.ok()) {
    m.core.VoteSettled(false);
    return ab;
  }
  StatusOr<bool> apply = m.AwaitVoteOutcome(s);
  m.vote_step = -1;
  m.core.VoteSettled(apply.ok() && *apply);
  if (!apply.ok()) return apply.status();
  if (!*apply) {
    return AbortedError("step " + std::to_string(s) + " was not committed: its vote failed (" +
                        std::string(vote.message()) + ")");
  }
  // The vote passed elsewhere: this worker applies the step too. The recovery's commit is still
  // pending in the agent; EndStep and the next BeginStep apply it at step s + 1.
  m.committed_step = s;  // the step goes on in its update (no undo copy: the recovery resumes
  return Status();       // after it)
}

StatusOr<bool> Runtime::Impl::AwaitVoteOutcome(int64_t step) {
  const Deadline deadline = Deadline::AfterMs(opts.change_timeout_ms);
  while (true) {
    StatusOr<Agent::Decision> dec = agent->Decide(step, deadline);
    if (!dec.ok()) {
      return dec.status().WithContext("step " + std::to_string(step) +
                                      ": its commit vote failed and no recovery followed");
    }
    switch (dec->action) {
      case AgentCore::Action::kReport:
        MORPH_RETURN_IF_ERROR(ReportRecoveryState());
        continue;
      case AgentCore::Action::kSwitch: {
        // ChooseRecovery resumes at step + 1 with this worker's own state exactly when the
        // vote completed on some survivor.
        const CommitMsg& c = *dec->commit;
        const bool stale = std::find(c.change.stale.begin(), c.change.stale.end(), agent->id()) !=
                           c.change.stale.end();
        const bool apply = c.change.recovery &&
                           c.recovery.source == RecoveryDecision::Source::kReplicas &&
                           c.next.start_step == step + 1 && !stale;
        MORPH_LOG(INFO, agent->log()) << "the commit vote of step " << step
                  << (apply ? " passed elsewhere: applying its update"
                            : " did not pass: the step is not applied")
                  << "; generation " << c.next.id << " resumes at step " << c.next.start_step;
        return apply;
      }
      default:  // kFinished, kCannotSwitch, kProceed: no recovery of this step; BeginStep acts
        return false;
    }
  }
}

Status Runtime::Impl::ReportRecoveryState() {
  const bool whole = !core.torn() && state.intact();
  const SnapshotHoldings snaps = EndSnapshots();
  const int64_t undo_step = UndoStep();
  MORPH_LOG(INFO, agent->log()) << "recovery: state at step " << next_step
            << (whole ? " (whole)" : " (torn)")
            << (undo_step >= 0 ? ", undo copy of step " + std::to_string(undo_step) : std::string())
            << (vote_step >= 0 ? ", vote of step " + std::to_string(vote_step) + " undecided"
                               : std::string())
            << (committed_step >= 0 ? ", vote of step " + std::to_string(committed_step) + " passed"
                                    : std::string())
            << (snapshots ? "; snapshots: own " + std::to_string(snaps.local_step) + "/" +
                                std::to_string(snaps.local_prev_step) + ", held " +
                                std::to_string(snaps.held_step) + "/" +
                                std::to_string(snaps.held_prev_step) + " of rank " +
                                std::to_string(snaps.held_rank)
                          : std::string());
  return agent->ReportState(StepReportMsg{.state_step = next_step,
                                          .state_ok = whole,
                                          .snapshots = snaps,
                                          .undo_step = undo_step,
                                          .vote_step = vote_step,
                                          .committed_step = committed_step});
}

}  // namespace morph
