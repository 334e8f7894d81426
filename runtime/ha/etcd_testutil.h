// EtcdCluster: a private etcd cluster for tests (label `ha`): `members` etcd processes from
// Debian's etcd-server on free loopback ports, with their data in a fresh temporary folder.
// Every member is killed (SIGKILL) and the folder removed on destruction; every wait is bounded.
//
//   MORPH_ASSIGN_OR_RETURN(auto etcd, EtcdCluster::Start(3));   // kNotFound: no etcd binary
//   setenv("MORPH_ETCD", etcd->endpoints().c_str(), 1);
//   etcd->Kill(1);   // one member down: the others keep the quorum
#ifndef MORPH_RUNTIME_HA_ETCD_TESTUTIL_H_
#define MORPH_RUNTIME_HA_ETCD_TESTUTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "morph/status.h"
#include "runtime/ha/etcd_client.h"

namespace morph {

class EtcdCluster {
 public:
  // kNotFound when no etcd binary is installed (MORPH_ETCD_BINARY, else `etcd` on PATH or
  // /usr/bin/etcd); kDeadlineExceeded when the cluster does not answer within 30 s (the members'
  // logs are left in the folder and named in the message).
  // `client_host`: the IPv4 address its members serve clients on (their peers talk over
  // loopback), e.g. a bridge's address that network namespaces reach; its ports are picked free
  // on loopback.
  static StatusOr<std::unique_ptr<EtcdCluster>> Start(int members = 3,
                                                      const std::string& client_host = "127.0.0.1");
  ~EtcdCluster();

  // "127.0.0.1:p1,127.0.0.1:p2,..." (MORPH_ETCD's format; the client host instead of
  // 127.0.0.1 when one was given).
  std::string endpoints() const;
  EtcdOptions options() const;
  const std::string& dir() const { return dir_; }
  // SIGKILLs member `i` and waits for it.
  void Kill(int i);
  // Starts member `i` again (killed first if it runs) on its data: it rejoins the cluster.
  Status Restart(int i);
  // Until a write goes through (a raft leader serves), at most 30 s.
  Status WaitReady();

 private:
  EtcdCluster() = default;
  Status Spawn(int i);

  std::vector<std::vector<std::string>> args_;  // each member's command line

  std::string dir_;
  std::string client_host_ = "127.0.0.1";
  std::vector<uint16_t> client_ports_;
  std::vector<pid_t> pids_;
};

// A loopback TCP port nobody listens on now (bound, then released).
uint16_t FreeLoopbackPort();

// The coordinator leading the job under `prefix`, as <prefix>/leader names it.
struct LeaderSeen {
  std::string control;  // its control address; empty: none was seen
  uint16_t http_port = 0;
};
// Polls <prefix>/leader every 5 ms until a coordinator other than control address `not_`
// leads; an empty LeaderSeen after `timeout_ms`.
LeaderSeen WaitForLeader(EtcdOptions options, const std::string& prefix, int64_t timeout_ms,
                         const std::string& not_ = "");

}  // namespace morph

#endif  // MORPH_RUNTIME_HA_ETCD_TESTUTIL_H_
