// LiveGroups: the running generation's communicators (world, dp, tp, pp) on a worker, as the
// switch replaces them: the training thread uses them through Step, the control thread aborts
// them when a peer failed (so a collective returns kAborted instead of hanging), and a switch
// installs the next generation's while the old ones are torn down on a thread of their own
// (tearing Gloo contexts down takes tens of milliseconds, which would otherwise be stall).
//
//   LiveGroups live;
//   live.Adopt(TakeGroups(prepared), std::move(built));   // after the closing barrier
//   Step(..., live.get());                               // training thread
//   live.AbortAll("worker 7 lost", /*generation=*/4);      // control thread
//
// Threads: get, Adopt and Take on the training thread; AbortAll and can_shrink from any thread.
#ifndef MORPH_RUNTIME_SWITCH_LIVE_GROUPS_H_
#define MORPH_RUNTIME_SWITCH_LIVE_GROUPS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "collectives/groups.h"

namespace morph {

class LiveGroups {
 public:
  LiveGroups() = default;
  ~LiveGroups();
  LiveGroups(const LiveGroups&) = delete;
  LiveGroups& operator=(const LiveGroups&) = delete;

  // The running generation's groups (null before the first generation, or on a worker that holds
  // no rank). Training thread: only it replaces them.
  GroupSet* get() const { return groups_.get(); }

  // Installs `next` as the running groups. The old ones, and `keep_until_torn_down` (what built
  // `next`: the change communicator), are released on a reaper thread, joined at the next Adopt.
  void Adopt(std::unique_ptr<GroupSet> next, std::shared_ptr<void> keep_until_torn_down);
  // Moves the running groups out (a recovery that shrinks them, switch.h ShrinkGroups).
  std::unique_ptr<GroupSet> Take();
  // Every collective of the running groups returns kAborted from now on, unless they are of
  // another generation than `generation` (-1: whichever): an abort of an older generation is
  // not for them (kOtherGeneration, nothing done). kNone: there are no groups.
  enum class Aborted { kAborted, kNone, kOtherGeneration };
  Aborted AbortAll(int64_t generation = -1);
  // The running groups can shrink (NCCL): a recovery where ranks only leave shrinks them instead
  // of building new ones (SwitchOptions::previous_groups_can_shrink).
  bool can_shrink() const { return can_shrink_.load(); }
  // Joins the last teardown; then releases the running groups.
  void Reset();

 private:
  void JoinReaper();

  mutable std::mutex mu_;  // groups_ against the control thread's AbortAll
  std::unique_ptr<GroupSet> groups_;
  std::atomic<bool> can_shrink_{false};
  std::thread reaper_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_SWITCH_LIVE_GROUPS_H_
