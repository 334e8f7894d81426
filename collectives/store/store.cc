#include "collectives/store/store.h"

#include <charconv>
#include <limits>
#include <sstream>

#include "base/params.h"

namespace morph {
namespace {

std::string_view OpName(KvTable::Op op) {
  switch (op) {
    case KvTable::Op::kSet:
      return "set";
    case KvTable::Op::kGet:
      return "get";
    case KvTable::Op::kAdd:
      return "add";
    case KvTable::Op::kCas:
      return "compare_and_set";
    case KvTable::Op::kWait:
      return "wait";
    case KvTable::Op::kAdvance:
      return "advance_generation";
  }
  return "?";
}

KvTable::Response Error(Status s) {
  KvTable::Response r;
  r.status = std::move(s);
  return r;
}

}  // namespace

StatusOr<Deadline> StoreDeadlineFromEnv() {
  MORPH_ASSIGN_OR_RETURN(int64_t ms, params::StoreTimeoutMs());
  return Deadline::AfterMs(ms);
}

KvTable::Response KvTable::TimedOut(const Request& request) const {
  std::lock_guard<std::mutex> lock(mu_);
  return TimedOutLocked(request);
}

KvTable::Response KvTable::TimedOutLocked(const Request& request) const {
  std::vector<const std::string*> missing;
  auto gen = keys_.find(request.generation);
  for (const std::string& k : request.keys) {
    if (gen == keys_.end() || !gen->second.contains(k)) missing.push_back(&k);
  }
  std::ostringstream msg;
  msg << "store " << OpName(request.op) << " generation " << request.generation
      << ": timed out waiting for key";
  if (!missing.empty()) msg << " '" << *missing.front() << "'";
  if (missing.size() > 1) msg << " (and " << missing.size() - 1 << " more)";
  return Error(DeadlineExceededError(msg.str()));
}

std::optional<KvTable::Response> KvTable::TryApply(const Request& request, size_t* first_missing) {
  std::optional<Response> r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    r = TryApplyLocked(request, first_missing);
  }
  if (r && request.op != Op::kGet && request.op != Op::kWait) changed_.notify_all();
  return r;
}

std::optional<KvTable::Response> KvTable::TryApplyLocked(const Request& request,
                                                         size_t* first_missing) {
  if (request.generation < min_generation_) {
    return Error(AbortedError("store " + std::string(OpName(request.op)) + ": generation " +
                              std::to_string(request.generation) +
                              " is older than the store's current generation " +
                              std::to_string(min_generation_)));
  }
  if (request.op == Op::kAdvance) {
    if (request.bounded_advance && request.number > min_generation_ &&
        request.number - min_generation_ > 1) {
      return Error(PermissionDeniedError(
          "store advance_generation: generation " + std::to_string(request.number) +
          " is beyond the store's current generation " + std::to_string(min_generation_) +
          " + 1; only the store's owner may skip generations"));
    }
    if (request.number > min_generation_) {
      min_generation_ = request.number;
      keys_.erase(keys_.begin(), keys_.lower_bound(min_generation_));
    }
    return Response{};
  }
  if (request.op != Op::kWait && request.keys.size() != 1) {
    return Error(InvalidArgumentError("store " + std::string(OpName(request.op)) +
                                      ": expected exactly one key, got " +
                                      std::to_string(request.keys.size())));
  }
  // Reads do not create a generation's map: a client naming many generations in Gets would
  // otherwise leave one empty map behind for each.
  static const std::map<std::string, std::string, std::less<>> kNoKeys;
  if (request.op == Op::kGet || request.op == Op::kWait) {
    auto gen = keys_.find(request.generation);
    const auto& keys = gen == keys_.end() ? kNoKeys : gen->second;
    if (request.op == Op::kGet) {
      auto it = keys.find(request.keys[0]);
      if (it == keys.end()) {
        if (first_missing != nullptr) *first_missing = 0;
        return std::nullopt;
      }
      Response r;
      r.value = it->second;
      return r;
    }
    for (size_t i = first_missing != nullptr ? *first_missing : 0; i < request.keys.size(); ++i) {
      if (!keys.contains(request.keys[i])) {
        if (first_missing != nullptr) *first_missing = i;
        return std::nullopt;
      }
    }
    return Response{};
  }
  auto& keys = keys_[request.generation];
  switch (request.op) {
    case Op::kSet:
      keys[request.keys[0]] = request.value;
      return Response{};
    case Op::kGet:
    case Op::kWait:
      break;  // above
    case Op::kAdd: {
      const std::string& key = request.keys[0];
      int64_t current = 0;
      auto it = keys.find(key);
      if (it != keys.end()) {
        const std::string& v = it->second;
        auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), current);
        if (ec != std::errc() || end != v.data() + v.size() || v.empty()) {
          return Error(InvalidArgumentError("store add: key '" + key + "' holds '" + v +
                                            "', not a decimal integer"));
        }
      }
      int64_t sum = 0;
      if (__builtin_add_overflow(current, request.number, &sum)) {
        return Error(InvalidArgumentError("store add: key '" + key +
                                          "': " + std::to_string(current) + " + " +
                                          std::to_string(request.number) + " overflows"));
      }
      keys[key] = std::to_string(sum);
      Response r;
      r.number = sum;
      return r;
    }
    case Op::kCas: {
      const std::string& key = request.keys[0];
      auto it = keys.find(key);
      Response r;
      if (it == keys.end()) {
        if (request.expected.has_value()) {
          return Error(NotFoundError("store compare_and_set: key '" + key +
                                     "' is not set (expected '" + *request.expected + "')"));
        }
        keys.emplace(key, request.value);
        r.value = request.value;
        return r;
      }
      if (request.expected.has_value() && *request.expected == it->second) {
        it->second = request.value;
      }
      r.value = it->second;
      return r;
    }
    case Op::kAdvance:
      break;
  }
  return Error(InvalidArgumentError("store: unknown operation " +
                                    std::to_string(static_cast<int>(request.op))));
}

