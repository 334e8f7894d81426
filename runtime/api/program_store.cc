// Runtime::ConnectStore (morph/runtime.h): the job's store handed to a program
// (morph/key_value_store.h) — a TcpStoreClient of the current generation, its own connection,
// with the program's keys under "program/<prefix>/", apart from the runtime's.
#include <memory>
#include <string>

#include "collectives/store/store.h"
#include "collectives/store/tcp_store.h"
#include "morph/runtime.h"
#include "runtime/api/runtime_impl.h"

namespace morph {
namespace {

class ProgramStore final : public KeyValueStore {
 public:
  ProgramStore(std::unique_ptr<TcpStoreClient> client, std::string prefix)
      : client_(std::move(client)), keys_(client_.get(), std::move(prefix)) {}

  int64_t generation() const override { return client_->generation(); }
  Status Set(std::string_view key, std::string_view value, Deadline deadline) override {
    return keys_.Set(key, value, deadline);
  }
  StatusOr<std::string> Get(std::string_view key, Deadline deadline) override {
    return keys_.Get(key, deadline);
  }
  StatusOr<int64_t> Add(std::string_view key, int64_t delta, Deadline deadline) override {
    return keys_.Add(key, delta, deadline);
  }
  StatusOr<std::string> CompareAndSet(std::string_view key,
                                      const std::optional<std::string>& expected,
                                      std::string_view desired, Deadline deadline) override {
    return keys_.CompareAndSet(key, expected, desired, deadline);
  }
  Status Wait(std::span<const std::string> keys, Deadline deadline) override {
    return keys_.Wait(keys, deadline);
  }

 private:
  std::unique_ptr<TcpStoreClient> client_;
  PrefixedStore keys_;  // over client_
};

}  // namespace

StatusOr<std::unique_ptr<KeyValueStore>> Runtime::ConnectStore(std::string_view prefix) {
  Impl& m = *impl_;
  if (prefix.empty()) return InvalidArgumentError("ConnectStore: the prefix is empty");
  if (m.core.finished() || m.store == nullptr || m.agent == nullptr ||
      m.gen.RankOf(m.agent->id()) < 0) {
    return FailedPreconditionError(
        "ConnectStore: this worker holds no rank in a running generation");
  }
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<TcpStoreClient> client,
                         m.store->ForGeneration(m.gen.id, Deadline::AfterMs(m.opts.change_timeout_ms)),
                         "ConnectStore: generation " << m.gen.id);
  return std::unique_ptr<KeyValueStore>(
      new ProgramStore(std::move(client), "program/" + std::string(prefix)));
}

}  // namespace morph
