// The decider's cases a person reasons about, as short scripts (in the manner of etcd raft's
// rafttest/interaction_env): events in, the actions they produce rendered one per line. The
// seeded simulation (decider_sim_test.cc) covers the schedules nobody would write down.
//
// Script events (one per `;`):
//   join W | leave W | lost W | done W | heartbeat W | tick | failed W G (a FailureReport)
//   plan G dp=N ranks=A,B,...     the shell's PlanReady for proposal G
//   report W G B [state S ok|torn]  an old rank's StepReport (a recovery's with its state)
//   applied W G ok|failed          a participant's Applied
//   recovery G resume=S           the shell's RecoveryReady (every survivor current)
//   resize ID world=N | resize ID add=N | resize ID remove=W
// Rendered actions: "plan G from=F cand=... lost=... target=T", "prepare G to=...",
// "commit G S=... to=...", "abandon G to=...", "abort gG to=...", "outcome G applied|not to=...",
// "release W", "store G", "answer ID OK|CODE", "launch N", "choose G", "failed CODE: msg",
// "stopped CODE: msg", "complete gG".
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "runtime/coordinator/decider.h"

namespace morph {
namespace {

std::string Ids(const std::vector<WorkerId>& ids) {
  std::string s;
  for (WorkerId w : ids) s += (s.empty() ? "" : ",") + std::to_string(w);
  return s;
}

std::vector<WorkerId> ParseIds(const std::string& s) {
  std::vector<WorkerId> out;
  std::stringstream in(s);
  std::string tok;
  while (std::getline(in, tok, ',')) out.push_back(std::stoll(tok));
  return out;
}

std::string Render(const DeciderAction::Any& action) {
  std::ostringstream os;
  std::visit(
      [&](const auto& a) {
        using A = std::decay_t<decltype(a)>;
        if constexpr (std::is_same_v<A, DeciderAction::ComputePlan>) {
          os << "plan " << a.request.generation << " from=" << a.request.from.id
             << " cand=" << Ids(a.request.candidates) << " lost=" << Ids(a.request.lost)
             << " target=" << a.request.target_world;
        } else if constexpr (std::is_same_v<A, DeciderAction::SendPrepare>) {
          os << "prepare " << a.msg.next.id << (a.msg.change.recovery ? " recovery" : "")
             << " to=" << Ids(a.to);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendCommit>) {
          os << "commit " << a.msg.next.id << " S=" << a.msg.next.start_step
             << " ranks=" << Ids(a.msg.next.ranks) << " to=" << Ids(a.to);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendAbandon>) {
          os << "abandon " << a.msg.generation << " to=" << Ids(a.to);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendAbort>) {
          os << "abort g" << a.msg.generation << " to=" << Ids(a.to);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendOutcome>) {
          os << "outcome " << a.msg.generation << (a.msg.applied ? " applied" : " not")
             << " to=" << Ids(a.to);
        } else if constexpr (std::is_same_v<A, DeciderAction::SendRelease>) {
          os << "release " << a.to;
        } else if constexpr (std::is_same_v<A, DeciderAction::AdvanceStore>) {
          os << "store " << a.generation;
        } else if constexpr (std::is_same_v<A, DeciderAction::AnswerResize>) {
          os << "answer " << a.request_id << " "
             << (a.status.ok() ? "OK" : std::string(StatusCodeName(a.status.code())));
        } else if constexpr (std::is_same_v<A, DeciderAction::LaunchWorkers>) {
          os << "launch " << a.count;
        } else if constexpr (std::is_same_v<A, DeciderAction::Disconnect>) {
          os << "disconnect " << a.worker;
        } else if constexpr (std::is_same_v<A, DeciderAction::JobFailed>) {
          os << "failed " << StatusCodeName(a.status.code()) << ": " << a.status.message();
        } else if constexpr (std::is_same_v<A, DeciderAction::JobComplete>) {
          os << "complete g" << a.generation;
        } else if constexpr (std::is_same_v<A, DeciderAction::JobStopped>) {
          os << "stopped " << StatusCodeName(a.status.code()) << ": " << a.status.message();
        } else if constexpr (std::is_same_v<A, DeciderAction::ChooseRecovery>) {
          os << "choose " << a.generation;
        } else if constexpr (std::is_same_v<A, DeciderAction::FindResumeCheckpoint>) {
          os << "find-checkpoint " << a.generation;        }  // AckDone: left out of the scripts (EveryDoneIsAcknowledged checks it)
      },
      action);
  return os.str();
}

class Script {
 public:
  explicit Script(DeciderOptions o) : d_(o) {}

