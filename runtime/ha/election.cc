#include "runtime/ha/election.h"

#include <chrono>
#include <cstdio>
#include <random>
#include <utility>

#include <nlohmann/json.hpp>

#include "base/logging.h"

namespace morph {

namespace {
using Clock = std::chrono::steady_clock;

std::string Nonce() {
  std::random_device rd;
  uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  char buf[17];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}
}  // namespace

Status ValidateJobPrefix(std::string_view prefix, std::string_view what) {
  const std::string w(what);
  if (prefix.empty() || prefix.front() != '/' || prefix.back() == '/') {
    return InvalidArgumentError(w + ": '" + std::string(prefix) +
                                "' is not a prefix like /morph/job (a leading /, no trailing /)");
  }
  for (size_t at = 1; at <= prefix.size();) {
    size_t end = prefix.find('/', at);
    if (end == std::string_view::npos) end = prefix.size();
    const std::string_view segment = prefix.substr(at, end - at);
    if (segment.empty()) return InvalidArgumentError(w + ": an empty segment in '" +
                                                     std::string(prefix) + "'");
    if (segment == "leader" || segment == "state" || segment == "launch") {
      return InvalidArgumentError(w + ": segment '" + std::string(segment) + "' of '" +
                                  std::string(prefix) + "' is the name of a job's key: a job's "
                                  "prefix may not lie among another job's keys");
    }
    at = end + 1;
  }
  return Status::Ok();
}

std::string LeaderValuePayload(const std::string& value) {
  size_t nl = value.rfind('\n');
  return nl == std::string::npos ? value : value.substr(0, nl);
}

std::string CoordinatorAddresses(const std::string& control, const std::string& store,
                                 int http_port) {
  return nlohmann::json{{"control", control}, {"store", store}, {"http_port", http_port}}.dump();
}

StatusOr<std::string> LeaderControlAddress(const std::string& value) {
  nlohmann::json j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("control") || !j["control"].is_string()) {
    return DataLossError("the leader key holds no control address: " + value.substr(0, 200));
  }
  return j["control"].get<std::string>();
}

StatusOr<std::optional<std::string>> LookupLeaderKey(EtcdClient& etcd, const std::string& prefix) {
  MORPH_ASSIGN_OR_RETURN(std::optional<EtcdKv> kv, etcd.Get(LeaderKey(prefix)));
  if (!kv) return std::optional<std::string>();
  return std::optional<std::string>(kv->value);
}

StatusOr<std::optional<std::string>> LookupLeader(EtcdClient& etcd, const std::string& prefix) {
  MORPH_ASSIGN_OR_RETURN(std::optional<std::string> v, LookupLeaderKey(etcd, prefix));
  if (!v) return v;
  return std::optional<std::string>(LeaderValuePayload(*v));
}

StatusOr<std::unique_ptr<Election>> Election::Start(ElectionOptions options, Callbacks callbacks) {
  MORPH_RETURN_IF_ERROR(ValidateJobPrefix(options.prefix, "election: etcd prefix"));
  if (options.ttl_s < 1) return InvalidArgumentError("election: lease TTL below 1 s");
  if (options.poll_ms <= 0) options.poll_ms = std::max<int64_t>(options.ttl_s * 1000 / 8, 10);
  std::unique_ptr<Election> e(new Election(std::move(options), std::move(callbacks)));
  e->thread_ = std::thread([p = e.get()] { p->Loop(); });
  return e;
}

Election::Election(ElectionOptions options, Callbacks callbacks)
    : options_(std::move(options)), callbacks_(std::move(callbacks)), etcd_(options_.etcd) {
  options_.value += "\n" + Nonce();
}

Election::~Election() { Stop(); }

void Election::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Election::Resign() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    resign_ = true;
  }
  cv_.notify_all();
}

std::string Election::etcd_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return etcd_error_;
}

void Election::Note(const Status& s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (s.ok()) {
    etcd_error_.clear();
  } else if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) {
    etcd_error_ = std::string(s.message()).substr(0, 200);
  }
}

EtcdFence Election::fence() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fence_;
}

bool Election::Sleep(int64_t ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return !cv_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return stop_ || resign_; }) ||
         !stop_;
}

void Election::StepDown(const Status& why) {
  if (!leading_.exchange(false)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fence_.lease = 0;
  }
  LOG(WARNING) << "election " << options_.prefix << ": stepping down: " << why;
  if (callbacks_.deposed) callbacks_.deposed(why);
}

