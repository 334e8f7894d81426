// HttpServer: the scheduler API's I/O shell, a Boost.Beast HTTP/1.1 server on the coordinator's
// io_context (docs/operations.md "Scheduler API"). It frames requests, enforces the limits
// (header and body size, a read timeout per request so a slow client cannot hold a
// connection, a cap on connections), checks the token and routes to http_api.h's functions and
// the caller's callbacks. It never blocks the io thread.
//
//   HttpServer server(io, {.token = token, .max_world = 64},
//                     {.resize = [&](ResizeCall call, HttpServer::Answer answer) {
//                        call.request.request_id = ++last_id;
//                        pending[last_id] = std::move(answer);
//                        Execute(decider.Handle(Now(), DeciderEvent::Resize{call.request}));
//                        return last_id;
//                      },
//                      .snapshot = [&] { return SnapshotOf(decider); }});
//   MORPH_RETURN_IF_ERROR(server.Start());
//   LOG(INFO) << "scheduler API on 127.0.0.1:" << server.port();
//   ...  // on DeciderAction::AnswerResize{id, status}: pending[id](status)
//
// Reads (GET /v1/status, GET /metrics) need no token unless `token_for_reads`; POST /v1/resize
// always needs "Authorization: Bearer <token>" (401 without or with a wrong one) and is refused
// (403) when the server has no token at all.
//
// Threads: construct, Start, Stop and destroy on the io thread, or while the io_context is not
// running. Callbacks run on the io thread; an Answer may be called from any thread, once (later
// calls are ignored).
#ifndef MORPH_RUNTIME_COORDINATOR_HTTP_SERVER_H_
#define MORPH_RUNTIME_COORDINATOR_HTTP_SERVER_H_

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "morph/status.h"
#include "runtime/coordinator/http_api.h"

namespace morph {

class HttpSession;

struct HttpServerOptions {
  std::string address = "127.0.0.1";   // MORPH_API_ADDR
  uint16_t port = 0;                   // MORPH_API_PORT; 0: the kernel picks one (see port())
  std::string token;                   // the job token; empty: mutating calls are refused (403)
  bool token_for_reads = false;        // also require the token on GET endpoints
  int max_world = 1 << 16;             // the largest world_size / add accepted
  size_t max_header_bytes = 8 * 1024;  // larger: 431
  size_t max_body_bytes = 64 * 1024;   // larger: 413
  // A request (headers and body) must arrive within this; an idle keep-alive connection is
  // closed after it too.
  std::chrono::milliseconds read_timeout{10000};
  std::chrono::milliseconds write_timeout{10000};
  // A resize callback that has not answered by then gets 504 (the request stays submitted).
  std::chrono::milliseconds answer_timeout{30000};
  int max_connections = 64;  // further connections are closed as soon as accepted

  // address, port and token_for_reads from MORPH_API_ADDR, MORPH_API_PORT and
  // MORPH_API_TOKEN_FOR_READS. The token is the coordinator's (CoordinatorOptions::FromEnv reads
  // it once and sets both). kInvalidArgument naming the variable for a value that does not parse.
  static StatusOr<HttpServerOptions> FromEnv();
};

class HttpServer {
 public:
  using Answer = std::function<void(Status)>;
  struct Callbacks {
    // A validated, authorized resize: returns the id the coordinator numbered it with (its one
    // counter, shared with Coordinator::Resize: the id of the 202 reply and of the log lines).
    // Answer OK (202) once the decider accepted it, or its error (HttpStatusFor maps the code).
    std::function<int64_t(ResizeCall call, Answer answer)> resize;
    std::function<CoordinatorSnapshot()> snapshot;
  };

  HttpServer(boost::asio::io_context& io, HttpServerOptions options, Callbacks callbacks);
  ~HttpServer();  // Stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens. kInvalidArgument for an address that does not parse or missing
  // callbacks, kUnavailable when the bind fails (port in use), kFailedPrecondition if started.
  Status Start();
  // Closes the listener and every connection; pending answers are dropped. Idempotent.
  void Stop();
  uint16_t port() const;  // the bound port after Start (0 before)

  struct Stats {
    int64_t connections_accepted = 0;
    int64_t connections_rejected = 0;  // over max_connections
    int64_t timeouts = 0;              // connections dropped by the read or write timeout
    int open_connections = 0;
  };
  Stats stats() const;  // io thread

 private:
  friend class HttpSession;  // one connection (http_server.cc)
  struct Core;
  std::shared_ptr<Core> core_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_HTTP_SERVER_H_
