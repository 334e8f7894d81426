// The Runtime API's answers to bad input (runtime/api/runtime.h, options.h), in one process:
// exact status codes and messages for invalid Options, steps begun twice or ended without a
// step, a declare callback that registers a tensor twice, registration after Start; and Leave()
// called from code on a two-worker job (that worker's BeginStep returns done(), the other trains
// on alone).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "base/testing.h"
#include "morph/runtime.h"
#include "runtime/coordinator/coordinator.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;

Options Valid() {
  Options o;
  o.bootstrap = Bootstrap::kHost;
  o.model = {.num_layers = 1, .global_batch = 4};
  o.dataset_samples = 8;
  o.heartbeat_ms = 50;
  o.start_timeout_ms = 30000;
  o.change_timeout_ms = 30000;
  o.handle_sigterm = false;
  o.coordinator_file.clear();
  return o;
}

Status DeclareX(State& s) { return s.AddTensor("x", {4}, DType::kF32, Layout::Layer(0)); }

TEST(RuntimeApiTest, OptionsValidateNamesTheField) {
  struct Case {
    std::function<void(Options&)> change;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](Options& o) { o.micro_batch = 0; }, "micro_batch: must be at least 1, got 0"},
      {[](Options& o) { o.max_world = 0; }, "max_world: must be at least 1"},
      {[](Options& o) {
         o.initial_world = 5;
         o.max_world = 4;
       },
       "initial_world: 5 is outside [1, max_world=4]"},
      {[](Options& o) { o.initial_world = 0; }, "initial_world: 0 is outside [1, max_world=65536]"},
      {[](Options& o) { o.heartbeat_ms = 0; }, "heartbeat_ms: must be at least 1"},
      {[](Options& o) { o.heartbeat_timeout_ms = 0; }, "heartbeat_timeout_ms: must be at least 1 ms"},
      {[](Options& o) { o.start_timeout_ms = -1; }, "start_timeout_ms: must be at least 1 ms"},
      {[](Options& o) { o.change_timeout_ms = 0; }, "change_timeout_ms: must be at least 1 ms"},
      {[](Options& o) { o.leave_deadline_ms = 0; }, "leave_deadline_ms: must be at least 1 ms"},
      {[](Options& o) { o.dataset_samples = 0; }, "dataset_samples: must be at least 1, got 0"},
      {[](Options& o) { o.model.global_batch = 0; }, "model.global_batch: must be at least 1, got 0"},
  };
  for (const Case& c : cases) {
    Options o = Valid();
    c.change(o);
    EXPECT_THAT(o.Validate(), StatusIs(StatusCode::kInvalidArgument, c.message));
    // Start refuses the same options before it does anything.
    EXPECT_THAT(Runtime::Start(o, DeclareX).status(),
                StatusIs(StatusCode::kInvalidArgument, c.message));
  }
  EXPECT_TRUE(Valid().Validate().ok());
}

TEST(RuntimeApiTest, DeclareErrorsComeBackFromStart) {
  auto twice = [](State& s) -> Status {
    MORPH_RETURN_IF_ERROR(DeclareX(s));
    return DeclareX(s);
  };
  EXPECT_THAT(Runtime::Start(Valid(), twice).status(),
              StatusIs(StatusCode::kInvalidArgument, "tensor 'x' is registered twice"));
  auto failing = [](State&) -> Status { return AbortedError("the user's own error"); };
  EXPECT_THAT(Runtime::Start(Valid(), failing).status(),
              StatusIs(StatusCode::kAborted, "the user's own error"));
}

TEST(RuntimeApiTest, StepsAndRegistrationOutOfOrder) {
  StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Start(Valid(), DeclareX);
  ASSERT_TRUE(rt.ok()) << rt.status();
  Runtime& r = **rt;
  EXPECT_TRUE(r.fresh_start());
  EXPECT_EQ(r.rank(), 0);
  EXPECT_THAT(r.state().AddTensor("y", {4}, DType::kF32, Layout::Layer(0)),
              StatusIs(StatusCode::kFailedPrecondition, "tensor 'y' registered after Start"));
  EXPECT_THAT(r.state().AddScalar("s", 8),
              StatusIs(StatusCode::kFailedPrecondition, "scalar 's' registered after Start"));
  EXPECT_THAT(r.EndStep(), StatusIs(StatusCode::kFailedPrecondition, "EndStep: no step is open"));
  StatusOr<Step> s = r.BeginStep();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->done());
  EXPECT_EQ(s->index(), 0);
  EXPECT_EQ(s->world_size(), 1);
  EXPECT_THAT(r.BeginStep().status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       "BeginStep: step 0 is still open (call EndStep first)"));
  EXPECT_TRUE(r.EndStep().ok());
  EXPECT_THAT(r.EndStep(), StatusIs(StatusCode::kFailedPrecondition, "EndStep: no step is open"));
  s = r.BeginStep();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->index(), 1);
  EXPECT_THAT(r.BeginStep().status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       "BeginStep: step 1 is still open (call EndStep first)"));
  EXPECT_TRUE(r.EndStep().ok());
  EXPECT_TRUE(r.Finish(10000).ok());
  EXPECT_TRUE(r.Finish(10000).ok()) << "idempotent";
}