bool Election::HoldsKey(const std::string& key) {
  StatusOr<std::optional<EtcdKv>> kv = etcd_.Get(key);
  if (!kv.ok()) return true;  // etcd out of reach: the lease's renewal decides
  return kv->has_value() && (*kv)->value == options_.value;
}

void Election::Loop() {
  const std::string key = LeaderKey(options_.prefix);
  const int64_t ttl_ms = options_.ttl_s * 1000;
  int64_t lease = 0;
  // A lease this candidate gave up while etcd could not be reached: etcd may still hold it (and
  // the leader key on it) when it comes back, with its TTL restarted, keeping every candidate
  // out for that long. Revoked as soon as etcd answers.
  int64_t orphan = 0;
  Clock::time_point renewed{};  // when the last accepted renewal (or the grant) was sent
  bool logged_follower = false;
  while (true) {
    bool resign = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
      resign = std::exchange(resign_, false);
    }
    if (orphan != 0 && etcd_.LeaseRevoke(orphan).ok()) orphan = 0;
    if (resign && leading_.load()) {
      Status revoked = etcd_.LeaseRevoke(lease);
      if (!revoked.ok()) VLOG(1) << "election: revoking lease " << lease << ": " << revoked;
      lease = 0;
      StepDown(AbortedError("resigned"));
      if (!Sleep(ttl_ms)) break;
      continue;
    }
    const Clock::time_point sent = Clock::now();
    if (lease == 0) {
      StatusOr<int64_t> granted = etcd_.LeaseGrant(options_.ttl_s);
      Note(granted.status());
      if (!granted.ok()) {
        VLOG(1) << "election " << options_.prefix << ": lease grant: " << granted.status();
        if (!Sleep(options_.poll_ms)) break;
        continue;
      }
      lease = *granted;
      renewed = sent;
    } else {
      StatusOr<int64_t> ttl = etcd_.LeaseKeepAlive(lease);
      Note(ttl.status());
      if (ttl.ok()) {
        renewed = sent;
      } else if (ttl.status().code() == StatusCode::kNotFound) {
        lease = 0;
        StepDown(ttl.status());
        // A leader that lost its lease campaigns again only a TTL later: the others first.
        if (!Sleep(ttl_ms)) break;
        continue;
      } else if (Clock::now() - renewed >= std::chrono::milliseconds(ttl_ms)) {
        // etcd may have let the lease expire: a successor may lead now.
        orphan = lease;
        lease = 0;
        StepDown(UnavailableError("lease not renewed for a TTL: " +
                                  std::string(ttl.status().message())));
        if (!Sleep(ttl_ms)) break;
        continue;
      }
    }
    if (leading_.load() && !HoldsKey(key)) {
      // Its key was deleted (an operator, another tool) or replaced while its lease lives: it
      // leads no more. It does not write the key again: another candidate may have led in the
      // gap, with decisions this one's coordinator does not know. It campaigns a TTL later.
      Status revoked = etcd_.LeaseRevoke(lease);
      if (!revoked.ok()) orphan = lease;
      lease = 0;
      StepDown(AbortedError("the leader key " + key + " was deleted or replaced"));
      if (!Sleep(ttl_ms)) break;
      continue;
    }
    if (!leading_.load()) {
      StatusOr<bool> won = etcd_.CreateIfAbsent(key, options_.value, lease);
      if (won.ok() && *won) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          fence_ = EtcdFence{.key = key, .value = options_.value, .lease = lease};
        }
        leading_ = true;
        logged_follower = false;
        LOG(INFO) << "election " << options_.prefix << ": leading (lease " << lease << ", TTL "
                  << options_.ttl_s << " s)";
        if (callbacks_.elected) callbacks_.elected(fence());
      } else if (won.ok() && !logged_follower) {
        logged_follower = true;
        LOG(INFO) << "election " << options_.prefix << ": following (another candidate leads)";
      }
    }
    // A leader renews at a third of the TTL; a follower looks at the key every poll.
    if (!Sleep(leading_.load() ? std::max<int64_t>(ttl_ms / 3, 10) : options_.poll_ms)) break;
  }
  if (lease != 0) {
    Status revoked = etcd_.LeaseRevoke(lease);
    if (!revoked.ok()) VLOG(1) << "election: revoking lease " << lease << ": " << revoked;
  }
  StepDown(CancelledError("election stopped"));
}

}  // namespace morph
