// Store: the small key-value service that ranks of one job rendezvous through (communicator
// addresses, NCCL unique ids, barriers), scoped by generation.
//
// Every Store object speaks for one generation `g`. Its keys live in g's own namespace, so
// a new generation starts from an empty key space (Gloo cannot delete keys; we never need
// to). Once any client advances the store to a newer generation, every call made for an
// older one — including calls blocked in Get/Wait — fails with kAborted.
//
//   auto table = std::make_shared<KvTable>();            // one per job (threads in a process)
//   MemoryStore store(table, /*generation=*/3);
//   MORPH_RETURN_IF_ERROR(store.Set("addr/0", "127.0.0.1:4000", Deadline::AfterMs(1000)));
//   MORPH_ASSIGN_OR_RETURN(std::string a, store.Get("addr/0", Deadline::AfterMs(5000)));
//   MORPH_ASSIGN_OR_RETURN(int64_t n, store.Add("arrived", 1, Deadline::AfterMs(1000)));
//
// TcpStoreServer/TcpStoreClient (tcp_store.h) serve the same KvTable over TCP.
#ifndef MORPH_COLLECTIVES_STORE_H_
#define MORPH_COLLECTIVES_STORE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"

namespace morph {

// Every call may be made from any thread, concurrently (a blocked Get does not hold up other
// calls). Every call returns kAborted when the store has moved past this object's generation,
// kDeadlineExceeded when `deadline` passed first, kUnavailable when the store cannot be
// reached (TCP), kUnauthenticated when the job token was refused (TCP).
class Store {
 public:
  virtual ~Store() = default;

  // The generation this object reads and writes.
  virtual int64_t generation() const = 0;

  // Sets `key` to `value` (overwrites).
  virtual Status Set(std::string_view key, std::string_view value, Deadline deadline) = 0;

  // The value of `key`, blocking until it is set or the deadline passes.
  virtual StatusOr<std::string> Get(std::string_view key, Deadline deadline) = 0;

  // Adds `delta` to the integer stored at `key` (absent = 0) and returns the new value.
  // kInvalidArgument naming the key if the current value is not a decimal integer or the sum
  // overflows.
  virtual StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) = 0;

  // If the current value of `key` equals `expected` (nullopt: the key is absent), sets it to
  // `desired`. Returns the value stored afterwards: `desired` if the swap happened, else the
  // current value ("" is never returned for an absent key: absent keys with a mismatched
  // `expected` yield kNotFound naming the key).
  virtual StatusOr<std::string> CompareAndSet(std::string_view key,
                                              const std::optional<std::string>& expected,
                                              std::string_view desired, Deadline deadline) = 0;

  // Blocks until every key in `keys` is set. kDeadlineExceeded names the first missing key.
  virtual Status Wait(std::span<const std::string> keys, Deadline deadline) = 0;

  // Makes `generation` the oldest one the store serves and drops the keys of older ones.
  // Never moves backwards (an older value is ignored). kAborted if this object's own
  // generation is already too old. Over TCP a client may advance only to the store's current
  // generation + 1 (kPermissionDenied naming both beyond that); the server's owner advances
  // further with TcpStoreServer::AdvanceGeneration.
  virtual Status AdvanceGeneration(int64_t generation, Deadline deadline) = 0;
};

// Now + MORPH_STORE_TIMEOUT_MS: the deadline of a store call or rendezvous when the caller has
// none of its own. kInvalidArgument naming the variable for a bad value. Any thread.
StatusOr<Deadline> StoreDeadlineFromEnv();

// The state of a store: keys per generation and the oldest generation served. Thread-safe.
// Shared by MemoryStore (threads of one process) and TcpStoreServer.
class KvTable {
 public:
  enum class Op : uint8_t { kSet = 1, kGet, kAdd, kCas, kWait, kAdvance };
  struct Request {
    Op op = Op::kGet;
    int64_t generation = 0;
    std::vector<std::string> keys;        // one key for all ops but kWait (any number)
    std::string value;                    // kSet value, kCas desired
    std::optional<std::string> expected;  // kCas
    int64_t number = 0;                   // kAdd delta, kAdvance generation
    // kAdvance: refuse (kPermissionDenied) a target beyond min_generation() + 1. Set for
    // requests of TCP clients: only the store's owner may skip generations.
    bool bounded_advance = false;
  };
  struct Response {
    Status status;
    std::string value;   // kGet, kCas
    int64_t number = 0;  // kAdd
  };