// CommitUpdate outside its place: no step open, or the update already begun. In a world of
// one the vote passes at once.
TEST(RuntimeApiTest, CommitUpdateOutOfOrder) {
  StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Start(Valid(), DeclareX);
  ASSERT_TRUE(rt.ok()) << rt.status();
  Runtime& r = **rt;
  EXPECT_THAT(r.CommitUpdate(),
              StatusIs(StatusCode::kFailedPrecondition, "CommitUpdate: no step is open"));
  ASSERT_TRUE(r.BeginStep().ok());
  MORPH_EXPECT_OK(r.CommitUpdate());
  EXPECT_THAT(r.CommitUpdate(),
              StatusIs(StatusCode::kFailedPrecondition,
                       "CommitUpdate: the update of step 0 already began (BeginUpdate or "
                       "CommitUpdate was called)"));
  MORPH_EXPECT_OK(r.EndStep());
  ASSERT_TRUE(r.BeginStep().ok());
  r.BeginUpdate();
  EXPECT_THAT(r.CommitUpdate(),
              StatusIs(StatusCode::kFailedPrecondition,
                       "CommitUpdate: the update of step 1 already began (BeginUpdate or "
                       "CommitUpdate was called)"));
  MORPH_EXPECT_OK(r.EndStep());
  // AbortStep is a no-op only after a CommitUpdate that failed.
  EXPECT_THAT(r.AbortStep(AbortedError("x")),
              StatusIs(StatusCode::kFailedPrecondition, "AbortStep: no step is open"));
  EXPECT_TRUE(r.Finish(10000).ok());
}

TEST(RuntimeApiTest, LeaveFromCodeLetsTheOtherWorkerGoOnAlone) {
  CoordinatorOptions c;
  c.token = "api-test-token";
  c.initial_world = 2;
  c.serve_http = false;
  c.heartbeat_timeout_ms = 20000;
  StatusOr<std::unique_ptr<Coordinator>> coord = Coordinator::Start(c);
  ASSERT_TRUE(coord.ok()) << coord.status();
  Options o = Valid();
  o.bootstrap = Bootstrap::kJoin;
  o.coordinator = (*coord)->control_address();
  o.token = c.token;
  o.shared_memory = false;  // two workers in one process: the reshard goes over Gloo

  constexpr int64_t kLeaveAt = 3;
  std::atomic<int64_t> leaver_done_at{-1};
  Status leaver_status, stayer_status;
  int64_t stayer_alone_at = -1, stayer_last = -1;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::thread leaver([&] {
    leaver_status = [&]() -> Status {
      MORPH_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::Start(o, DeclareX));
      while (std::chrono::steady_clock::now() < deadline) {
        MORPH_ASSIGN_OR_RETURN(Step s, rt->BeginStep());
        if (s.done()) {
          leaver_done_at = s.index();
          if (!rt->Finished()) return InternalError("done() but not Finished()");
          // Further calls keep answering done().
          MORPH_ASSIGN_OR_RETURN(Step again, rt->BeginStep());
          if (!again.done()) return InternalError("a second BeginStep after done() trains");
          return rt->Finish(10000);
        }
        if (s.index() == kLeaveAt) rt->Leave("test: Leave() from code");
        MORPH_RETURN_IF_ERROR(rt->EndStep());
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      return DeadlineExceededError("the leaver never got done()");
    }();
  });
  std::thread stayer([&] {
    stayer_status = [&]() -> Status {
      MORPH_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::Start(o, DeclareX));
      while (std::chrono::steady_clock::now() < deadline) {
        MORPH_ASSIGN_OR_RETURN(Step s, rt->BeginStep());
        if (s.done()) return InternalError("the stayer was let go");
        stayer_last = s.index();
        if (s.world_size() == 1 && stayer_alone_at < 0) stayer_alone_at = s.index();
        MORPH_RETURN_IF_ERROR(rt->EndStep());
        if (stayer_alone_at >= 0 && s.index() >= stayer_alone_at + 5) return rt->Finish(10000);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      return DeadlineExceededError("the stayer never trained alone");
    }();
  });
  leaver.join();
  stayer.join();
  EXPECT_TRUE(leaver_status.ok()) << leaver_status;
  EXPECT_TRUE(stayer_status.ok()) << stayer_status;
  EXPECT_GT(leaver_done_at.load(), kLeaveAt);
  EXPECT_GT(stayer_alone_at, kLeaveAt);
  EXPECT_EQ(stayer_last, stayer_alone_at + 5);
  EXPECT_TRUE((*coord)->Wait(Deadline::AfterMs(10000)).ok());
  CoordinatorSnapshot snap = (*coord)->Snapshot();
  EXPECT_EQ(snap.members.size(), 1u);
  EXPECT_EQ(snap.reconfigurations, 1);
  (*coord)->Stop();
}

}  // namespace
}  // namespace morph
