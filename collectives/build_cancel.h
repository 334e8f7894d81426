// BuildCancel: ends communicator builds in progress from any thread. A build that watches one
// (NcclFactory(device, cancel): the unique-id wait and the non-blocking ncclCommInitRankConfig's
// polls; FakeNcclHub::Factory(process, cancel): its rendezvous) returns kAborted at its next
// poll once Cancel() was called, releasing what it had started (ncclCommAbort); later builds
// with it fail at once. PrepareSwitch also checks it between its builds (SwitchOptions::cancel).
//
//   auto cancel = std::make_shared<BuildCancel>();
//   CommunicatorFactory f = NcclFactory(device, cancel);
//   std::thread t([&] { comm = f(store, "world", rank, size, deadline); });   // builds
//   cancel->Cancel();                                                         // any thread
//
// Thread-safety: any thread.
#ifndef MORPH_COLLECTIVES_BUILD_CANCEL_H_
#define MORPH_COLLECTIVES_BUILD_CANCEL_H_

#include <atomic>

namespace morph {

class BuildCancel {
 public:
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  std::atomic<bool> cancelled_{false};
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_BUILD_CANCEL_H_