  // Applies `request` now. nullopt when it must wait (kGet/kWait of a missing key); then
  // `*first_missing` (if given) is the index in request.keys of the first key not set. On
  // input `*first_missing` says where a kWait resumes: the keys before it were found set by
  // an earlier call (keys are never removed within a generation), so re-examining a waiting
  // request costs only the keys it has not seen yet.
  std::optional<Response> TryApply(const Request& request, size_t* first_missing = nullptr);

  // Applies `request`, blocking while it must wait, up to `deadline` (kDeadlineExceeded).
  Response Apply(const Request& request, Deadline deadline);

  // The response a request gets when its deadline passes while it waits: kDeadlineExceeded
  // naming the first key still missing.
  Response TimedOut(const Request& request) const;

  int64_t min_generation() const;
  // Number of keys held, over all generations (for tests of flat memory).
  size_t size() const;

 private:
  std::optional<Response> TryApplyLocked(const Request& request, size_t* first_missing);
  Response TimedOutLocked(const Request& request) const;

  mutable std::mutex mu_;
  std::condition_variable changed_;
  int64_t min_generation_ = 0;
  std::map<int64_t, std::map<std::string, std::string, std::less<>>> keys_;
};

// A Store whose every call is one KvTable request, executed by the subclass (MemoryStore in
// this process, TcpStoreClient over TCP). Implements the Store verbs once.
class KvStore : public Store {
 public:
  Status Set(std::string_view key, std::string_view value, Deadline deadline) final;
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) final;
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) final;
  StatusOr<std::string> CompareAndSet(std::string_view key,
                                      const std::optional<std::string>& expected,
                                      std::string_view desired, Deadline deadline) final;
  Status Wait(std::span<const std::string> keys, Deadline deadline) final;
  Status AdvanceGeneration(int64_t generation, Deadline deadline) final;

 protected:
  // Runs one request of this store's generation, up to `deadline`.
  virtual KvTable::Response Execute(KvTable::Request request, Deadline deadline) = 0;
};

// A Store over a KvTable in this process (ranks as threads).
class MemoryStore : public KvStore {
 public:
  MemoryStore(std::shared_ptr<KvTable> table, int64_t generation)
      : table_(std::move(table)), generation_(generation) {}

  int64_t generation() const override { return generation_; }

 private:
  KvTable::Response Execute(KvTable::Request request, Deadline deadline) override;

  std::shared_ptr<KvTable> table_;
  int64_t generation_;
};

// Keys of `store` under "<prefix>/": one communicator's rendezvous inside a generation.
// Does not own `store`, which must outlive it.
class PrefixedStore : public Store {
 public:
  PrefixedStore(Store* store, std::string prefix)
      : store_(store), prefix_(std::move(prefix) + "/") {}

  int64_t generation() const override { return store_->generation(); }
  Status Set(std::string_view key, std::string_view value, Deadline deadline) override {
    return store_->Set(prefix_ + std::string(key), value, deadline);
  }
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) override {
    return store_->Get(prefix_ + std::string(key), deadline);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) override {
    return store_->Add(prefix_ + std::string(key), delta, deadline);
  }
  StatusOr<std::string> CompareAndSet(std::string_view key,
                                      const std::optional<std::string>& expected,
                                      std::string_view desired, Deadline deadline) override {
    return store_->CompareAndSet(prefix_ + std::string(key), expected, desired, deadline);
  }
  Status Wait(std::span<const std::string> keys, Deadline deadline) override;
  Status AdvanceGeneration(int64_t generation, Deadline deadline) override {
    return store_->AdvanceGeneration(generation, deadline);
  }

 private:
  Store* store_;
  std::string prefix_;
};

// Blocks until `n` ranks called StoreBarrier with the same `name` (each rank once).
// Statuses as Store.
Status StoreBarrier(Store& store, std::string_view name, int n, Deadline deadline);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_STORE_H_
