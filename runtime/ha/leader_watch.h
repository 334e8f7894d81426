// LeaderWatch: a worker's view of who leads a job on etcd (docs/operations.md "Coordinator
// failover"). A thread of its own reads <prefix>/leader every `interval`; Moved() says whether
// the key names another leader than the one this worker's connection was made under. A leader
// that froze (SIGSTOP, a stuck host) keeps its sockets open, so its workers' connections never
// fail while a successor leads: the watch is how they learn of the succession. An absent key or
// an etcd that cannot be reached moves nothing (a leader may be dying; etcd may be out).
//
//   LeaderWatch watch(etcd_options, "/morph/job", std::chrono::milliseconds(500));
//   watch.Follow(value_connected_under);   // after each (re)connection
//   if (watch.Moved()) Reconnect();
//
// Thread-safe.
#ifndef MORPH_RUNTIME_HA_LEADER_WATCH_H_
#define MORPH_RUNTIME_HA_LEADER_WATCH_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "runtime/ha/etcd_client.h"

namespace morph {

class LeaderWatch {
 public:
  LeaderWatch(EtcdOptions options, std::string prefix, std::chrono::milliseconds interval);
  ~LeaderWatch();
  LeaderWatch(const LeaderWatch&) = delete;
  LeaderWatch& operator=(const LeaderWatch&) = delete;

  // The leader key's whole value (with its nonce) the connection was made under. Until the
  // first call, the first value the watch reads is taken as followed.
  void Follow(std::string value);
  // The key names another leader than the one followed.
  bool Moved() const;

 private:
  void Loop();

  EtcdClient etcd_;
  const std::string key_;
  const std::chrono::milliseconds interval_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::optional<std::string> followed_;
  std::optional<std::string> seen_;  // the key's value at the last read that found one
  uint64_t epoch_ = 0;  // Follow's count: a read begun before a Follow is not taken
  std::thread thread_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_HA_LEADER_WATCH_H_