KvTable::Response KvTable::Apply(const Request& request, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    std::optional<Response> r = TryApplyLocked(request, nullptr);
    if (r) {
      lock.unlock();
      if (request.op != Op::kGet && request.op != Op::kWait) changed_.notify_all();
      return *std::move(r);
    }
    if (deadline.Expired()) return TimedOutLocked(request);
    if (deadline.IsInfinite()) {
      changed_.wait(lock);
    } else {
      changed_.wait_until(lock, deadline.when());
    }
  }
}

int64_t KvTable::min_generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return min_generation_;
}

size_t KvTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [g, keys] : keys_) n += keys.size();
  return n;
}

KvTable::Response MemoryStore::Execute(KvTable::Request request, Deadline deadline) {
  request.generation = generation_;
  return table_->Apply(request, deadline);
}

Status KvStore::Set(std::string_view key, std::string_view value, Deadline deadline) {
  return Execute({.op = KvTable::Op::kSet, .keys = {std::string(key)}, .value = std::string(value)},
                 deadline)
      .status;
}

StatusOr<std::string> KvStore::Get(std::string_view key, Deadline deadline) {
  KvTable::Response r = Execute({.op = KvTable::Op::kGet, .keys = {std::string(key)}}, deadline);
  if (!r.status.ok()) return r.status;
  return std::move(r.value);
}

StatusOr<int64_t> KvStore::Add(std::string_view key, int64_t delta, Deadline deadline) {
  KvTable::Response r =
      Execute({.op = KvTable::Op::kAdd, .keys = {std::string(key)}, .number = delta}, deadline);
  if (!r.status.ok()) return r.status;
  return r.number;
}

StatusOr<std::string> KvStore::CompareAndSet(std::string_view key,
                                             const std::optional<std::string>& expected,
                                             std::string_view desired, Deadline deadline) {
  KvTable::Response r = Execute({.op = KvTable::Op::kCas,
                                 .keys = {std::string(key)},
                                 .value = std::string(desired),
                                 .expected = expected},
                                deadline);
  if (!r.status.ok()) return r.status;
  return std::move(r.value);
}

Status KvStore::Wait(std::span<const std::string> keys, Deadline deadline) {
  return Execute({.op = KvTable::Op::kWait, .keys = {keys.begin(), keys.end()}}, deadline).status;
}

Status KvStore::AdvanceGeneration(int64_t generation, Deadline deadline) {
  return Execute({.op = KvTable::Op::kAdvance, .number = generation}, deadline).status;
}

Status PrefixedStore::Wait(std::span<const std::string> keys, Deadline deadline) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const std::string& k : keys) full.push_back(prefix_ + k);
  return store_->Wait(full, deadline);
}

Status StoreBarrier(Store& store, std::string_view name, int n, Deadline deadline) {
  std::string base(name);
  MORPH_ASSIGN_OR_RETURN(int64_t arrived, store.Add(base + "/arrived", 1, deadline),
                         "barrier '" << name << "'");
  if (arrived == n) {
    MORPH_RETURN_IF_ERROR(store.Set(base + "/done", "1", deadline)) << "barrier '" << name << "'";
  }
  std::vector<std::string> keys{base + "/done"};
  MORPH_RETURN_IF_ERROR(store.Wait(keys, deadline))
      << "barrier '" << name << "' (" << arrived << " of " << n << " arrived when this rank did)";
  return Status::Ok();
}

}  // namespace morph