  // Feeds the events; returns the actions, one per line ("" when none).
  std::string Run(const std::string& events) {
    std::string out;
    std::stringstream in(events);
    std::string line;
    while (std::getline(in, line, ';')) {
      std::stringstream ev(line);
      std::string kind;
      if (!(ev >> kind)) continue;
      for (const auto& a : d_.Handle(now_, Parse(kind, ev))) {
        if (!std::holds_alternative<DeciderAction::AckDone>(a)) out += Render(a) + "\n";
      }
    }
    return out;
  }
  Decider& decider() { return d_; }
  void set_now(int64_t t) { now_ = t; }

 private:
  static DeciderEvent::Any Parse(const std::string& kind, std::stringstream& ev) {
    WorkerId w = 0;
    int64_t g = 0;
    std::string arg;
    if (kind == "join") return ev >> w, DeciderEvent::Any(DeciderEvent::Join{.worker = w});
    if (kind == "leave") return ev >> w, DeciderEvent::Any(DeciderEvent::LeaveRequest{w});
    if (kind == "lost") return ev >> w, DeciderEvent::Any(DeciderEvent::Lost{w, "killed"});
    if (kind == "done") return ev >> w, DeciderEvent::Any(DeciderEvent::Done{w});
    if (kind == "heartbeat") return ev >> w, DeciderEvent::Any(DeciderEvent::Heartbeat{w});
    if (kind == "tick") return DeciderEvent::Tick{};
    if (kind == "failed") {
      ev >> w >> g;
      return DeciderEvent::Any(DeciderEvent::FailureReport{
          .worker = w, .report = FailureReportMsg{.generation = g}});
    }
    if (kind == "plan") {
      std::string dp, ranks;
      ev >> g >> dp >> ranks;
      PlannedChange p{.config = ParallelConfig{.dp = std::stoi(dp.substr(3))},
                      .ranks = ParseIds(ranks.substr(6)),
                      .plan_digest = static_cast<uint64_t>(100 + g)};
      return DeciderEvent::PlanReady{.generation = g, .plan = p};
    }
    if (kind == "report") {
      int64_t b = 0;
      StepReportMsg r;
      ev >> w >> g >> b;
      r = StepReportMsg{.worker = w, .generation = g, .last_free_step = b};
      std::string state;
      if (ev >> state >> r.state_step >> arg) r.state_ok = arg == "ok";
      return r;
    }
    if (kind == "applied") {
      ev >> w >> g >> arg;
      return AppliedMsg{.worker = w, .generation = g, .ok = arg == "ok"};
    }
    if (kind == "recovery") {
      ev >> g >> arg;
      RecoveryChoice c;
      c.resume_step = std::stoll(arg.substr(7));
      c.plan_digest = 200 + g;
      return DeciderEvent::RecoveryReady{.generation = g, .choice = c};
    }
    if (kind == "resize") {
      ResizeRequest r;
      ev >> r.request_id >> arg;
      const std::string key = arg.substr(0, arg.find('='));
      const int64_t v = std::stoll(arg.substr(arg.find('=') + 1));
      if (key == "world") r.world_size = static_cast<int>(v);
      if (key == "add") r.add = static_cast<int>(v);
      if (key == "remove") r.remove = {v};
      return DeciderEvent::Resize{r};
    }
    ADD_FAILURE() << "unknown event '" << kind << "'";
    return DeciderEvent::Tick{};
  }

