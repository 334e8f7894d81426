// Election: a coordinator candidate's campaign for leadership on an etcd lease (docs/design.md
// "Coordinator failover"). The candidate holds a lease of `ttl_s` seconds and keeps it alive;
// it leads while `<prefix>/leader` holds its value on that lease. Campaigning is one
// transaction that creates the key only if it is absent; a candidate that lost looks at the key
// every `poll_ms` and campaigns again once it is gone (its leader's lease expired or was
// revoked). A leader whose lease cannot be renewed steps down once the lease may have expired
// (`ttl_s` after the last renewal it sent that etcd accepted), before any successor can have
// been elected on it; its fence (EtcdFence) is refused by etcd from the moment its key is gone,
// so whatever it still tries to write is refused even before it notices. A leader also checks
// its key at every renewal and steps down when it was deleted or replaced; a lease it gave up
// while etcd was unreachable is revoked once etcd answers again.
//
//   Election::Callbacks cb{.elected = [&](const EtcdFence& f) { ... restore, then lead ... },
//                          .deposed = [&](const Status& why) { ... stop leading ... }};
//   MORPH_ASSIGN_OR_RETURN(auto e, Election::Start(opts, std::move(cb)));
//
// The callbacks run on the election's own thread, one at a time, elected and deposed
// alternating; they must not call Stop. Stop (or the destructor) revokes the lease, so a
// successor is elected at once instead of a TTL later. Thread-safe.
#ifndef MORPH_RUNTIME_HA_ELECTION_H_
#define MORPH_RUNTIME_HA_ELECTION_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "morph/status.h"
#include "runtime/ha/etcd_client.h"

namespace morph {

struct ElectionOptions {
  EtcdOptions etcd;
  std::string prefix;  // the job's keys, e.g. "/morph/<job>"; the leader key is prefix + "/leader"
  // What this candidate writes into the leader key: whatever followers need to reach it (the
  // coordinator writes its control and API addresses). Made unique per campaign by the election
  // (a nonce after a newline), so that a restarted candidate never mistakes an old key for its own.
  std::string value;
  int64_t ttl_s = 2;     // the lease's TTL (MORPH_ETCD_TTL_S)
  int64_t poll_ms = 0;   // how often a follower looks at the leader key; 0: ttl / 8
};

// A job's etcd prefix (MORPH_ETCD_PREFIX, morphd --etcd-prefix, morphrun's): "/" then segments
// separated by "/", none empty, none named "leader", "state" or "launch" (the names of a job's
// keys under its prefix, so that no job's prefix lies among another job's keys). kInvalidArgument
// naming `what` and the offending segment.
Status ValidateJobPrefix(std::string_view prefix, std::string_view what);

// The leader key of a job prefix.
inline std::string LeaderKey(const std::string& prefix) { return prefix + "/leader"; }
// What a leader key's value says before its nonce (ElectionOptions::value).
std::string LeaderValuePayload(const std::string& value);

// A coordinator candidate's ElectionOptions::value: where workers, followers and schedulers
// reach it (JSON {"control":"host:port","store":"host:port","http_port":N}).
std::string CoordinatorAddresses(const std::string& control, const std::string& store,
                                 int http_port);
// The control address in such a value. kDataLoss when it holds none.
StatusOr<std::string> LeaderControlAddress(const std::string& value);

// The current leader's ElectionOptions::value, or nullopt when there is none. kUnavailable when
// etcd cannot be reached.
StatusOr<std::optional<std::string>> LookupLeader(EtcdClient& etcd, const std::string& prefix);
// The same, the key's whole value (the nonce included: it names one campaign).
StatusOr<std::optional<std::string>> LookupLeaderKey(EtcdClient& etcd, const std::string& prefix);

class Election {
 public:
  struct Callbacks {
    std::function<void(const EtcdFence& fence)> elected;
    std::function<void(const Status& why)> deposed;
  };

  // kInvalidArgument for an empty prefix or ttl_s < 1. Campaigns at once on its thread.
  static StatusOr<std::unique_ptr<Election>> Start(ElectionOptions options, Callbacks callbacks);
  ~Election();  // Stop()

  // Ends the campaign: a leader resigns (revokes its lease; deposed runs if it led). Idempotent.
  void Stop();
  // A leader that cannot act on its leadership (its fenced write failed) gives it up: the lease
  // is revoked (a successor may lead at once), deposed runs, and the candidate campaigns again a
  // TTL later. Any thread but the callbacks'; returns at once.
  void Resign();

  bool leading() const { return leading_.load(); }
  // The fence of the current leadership (lease 0 when not leading).
  EtcdFence fence() const;
  // Why etcd could not be reached at the last attempt ("" when the last attempt went through):
  // what a follower's refusal says during an etcd outage.
  std::string etcd_error() const;
  // This candidate's EtcdClient (for fenced writes). Valid until destruction.
  EtcdClient& etcd() { return etcd_; }
  const ElectionOptions& options() const { return options_; }

 private:
  Election(ElectionOptions options, Callbacks callbacks);
  void Loop();
  // Sleeps up to `ms` unless stopped; false when stopped.
  bool Sleep(int64_t ms);
  void StepDown(const Status& why);
  // Records the outcome of an etcd call for etcd_error().
  void Note(const Status& s);
  std::string etcd_error_;  // under mu_
  // Whether `key` still holds this candidate's value (true when etcd cannot tell).
  bool HoldsKey(const std::string& key);

  ElectionOptions options_;
  Callbacks callbacks_;
  EtcdClient etcd_;
  std::thread thread_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool resign_ = false;
  std::atomic<bool> leading_{false};
  EtcdFence fence_;  // mu_
};

}  // namespace morph

#endif  // MORPH_RUNTIME_HA_ELECTION_H_
