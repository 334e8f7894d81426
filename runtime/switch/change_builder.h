// ChangeBuilder: a worker builds the next generation beside the running one, between a change's
// prepare and its switch step (docs/design.md, "Planned change"): on the control thread's
// Prepare it starts a thread that connects to generation g+1's store and runs PrepareSwitch
// (switch.h: the change communicator, the new groups, pre-allocated shards), then says so
// (`ready`: the agent answers the prepare only then, so the stall at the switch step is the
// transfer alone). At the switch step the training thread takes what was built (Take); an
// abandoned build is kept aside and joined at a step boundary; the coordinator's Abort reaches a
// build in progress, one built, and one the training thread is switching with (AbortFrom).
//
//   ChangeBuilder builder({.manifest = m, .me = id, .store_address = a, .token = t, ...});
//   builder.Start(prepare, options, [&] { agent.ReportPrepared(prepare); });   // control thread
//   MORPH_ASSIGN_OR_RETURN(auto built, builder.Take(commit, store, options, deadline));
//   ... ExecuteSwitch(**built->result, ...); builder.Done();                   // training thread
//
// Threads: Start, Abandon and AbortFrom on the control thread (any thread); Take, Done,
// JoinStale and JoinOrDetach on the training thread.
#ifndef MORPH_RUNTIME_SWITCH_CHANGE_BUILDER_H_
#define MORPH_RUNTIME_SWITCH_CHANGE_BUILDER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "collectives/groups.h"
#include "collectives/store/tcp_store.h"
#include "runtime/protocol/messages.h"
#include "runtime/switch/switch.h"

namespace morph {

class ChangeBuilder {
 public:
  // What every build of this worker's needs, fixed for its life.
  struct Inputs {
    JobManifest manifest;
    WorkerId me = 0;
    std::string store_address;  // the job's store (the coordinator's)
    std::string token;
    int64_t timeout_ms = 0;  // one change (MORPH_CHANGE_TIMEOUT_MS)
    CommunicatorFactory factory;
  };

  // One generation built beside the running one. Shared by the builder and its thread: an
  // abandoned one still building when the runtime goes away (its communicators wait on a peer
  // that died, up to the change timeout) is detached and ends on its own, touching nothing of
  // the runtime's.
  struct Built {
    int64_t generation = 0;
    int64_t from = -1;  // the generation the change starts from
    // Cancels the build's communicator creations in progress (SwitchOptions::cancel).
    std::shared_ptr<BuildCancel> cancel;
    std::thread thread;
    std::mutex mu;  // `store` and `result` while the thread runs
    std::unique_ptr<TcpStoreClient> store;
    std::string store_address;  // where `store` is connected
    StatusOr<std::unique_ptr<PreparedSwitch>> result = InternalError("not built yet");
    std::atomic<bool> finished{false};  // the thread is done (JoinStale joins it)
    // A newer prepare replaced it before it was built: it does not answer its prepare.
    std::atomic<bool> superseded{false};
    // An abort of the generation the change starts from that came while it was being built
    // (-1: none): applied to the result as soon as there is one (SetResult).
    int64_t aborted_from = -1;
    // Under `mu`: stores the build's result, aborting it if an abort came first.
    void SetResult(StatusOr<std::unique_ptr<PreparedSwitch>> built);
  };
  using BuiltPtr = std::shared_ptr<Built>;

  explicit ChangeBuilder(Inputs inputs) : in_(std::move(inputs)) {}
  ~ChangeBuilder() { JoinOrDetach(std::chrono::milliseconds(0)); }
  ChangeBuilder(const ChangeBuilder&) = delete;
  ChangeBuilder& operator=(const ChangeBuilder&) = delete;

  // A prepare for a generation this worker takes part in: builds it on a thread of its own and
  // calls `ready` when done (or failed; the failure shows at the switch step). A duplicate (a
  // generation not newer than the latest build) is ignored; the build it replaces is abandoned.
  void Start(const PrepareMsg& p, SwitchOptions options, std::function<void()> ready);
  // The coordinator abandoned `generation`: its build is kept aside (JoinStale).
  void Abandon(int64_t generation);
  // The coordinator's Abort of generation `from`: the change from it, being built, built, or
  // being switched with, fails with kAborted (PreparedSwitch::Abort), however far it got.
  void AbortFrom(int64_t from);

  // The switch step: what was built for `c` (joined), or — when no prepare came (a joiner that
  // registered after it, a commit without a prepare) — built now on `store`'s generation
  // c.next.id. Reachable by AbortFrom until Done(). Errors: the store's (ForGeneration).
  StatusOr<BuiltPtr> Take(const CommitMsg& c, TcpStoreClient& store, const SwitchOptions& options,
                          Deadline deadline);
  // The switch with what Take returned is over: an abort no longer reaches it.
  void Done();

  // Coordinator failover: the successor hosts the job's store elsewhere; builds started from now
  // on rendezvous there. Any thread.
  void SetStoreAddress(std::string address) {
    std::lock_guard<std::mutex> l(mu_);
    if (address != in_.store_address) store_moved_ = true;
    in_.store_address = std::move(address);
  }
  // The job's store as last known (the Welcome's, or the successor's). Any thread.
  std::string store_address() {
    std::lock_guard<std::mutex> l(mu_);
    return in_.store_address;
  }

  // Joins the abandoned builds whose thread is done (at a step boundary: one still connecting
  // to a peer that died ends at its deadline, and the training thread must not wait for it).
  void JoinStale();
  // At the end: every build still held. Those done within `grace` are joined; the others are
  // detached after `ready` is shut off from them, so that a worker leaves at once when its job
  // is over.
  void JoinOrDetach(std::chrono::milliseconds grace);

 private:
  // Whether `ready` may still be called (false once the builder is being destroyed: a detached
  // build's thread must not call into the agent).
  struct ReadyGate {
    std::mutex mu;
    bool open = true;
  };

  Inputs in_;  // mu_ (only the store address changes)
  std::mutex mu_;
  bool store_moved_ = false;       // a successor hosts the store: Take connects there
  BuiltPtr latest_;                // the latest prepare's build
  BuiltPtr switching_;             // the one the training thread is switching with
  std::vector<BuiltPtr> stale_;    // abandoned ones, joined by the training thread
  std::shared_ptr<ReadyGate> gate_ = std::make_shared<ReadyGate>();
};

}  // namespace morph

#endif  // MORPH_RUNTIME_SWITCH_CHANGE_BUILDER_H_