  Decider d_;
  int64_t now_ = 0;
};

// Workers 1 and 2 train generation 1 (dp=2).
Script Running(int max_world = 8) {
  Script s(DeciderOptions{.initial_world = 2, .max_world = max_world});
  s.Run("join 1; join 2; plan 1 dp=2 ranks=1,2; applied 1 1 ok; applied 2 1 ok");
  return s;
}

// The audit's hang: a shrink committed for a step past the last one. Both workers finish
// without switching (their Done, no Applied): the change closes as not applied and the job
// completes (before, it stayed "committed" for ever).
TEST(DeciderScriptTest, ACommitPastTheLastStepIsDroppedAndTheJobCompletes) {
  Script s = Running();
  EXPECT_EQ(s.Run("resize 7 world=1"), "answer 7 OK\nplan 2 from=1 cand=1,2 lost= target=1\n");
  EXPECT_EQ(s.Run("plan 2 dp=1 ranks=1"), "store 2\nprepare 2 to=1,2\n");
  EXPECT_EQ(s.Run("report 1 2 6; report 2 2 6"), "commit 2 S=7 ranks=1 to=1,2\n");
  EXPECT_EQ(s.Run("done 1"), "");
  EXPECT_EQ(s.Run("done 2"), "outcome 2 not to=1,2\ncomplete g1\n");
  EXPECT_EQ(s.decider().phase(), Decider::Phase::kComplete);
  EXPECT_FALSE(s.decider().resize_in_progress());
}

// The same with a joiner waiting in the change's exchange: the first old rank that finishes
// aborts it out of the exchange; its failed Applied closes the change; the job completes and
// releases it (its Start returns, finished).
TEST(DeciderScriptTest, AJoinerWaitingForAStepPastTheEndIsAbortedAndReleased) {
  Script s = Running();
  s.Run("resize 7 add=1; join 3");
  EXPECT_EQ(s.Run("plan 2 dp=3 ranks=1,2,3"), "store 2\nprepare 2 to=1,2,3\n");
  EXPECT_EQ(s.Run("report 1 2 5; report 2 2 5"), "commit 2 S=6 ranks=1,2,3 to=1,2,3\n");
  EXPECT_EQ(s.Run("done 2"), "abort g1 to=3\n");
  EXPECT_EQ(s.Run("lost 2; done 1"), "");
  EXPECT_EQ(s.Run("applied 3 2 failed"),
            "outcome 2 not to=1,2,3\nrelease 3\ncomplete g1\n");
}

// A change committed at a step the workers still reach applies as usual; Done comes after it
// in the new generation.
TEST(DeciderScriptTest, ACommitBeforeTheLastStepAppliesFirst) {
  Script s = Running();
  s.Run("resize 7 world=1; plan 2 dp=1 ranks=1; report 1 2 3; report 2 2 3");
  EXPECT_EQ(s.Run("applied 1 2 ok; done 1"), "");  // Done in generation 2, before 2's Applied
  EXPECT_EQ(s.Run("applied 2 2 ok"), "outcome 2 applied to=1,2\ncomplete g2\n");
}

// Done during a prepare: the proposal is abandoned (the other old rank's gate opens so it
// finishes its last step), and the job completes.
TEST(DeciderScriptTest, ADoneDuringAPrepareAbandonsIt) {
  Script s = Running();
  s.Run("resize 7 add=1; join 3; plan 2 dp=3 ranks=1,2,3; report 1 2 6");
  EXPECT_EQ(s.Run("done 1"), "abandon 2 to=1,2,3\n");
  EXPECT_EQ(s.Run("report 2 2 6"), "");  // stale
  EXPECT_EQ(s.Run("done 2"), "release 3\ncomplete g1\n");
}

// Done while a plan is computed: its PlanReady is ignored.
TEST(DeciderScriptTest, ADoneWhilePlanningDropsThePlan) {
  Script s = Running();
  s.Run("resize 7 world=1");
  EXPECT_EQ(s.Run("done 2"), "");
  EXPECT_EQ(s.Run("plan 2 dp=1 ranks=1; done 1"), "complete g1\n");
}

// A member lost in the last step: the survivor that finished ends the job; the one waiting for
// the recovery is released instead of waiting for ever. A failure reported after the first Done
// releases its reporter the same way.
TEST(DeciderScriptTest, ADoneDuringARecoveryReleasesTheSurvivorsThatWait) {
  Script s(DeciderOptions{.initial_world = 3, .max_world = 3});
  s.Run("join 1; join 2; join 3; plan 1 dp=3 ranks=1,2,3");
  s.Run("applied 1 1 ok; applied 2 1 ok; applied 3 1 ok");
  EXPECT_EQ(s.Run("lost 3"), "abort g1 to=1,2\nplan 2 from=1 cand=1,2 lost=3 target=2\n");
  EXPECT_EQ(s.Run("plan 2 dp=2 ranks=1,2"), "store 2\nprepare 2 recovery to=1,2\n");
  EXPECT_EQ(s.Run("report 2 2 9 state 9 ok"), "");
  EXPECT_EQ(s.Run("done 1"), "abandon 2 to=1,2\nrelease 2\n");
  EXPECT_EQ(s.Run("done 2"), "complete g1\n");
}

// A participant that passed the closing barrier trains the new generation's first step at
// once; when that step fails (a collective aborted), its report can arrive before the last
// Applied. It is the new generation's failure: once the change is applied, a recovery follows
// (it was dropped, and the reporters waited for a decision until their timeout: failure_test).
TEST(DeciderScriptTest, AFailureInTheNewGenerationBeforeItsOutcomeIsRecovered) {
  Script s = Running();
  s.Run("resize 7 add=1; join 3; plan 2 dp=3 ranks=1,2,3; report 1 2 6");
  EXPECT_EQ(s.Run("report 2 2 6"), "commit 2 S=7 ranks=1,2,3 to=1,2,3\n");
  EXPECT_EQ(s.Run("applied 1 2 ok; failed 1 2; applied 2 2 ok"), "");
  EXPECT_EQ(s.Run("applied 3 2 ok"),
            "outcome 2 applied to=1,2,3\nplan 3 from=2 cand=1,2,3 lost= target=3\n");
}

// A worker that leaves in the change exits once its exchange is done: its Applied(ok), then its
// connection closes, while the others may still be in the closing barrier. That is its
// departure, not a loss: no abort (which reached the others' new groups before their barrier
// returned, failed their first step and, with its state taken for torn, ended the job with
// DATA_LOSS: elastic_test StandbySpareTakesARank under load).
TEST(DeciderScriptTest, AnExitingWorkerThatAppliedAndLeftIsNotALoss) {
  Script s = Running();
  s.Run("resize 7 world=1; plan 2 dp=1 ranks=1; report 1 2 3");
  EXPECT_EQ(s.Run("report 2 2 3"), "commit 2 S=4 ranks=1 to=1,2\n");
  EXPECT_EQ(s.Run("applied 2 2 ok; lost 2"), "");
  EXPECT_EQ(s.Run("applied 1 2 ok"), "outcome 2 applied to=1\n");
}

TEST(DeciderScriptTest, AFailureReportedAfterTheFirstDoneReleasesItsReporter) {
  Script s = Running();
  EXPECT_EQ(s.Run("done 1"), "");
  auto out = s.decider().Handle(
      0, DeciderEvent::FailureReport{.worker = 2, .report = FailureReportMsg{.generation = 1}});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(Render(out[0]), "release 2");
  EXPECT_EQ(s.Run("done 2"), "complete g1\n");
}

// A member that dies inside the last step while another finished: the members still in theirs
// are aborted (their collectives would wait on it); it is not recovered.
TEST(DeciderScriptTest, AMemberLostWhileFinishingAbortsTheOthersLastStep) {
  Script s(DeciderOptions{.initial_world = 3, .max_world = 3});
  s.Run("join 1; join 2; join 3; plan 1 dp=3 ranks=1,2,3");
  s.Run("applied 1 1 ok; applied 2 1 ok; applied 3 1 ok");
  EXPECT_EQ(s.Run("done 1"), "");  // 2 and 3 finish their last step too
  EXPECT_EQ(s.Run("lost 3"), "abort g1 to=2\nrelease 2\n");
  EXPECT_EQ(s.Run("lost 1; done 2"), "complete g1\n");
}

// Every worker asked to leave (the whole job preempted): the job stops as asked, no failure
// (before, it "failed" and every leaver logged an error). With a worker lost on the way the
// state is gone: that is a failure.
TEST(DeciderScriptTest, EveryWorkerLeavingStopsTheJob) {
  Script s = Running();
  EXPECT_EQ(s.Run("leave 1"), "plan 2 from=1 cand=2 lost= target=1\n");
  EXPECT_EQ(s.Run("leave 2; plan 2 dp=1 ranks=2"),
            "stopped CANCELLED: the job stopped: every worker was asked to leave; no worker "
            "remains to take the state of generation 1\n");
  EXPECT_EQ(s.decider().phase(), Decider::Phase::kStopped);
  EXPECT_EQ(s.Run("lost 1; lost 2; tick"), "");
}

TEST(DeciderScriptTest, EveryWorkerLeavingOrLostFailsTheJob) {
  Script s = Running();
  EXPECT_EQ(s.Run("lost 1"), "abort g1 to=2\nplan 2 from=1 cand=2 lost=1 target=1\n");
  EXPECT_EQ(s.Run("leave 2; plan 2 dp=1 ranks=2"),
            "failed FAILED_PRECONDITION: every worker is leaving or lost: no worker remains to "
            "take the state of generation 1\n");
}

// A Done from a worker that holds no rank (a spare) does not end the job.
TEST(DeciderScriptTest, ADoneFromASpareIsIgnored) {
  Script s = Running(2);
  s.Run("join 3");
  EXPECT_EQ(s.Run("done 3"), "");
  EXPECT_FALSE(s.decider().finishing());
  EXPECT_EQ(s.Run("resize 7 world=1"), "answer 7 OK\nplan 2 from=1 cand=1,2,3 lost= target=1\n");
}

// Completion: Done from every member (a member closing after it is no loss) completes the job,
// releases the spares, and no change or resize follows.
TEST(DeciderScriptTest, DoneFromEveryMemberCompletesTheJob) {
  Script s = Running(2);
  s.Run("join 3");  // a spare (max_world 2)
  EXPECT_EQ(s.Run("done 1"), "");  // 2 finishes its last step and says so
  EXPECT_TRUE(s.decider().finishing());
  EXPECT_EQ(s.Run("resize 5 world=1"), "answer 5 FAILED_PRECONDITION\n");
  EXPECT_EQ(s.Run("lost 1"), "");  // closes after Done: no change is proposed
  EXPECT_EQ(s.Run("done 2"), "release 3\ncomplete g1\n");
  EXPECT_EQ(s.decider().phase(), Decider::Phase::kComplete);
  s.set_now(100000);
  EXPECT_EQ(s.Run("tick"), "");
}

template <typename A>
std::vector<A> Actions(const std::vector<DeciderAction::Any>& out) {
  std::vector<A> v;
  for (const auto& a : out) {
    if (const A* x = std::get_if<A>(&a)) v.push_back(*x);
  }
  return v;
}

// Every Done is acknowledged, once the decider recorded it (the shell persists before it sends
// the acknowledgment): a member's, a duplicate, a spare's it ignores, and one after the job
// completed. With failover a worker's Finish waits for it.
TEST(DeciderScriptTest, EveryDoneIsAcknowledged) {
  Script s = Running(2);
  s.Run("join 3");
  auto acked = [&](WorkerId w) {
    std::vector<DeciderAction::AckDone> a =
        Actions<DeciderAction::AckDone>(s.decider().Handle(0, DeciderEvent::Done{.worker = w}));
    return a.size() == 1 && a[0].to == w;
  };
  EXPECT_TRUE(acked(3));  // a spare: ignored, acknowledged
  EXPECT_TRUE(acked(1));
  EXPECT_TRUE(acked(1));  // said again (to a successor, or a late duplicate)
  EXPECT_TRUE(acked(2));
  EXPECT_EQ(s.decider().phase(), Decider::Phase::kComplete);
  EXPECT_TRUE(acked(3));  // released at the end, says Done after it
}

// Resume at start: the first generation's plan is followed by FindResumeCheckpoint, not a
// commit; the checkpoint's answer commits it as a recovery at the checkpoint's step (or afresh
// at 0 without one); an error fails the job; a worker lost meanwhile abandons the proposal and
// the stale answer is ignored. Generation ids start at first_generation.
TEST(DeciderTest, ResumeCommitsTheFirstGenerationAtTheCheckpointsStep) {
  const PlannedChange plan{.config = ParallelConfig{.dp = 2}, .ranks = {1, 2}, .plan_digest = 9};
  auto start = [&](Decider& d) {
    d.Handle(0, DeciderEvent::Join{.worker = 1});
    auto out = d.Handle(0, DeciderEvent::Join{.worker = 2});
    auto plans = Actions<DeciderAction::ComputePlan>(out);
    EXPECT_EQ(plans.size(), 1u);
    const int64_t g = plans.empty() ? 0 : plans[0].request.generation;
    out = d.Handle(0, DeciderEvent::PlanReady{.generation = g, .plan = plan});
    EXPECT_TRUE(Actions<DeciderAction::SendCommit>(out).empty());
    auto finds = Actions<DeciderAction::FindResumeCheckpoint>(out);
    EXPECT_EQ(finds.size(), 1u);
    EXPECT_EQ(finds.empty() ? -1 : finds[0].generation, g);
    return g;
  };
  const DeciderOptions opts{
      .initial_world = 2, .max_world = 2, .resume = true, .first_generation = 4};
  {
    Decider d(opts);
    const int64_t g = start(d);
    EXPECT_EQ(g, 4);
    auto out = d.Handle(0, DeciderEvent::ResumeReady{.generation = g,
                                                     .checkpoint = RecoveryCheckpoint{
                                                         .step = 12, .path = "c/step-12-g3"}});
    auto commits = Actions<DeciderAction::SendCommit>(out);
    ASSERT_EQ(commits.size(), 1u);
    const CommitMsg& c = commits[0].msg;
    EXPECT_EQ(c.next.id, 4);
    EXPECT_EQ(c.next.start_step, 12);
    EXPECT_EQ(c.from_generation, 0);
    EXPECT_TRUE(c.change.recovery);
    EXPECT_EQ(c.recovery.source, RecoveryDecision::Source::kCheckpoint);
    EXPECT_EQ(c.recovery.checkpoint, "c/step-12-g3");
    EXPECT_EQ(c.recovery.newest_step, 12);
    EXPECT_EQ(c.next.ranks, plan.ranks);
    d.Handle(0, AppliedMsg{.worker = 1, .generation = 4});
    d.Handle(0, AppliedMsg{.worker = 2, .generation = 4});
    EXPECT_EQ(d.current().id, 4);
    EXPECT_EQ(d.current().start_step, 12);
    EXPECT_EQ(d.phase(), Decider::Phase::kStable);
  }
  {
    // A damaged newer checkpoint (step 16) was passed over: the steps since 12 count as lost.
    Decider d(opts);
    const int64_t g = start(d);
    auto out = d.Handle(
        0, DeciderEvent::ResumeReady{
               .generation = g,
               .checkpoint = RecoveryCheckpoint{.step = 12, .path = "c/step-12-g3",
                                                .skipped_step = 16}});
    auto commits = Actions<DeciderAction::SendCommit>(out);
    ASSERT_EQ(commits.size(), 1u);
    EXPECT_EQ(commits[0].msg.next.start_step, 12);
    EXPECT_EQ(commits[0].msg.recovery.newest_step, 16);
  }
  {
    Decider d(opts);
    const int64_t g = start(d);
    auto out = d.Handle(0, DeciderEvent::ResumeReady{.generation = g});
    auto commits = Actions<DeciderAction::SendCommit>(out);
    ASSERT_EQ(commits.size(), 1u);
    EXPECT_EQ(commits[0].msg.next.start_step, 0);
    EXPECT_FALSE(commits[0].msg.change.recovery);
  }
  {
    Decider d(opts);
    const int64_t g = start(d);
    auto out =
        d.Handle(0, DeciderEvent::ResumeReady{
                        .generation = g, .status = FailedPreconditionError("tensor 'w' differs")});
    auto failed = Actions<DeciderAction::JobFailed>(out);
    ASSERT_EQ(failed.size(), 1u);
    EXPECT_EQ(failed[0].status.code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(failed[0].status.message(), "tensor 'w' differs");
    EXPECT_EQ(d.phase(), Decider::Phase::kFailed);
  }
  {
    Decider d(opts);
    const int64_t g = start(d);
    auto out = d.Handle(0, DeciderEvent::Lost{.worker = 2, .reason = "killed"});
    EXPECT_EQ(Actions<DeciderAction::SendAbandon>(out).size(), 1u);
    EXPECT_TRUE(d.Handle(0, DeciderEvent::ResumeReady{.generation = g}).empty());
    out = d.Handle(0, DeciderEvent::Join{.worker = 3});
    auto plans = Actions<DeciderAction::ComputePlan>(out);
    ASSERT_EQ(plans.size(), 1u);
    EXPECT_GT(plans[0].request.generation, g);
  }
}

// A survivor whose training thread cannot reach its step boundary after an abort (a collective
// the abort did not wake) never reports its state: a heartbeat timeout after the recovery's
// prepare it is dropped like a silent worker, and the recovery goes on without it (before, the
// others waited until their own change timeout and the job failed).
TEST(DeciderTest, ASurvivorThatNeverReportsItsStateIsDroppedAfterTheHeartbeatTimeout) {
  Decider d(DeciderOptions{.initial_world = 3, .max_world = 3, .heartbeat_timeout_ms = 1000});
  d.Handle(0, DeciderEvent::Join{.worker = 1});
  d.Handle(0, DeciderEvent::Join{.worker = 2});
  d.Handle(0, DeciderEvent::Join{.worker = 3});
  PlannedChange g1{.config = ParallelConfig{.dp = 3}, .ranks = {1, 2, 3}, .plan_digest = 1};
  d.Handle(0, DeciderEvent::PlanReady{.generation = 1, .plan = g1});
  for (WorkerId w : {1, 2, 3}) d.Handle(0, AppliedMsg{.worker = w, .generation = 1});
  auto out = d.Handle(100, DeciderEvent::Lost{.worker = 3, .reason = "killed"});
  auto plans = Actions<DeciderAction::ComputePlan>(out);
  ASSERT_EQ(plans.size(), 1u);
  PlannedChange g2{.config = ParallelConfig{.dp = 2}, .ranks = {1, 2}, .plan_digest = 2};
  out = d.Handle(100, DeciderEvent::PlanReady{.generation = plans[0].request.generation, .plan = g2});
  auto prepares = Actions<DeciderAction::SendPrepare>(out);
  ASSERT_EQ(prepares.size(), 1u);
  ASSERT_TRUE(prepares[0].msg.change.recovery);
  d.Handle(200, StepReportMsg{.worker = 1, .generation = prepares[0].msg.next.id,
                              .last_free_step = 7, .state_step = 7, .state_ok = true});
  // Worker 2 keeps heartbeating (its control thread is fine) but never reports.
  for (int64_t t = 300; t <= 1000; t += 100) {
    EXPECT_TRUE(Actions<DeciderAction::Disconnect>(d.Handle(t, DeciderEvent::Heartbeat{.worker = 2}))
                    .empty());
    d.Handle(t, DeciderEvent::Heartbeat{.worker = 1});
    EXPECT_TRUE(Actions<DeciderAction::Disconnect>(d.Handle(t, DeciderEvent::Tick{})).empty()) << t;
  }
  d.Handle(1150, DeciderEvent::Heartbeat{.worker = 1});
  d.Handle(1150, DeciderEvent::Heartbeat{.worker = 2});
  out = d.Handle(1150, DeciderEvent::Tick{});
  auto dropped = Actions<DeciderAction::Disconnect>(out);
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0].worker, 2);
  EXPECT_NE(dropped[0].reason.find("no state report for generation 2's recovery within 1000 ms"),
            std::string::npos)
      << dropped[0].reason;
  // The recovery starts over without it.
  plans = Actions<DeciderAction::ComputePlan>(out);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].request.candidates, std::vector<WorkerId>{1});
}

}  // namespace
}  // namespace morph
