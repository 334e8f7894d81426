// KeyValueStore: the job's key-value store as a program sees it (Runtime::ConnectStore): the
// coordinator's store, every connection checked with the job token, scoped to one generation
// and to a key prefix of the program's own, apart from the runtime's keys. It is what the
// rendezvous of a library the program runs over the generation's members goes through (the
// Python package's torch process groups: a c10d::Store over it), so that the job opens no
// listener of its own that a process without the token could reach.
//
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<morph::KeyValueStore> kv, rt->ConnectStore("mylib"));
//   MORPH_RETURN_IF_ERROR(kv->Set("addr/0", my_address, morph::Deadline::AfterMs(5000)));
//   MORPH_ASSIGN_OR_RETURN(std::string a, kv->Get("addr/1", morph::Deadline::AfterMs(30000)));
//
// Every call may be made from any thread, concurrently. Statuses: kAborted once the job moved
// to a later generation (every call of this object from then on, including calls blocked in
// Get or Wait); kDeadlineExceeded when `deadline` passed first; kUnavailable when the store
// cannot be reached; kInvalidArgument for an Add to a value that is not a decimal integer.
#ifndef MORPH_KEY_VALUE_STORE_H_
#define MORPH_KEY_VALUE_STORE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "morph/api.h"
#include "morph/deadline.h"
#include "morph/status.h"

namespace morph {

class MORPH_API KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;

  // The generation whose keys this object reads and writes.
  virtual int64_t generation() const = 0;
  // Sets `key` to `value` (overwrites).
  virtual Status Set(std::string_view key, std::string_view value, Deadline deadline) = 0;
  // The value of `key`, blocking until it is set.
  virtual StatusOr<std::string> Get(std::string_view key, Deadline deadline) = 0;
  // Adds `delta` to the integer at `key` (absent: 0) and returns the sum.
  virtual StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) = 0;
  // Sets `key` to `desired` if its value is `expected` (nullopt: absent); returns the value
  // afterwards. kNotFound for an absent key with `expected` set.
  virtual StatusOr<std::string> CompareAndSet(std::string_view key,
                                              const std::optional<std::string>& expected,
                                              std::string_view desired, Deadline deadline) = 0;
  // Blocks until every key of `keys` is set; kDeadlineExceeded names the first missing one.
  virtual Status Wait(std::span<const std::string> keys, Deadline deadline) = 0;
};

}  // namespace morph

#endif  // MORPH_KEY_VALUE_STORE_H_
