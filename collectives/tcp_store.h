// A Store served over TCP: the coordinator (or rank 0, or a test) runs a TcpStoreServer;
// every rank talks to it through a TcpStoreClient. Traffic is authenticated by the job token
// (MORPH_TOKEN): a client that presents a different token gets kUnauthenticated and its
// connection is closed.
//
//   MORPH_ASSIGN_OR_RETURN(auto server, TcpStoreServer::Start("127.0.0.1", /*port=*/0, token));
//   MORPH_ASSIGN_OR_RETURN(auto store, TcpStoreClient::Connect(server->address(), token,
//                                                              /*generation=*/0,
//                                                              Deadline::AfterMs(5000)));
//   MORPH_RETURN_IF_ERROR(store->Set("k", "v", Deadline::AfterMs(1000)));
//
// Wire format (little endian): frames of u32 length + body. A client's first frame is its
// token; then one request at a time, each answered by one response. Blocking requests
// (get/wait) wait on the server, which answers when the keys appear or the request's own
// timeout passes, so the server never blocks its thread.
#ifndef MORPH_COLLECTIVES_TCP_STORE_H_
#define MORPH_COLLECTIVES_TCP_STORE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/store.h"

namespace morph {

// The job token: MORPH_TOKEN, else the contents of MORPH_TOKEN_FILE (surrounding whitespace
// trimmed). kFailedPrecondition if neither is set, kNotFound/kPermissionDenied naming the
// file if it cannot be read, kInvalidArgument if the token is empty. Any thread.
StatusOr<std::string> JobTokenFromEnv();

class TcpStoreServer {
 public:
  // Listens on host:port (port 0: an ephemeral port) and serves from a thread of its own.
  // kInvalidArgument for a host that is not an IP address or an empty token, kUnavailable if
  // it cannot bind. Any thread.
  static StatusOr<std::unique_ptr<TcpStoreServer>> Start(const std::string& host, uint16_t port,
                                                         std::string token);
  // Stops: closes the listener and every connection (clients then get kUnavailable).
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const;
  // "host:port", what clients pass to Connect.
  std::string address() const;
  // The table it serves (e.g. for a coordinator in the same process, or tests).
  const std::shared_ptr<KvTable>& table() const;
  // Number of client connections currently open.
  int connections() const;

  class Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class TcpStoreClient : public KvStore {
 public:
  // Connects to "host:port" and authenticates with `token`, retrying refused connections
  // until `deadline` (the server may still be starting). kInvalidArgument for a malformed
  // address, kUnauthenticated for a wrong token, kDeadlineExceeded / kUnavailable when the
  // server cannot be reached in time. Any thread.
  static StatusOr<std::unique_ptr<TcpStoreClient>> Connect(const std::string& address,
                                                           std::string token, int64_t generation,
                                                           Deadline deadline);
  ~TcpStoreClient() override;

  // A new client of the same server for another generation (a fresh connection).
  StatusOr<std::unique_ptr<TcpStoreClient>> ForGeneration(int64_t generation,
                                                          Deadline deadline) const;

  int64_t generation() const override { return generation_; }

  class Conn;

 private:
  TcpStoreClient(std::string address, std::string token, int64_t generation,
                 std::unique_ptr<Conn> conn);
  KvTable::Response Execute(KvTable::Request request, Deadline deadline) override;

  const std::string address_;
  const std::string token_;
  const int64_t generation_;
  std::mutex mu_;
  // Connections not in use. A call takes one (or dials one) and returns it when it succeeds;
  // a connection that failed is dropped.
  std::vector<std::unique_ptr<Conn>> idle_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_TCP_STORE_H_
