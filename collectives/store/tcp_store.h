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
// Wire format (store_protocol.h): frames of u32 length + body. A client's first frame is its
// token; then one request at a time, each answered by one response. Blocking requests
// (get/wait) wait on the server, which answers when the keys appear or the request's own
// timeout passes, so the server never blocks its thread.
//
// The server survives any client (docs/collectives.md, "Store limits"): before authentication
// it reads only a token frame of up to 4 KiB and closes the connection after
// MORPH_STORE_AUTH_TIMEOUT_MS; after it, frames up to MORPH_STORE_MAX_FRAME_BYTES whose
// buffers grow as bytes arrive; at most MORPH_STORE_MAX_CONNECTIONS connections (at the cap
// the oldest unauthenticated one is dropped, else the new one is closed), of which at most an
// eighth of the open-file limit unauthenticated (base/connection_limit.h); a client that
// disconnects while it waits has its request dropped; clients advance generations by at most
// one, the server's owner by any amount (AdvanceGeneration).
#ifndef MORPH_COLLECTIVES_TCP_STORE_H_
#define MORPH_COLLECTIVES_TCP_STORE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/store/store.h"

namespace morph {

// The job token: MORPH_TOKEN, else the contents of MORPH_TOKEN_FILE (surrounding whitespace
// trimmed). kFailedPrecondition if neither is set, kNotFound/kPermissionDenied naming the
// file if it cannot be read, kInvalidArgument if the token is empty. Any thread.
StatusOr<std::string> JobTokenFromEnv();

// Limits of a TcpStoreServer (see docs/collectives.md and docs/operations.md).
struct TcpStoreServerOptions {
  // Open connections at most; further bounded by the process's open-file limit minus 32, and
  // unauthenticated ones by an eighth of it (PreAuthCap).
  int64_t max_connections = 16384;
  // Largest request body after authentication.
  uint32_t max_frame_bytes = 64u << 20;
  // A connection that has not authenticated by then is closed.
  int64_t auth_timeout_ms = 5000;

  // MORPH_STORE_MAX_CONNECTIONS, MORPH_STORE_MAX_FRAME_BYTES, MORPH_STORE_AUTH_TIMEOUT_MS,
  // read now (the defaults above where unset): call once, at the top of a program.
  // kInvalidArgument naming the variable for a bad value. Any thread.
  static StatusOr<TcpStoreServerOptions> FromEnv();
};

// What a server holds now (for tests, benchmarks and metrics). Counters are totals.
struct TcpStoreServerStats {
  int64_t connections = 0;
  int64_t unauthenticated = 0;
  int64_t pending_waits = 0;        // get/wait requests waiting for keys
  int64_t buffered_bytes = 0;       // request bytes held in connection buffers
  int64_t waiter_checks = 0;        // waiting requests re-examined after a mutation
  int64_t refused_connections = 0;  // closed at once or dropped because of the cap
  int64_t accept_errors = 0;        // failed accepts (e.g. EMFILE), each followed by a back-off
};

class TcpStoreServer {
 public:
  // Listens on host:port (host: an IP address or a name that resolves; port 0: an ephemeral
  // port) and serves from a thread of its own. kInvalidArgument for a host that does not
  // resolve or an empty token, kUnavailable if it cannot bind. Any thread. The first form
  // uses the default options; neither reads the environment (a program that honours
  // MORPH_STORE_* calls TcpStoreServerOptions::FromEnv once and passes the result). A token
  // longer than 4,092 bytes is kInvalidArgument.
  static StatusOr<std::unique_ptr<TcpStoreServer>> Start(const std::string& host, uint16_t port,
                                                         std::string token);
  static StatusOr<std::unique_ptr<TcpStoreServer>> Start(const std::string& host, uint16_t port,
                                                         std::string token,
                                                         const TcpStoreServerOptions& options);
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
  TcpStoreServerStats stats() const;

  // The owner's advance (the coordinator's side): makes `generation` the oldest one served,
  // however far ahead, and answers every request waiting in an older one with kAborted.
  // Never moves backwards. Any thread.
  void AdvanceGeneration(int64_t generation);

  class Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class TcpStoreClient : public KvStore {
 public:
  // Connects to "host:port" (an IP address, "[v6]", or a name resolved once, here, by the
  // system resolver) and authenticates with `token`, retrying refused connections until
  // `deadline` (the server may still be starting). kInvalidArgument for a malformed address
  // or a host name that does not exist, kUnavailable if the resolver fails, kUnauthenticated for a
  // wrong token, kDeadlineExceeded / kUnavailable when the server cannot be reached in time. Any
  // thread.
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
  struct Resolved;  // the server's endpoints, resolved once by Connect
  static StatusOr<std::unique_ptr<TcpStoreClient>> ConnectTo(
      const std::string& address, std::shared_ptr<const Resolved> resolved, std::string token,
      int64_t generation, Deadline deadline);
  TcpStoreClient(std::string address, std::shared_ptr<const Resolved> resolved, std::string token,
                 int64_t generation, std::unique_ptr<Conn> conn);
  KvTable::Response Execute(KvTable::Request request, Deadline deadline) override;

  const std::string address_;
  const std::shared_ptr<const Resolved> resolved_;
  const std::string token_;
  const int64_t generation_;
  std::mutex mu_;
  // Connections not in use. A call takes one (or dials one) and returns it when it succeeds;
  // a connection that failed is dropped.
  std::vector<std::unique_ptr<Conn>> idle_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_TCP_STORE_H_
