// morph._torch_backend's store: a c10d::Store over the job's store (morph/key_value_store.h,
// Runtime::ConnectStore), so that torch's rendezvous (init_process_group, the Gloo groups of
// new_group and of HSDP meshes) goes through morph's token-checked store and the job opens
// no listener of its own. Scoped to one generation: once the job moved on, every call raises.
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "morph/key_value_store.h"
#include "torch_ext.h"

namespace morph_torch {
namespace {

[[noreturn]] void StoreFail(const morph::Status& s, const std::string& what) {
  C10_THROW_ERROR(DistStoreError, "morph store: " + what + ": " + s.ToString());
}

std::string Text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> Bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

class MorphStore : public c10d::Store {
 public:
  MorphStore(std::shared_ptr<morph::KeyValueStore> store, std::chrono::milliseconds timeout)
      : c10d::Store(timeout), store_(std::move(store)) {}

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<MorphStore>(store_, timeout_);  // the client is thread-safe
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    morph::Status s = store_->Set(key, Text(value), Deadline());
    if (!s.ok()) StoreFail(s, "set '" + key + "'");
  }
  std::vector<uint8_t> get(const std::string& key) override {
    morph::StatusOr<std::string> v = store_->Get(key, Deadline());
    if (!v.ok()) StoreFail(v.status(), "get '" + key + "'");
    return Bytes(*v);
  }
  // c10d's semantics (TCPStore's): an absent key takes `desired` when `expected` is empty,
  // else the answer is `expected`; a present one takes `desired` when it holds `expected`;
  // the answer is the value afterwards.
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    std::optional<std::string> want;
    if (!expected.empty()) want = Text(expected);
    morph::StatusOr<std::string> v = store_->CompareAndSet(key, want, Text(desired), Deadline());
    if (v.status().code() == morph::StatusCode::kNotFound) return expected;
    if (!v.ok()) StoreFail(v.status(), "compare_set '" + key + "'");
    return Bytes(*v);
  }
  int64_t add(const std::string& key, int64_t value) override {
    morph::StatusOr<int64_t> v = store_->Add(key, value, Deadline());
    if (!v.ok()) StoreFail(v.status(), "add '" + key + "'");
    return *v;
  }
  bool deleteKey(const std::string& key) override {
    C10_THROW_ERROR(DistStoreError, "morph store: delete_key '" + key +
                                        "': keys live as long as their generation");
  }
  bool check(const std::vector<std::string>& keys) override {
    morph::Status s = store_->Wait(keys, morph::Deadline::AfterMs(0));
    if (s.code() == morph::StatusCode::kDeadlineExceeded) return false;
    if (!s.ok()) StoreFail(s, "check");
    return true;
  }
  int64_t getNumKeys() override {
    C10_THROW_ERROR(DistStoreError, "morph store: num_keys is not supported");
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    morph::Status s = store_->Wait(keys, morph::Deadline::After(timeout));
    if (!s.ok()) StoreFail(s, "wait");
  }

 private:
  morph::Deadline Deadline() const { return morph::Deadline::After(timeout_); }

  std::shared_ptr<morph::KeyValueStore> store_;
};

}  // namespace

void BindStore(py::module_& m) {
  py::class_<MorphStore, c10d::Store, c10::intrusive_ptr<MorphStore>>(m, "MorphStore");
  m.def(
      "create_store",
      [](py::capsule store, int64_t timeout_ms) {
        return c10::make_intrusive<MorphStore>(
            SharedFromCapsule<morph::KeyValueStore>(store, "morph.KeyValueStore"),
            std::chrono::milliseconds(timeout_ms));
      },
      py::arg("store"), py::arg("timeout_ms"),
      "A c10d Store over the job's store (morph._morph.KeyValueStore._capsule()).");
}

}  // namespace morph_torch
