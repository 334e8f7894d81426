// EtcdClient: the few etcd v3 calls coordinator failover needs (docs/design.md "Coordinator
// failover"), spoken to etcd 3.4's JSON gateway (/v3/kv/range, /v3/kv/put, /v3/kv/txn,
// /v3/kv/deleterange, /v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke; keys and values
// base64 in the JSON) over Boost.Beast, one kept-alive connection at a time. No library beyond
// Boost and nlohmann-json: etcd's gRPC client would bring gRPC and protobuf for seven calls.
//
//   MORPH_ASSIGN_OR_RETURN(EtcdOptions o, EtcdOptions::Parse("10.0.0.1:2379,10.0.0.2:2379"));
//   EtcdClient etcd(o);
//   MORPH_ASSIGN_OR_RETURN(int64_t lease, etcd.LeaseGrant(2));
//   MORPH_ASSIGN_OR_RETURN(bool won, etcd.CreateIfAbsent("/morph/job/leader", "me", lease));
//   EtcdFence fence{.key = "/morph/job/leader", .value = "me", .lease = lease};
//   MORPH_RETURN_IF_ERROR(etcd.FencedPut(fence, {{"/morph/job/state", bytes}}));
//
// Every call tries the endpoints in turn, starting with the one that answered last, until one
// answers or the call's budget (the options' timeout) is spent: one member down changes
// nothing. Status: kUnavailable when no endpoint answered (refused, reset, timed out: the
// message names each endpoint's error), kDataLoss for a reply that is not what etcd sends,
// kNotFound for a lease etcd does not know (expired or revoked), kAborted from FencedPut when
// the fence no longer holds (another leader, or this one's lease expired), and etcd's own
// errors as kInternal with its message.
//
// Thread-safe: calls are serialized on one connection (a mutex).
#ifndef MORPH_RUNTIME_HA_ETCD_CLIENT_H_
#define MORPH_RUNTIME_HA_ETCD_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "morph/status.h"

namespace morph {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // "host:port" of each member's client URL (http only)
  // The most one call may take, across all endpoints it tries.
  std::chrono::milliseconds timeout{2000};

  // "host:port[,host:port...]", optionally with "http://" before each (MORPH_ETCD).
  // kInvalidArgument naming `what` for an empty list or a malformed address.
  static StatusOr<EtcdOptions> Parse(std::string_view list, std::string_view what = "MORPH_ETCD");
};

struct EtcdKv {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

// What a leader's writes are conditioned on: `key` still holds `value` on `lease`. A successor
// rewrites the key with its own value and lease, and an expired lease deletes it; either way the
// old leader's fenced writes are refused.
struct EtcdFence {
  std::string key;
  std::string value;
  int64_t lease = 0;
};

class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // A lease of `ttl_s` seconds; its id.
  StatusOr<int64_t> LeaseGrant(int64_t ttl_s);
  // Renews the lease; the TTL it now has. kNotFound when it has expired or was revoked.
  StatusOr<int64_t> LeaseKeepAlive(int64_t lease);
  // Ends the lease at once (its keys go with it). OK for an unknown lease.
  Status LeaseRevoke(int64_t lease);

  // The key, or nullopt when absent.
  StatusOr<std::optional<EtcdKv>> Get(const std::string& key);
  // Every key starting with `prefix`, in key order.
  StatusOr<std::vector<EtcdKv>> GetPrefix(const std::string& prefix);
  // Unconditional (lease 0: none).
  Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status Delete(const std::string& key);
  // Every key starting with `prefix`.
  Status DeletePrefix(const std::string& prefix);

  // Creates `key` = `value` on `lease` if it does not exist, in one transaction; whether it did.
  StatusOr<bool> CreateIfAbsent(const std::string& key, const std::string& value, int64_t lease);
  // Puts every pair and deletes every key of `deletes` in one transaction that applies only if
  // `fence` holds. kAborted "fence lost" when it does not (nothing was written).
  Status FencedPut(const EtcdFence& fence,
                   const std::vector<std::pair<std::string, std::string>>& puts,
                   const std::vector<std::string>& deletes = {});

  const EtcdOptions& options() const { return options_; }

  class Connection;

 private:
  // POSTs `json` to `path`; the reply's JSON text.
  StatusOr<std::string> Call(std::string_view path, const std::string& json);

  EtcdOptions options_;
  std::mutex mu_;
  size_t current_ = 0;  // the endpoint tried first
  std::unique_ptr<Connection> conn_;
};

// Base64 (RFC 4648, with padding), as etcd's JSON carries bytes. Exposed for tests.
std::string Base64Encode(std::string_view bytes);
// kDataLoss for text that is not base64.
StatusOr<std::string> Base64Decode(std::string_view text);

}  // namespace morph

#endif  // MORPH_RUNTIME_HA_ETCD_CLIENT_H_
