// ApiClient: a small blocking HTTP/1.1 client for the coordinator's scheduler API
// (docs/operations.md "Scheduler API"), used by morphctl. One request per connection; every
// step (resolve, connect, write, read) is bounded by the client's timeout.
//
//   MORPH_ASSIGN_OR_RETURN(ApiEndpoint ep, ApiEndpoint::Resolve(flag_addr, flag_token));
//   ApiClient client(ep, std::chrono::seconds(10));
//   MORPH_ASSIGN_OR_RETURN(ApiResponse r, client.Get("/v1/status"));
//   if (r.status != 200) std::cerr << ServerMessage(r) << "\n";
//
// Any thread; one ApiClient per thread (it owns no connection between calls).
#ifndef MORPH_RUNTIME_TOOLS_API_CLIENT_H_
#define MORPH_RUNTIME_TOOLS_API_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "morph/status.h"

namespace morph {

// Where the scheduler API is and how to authenticate.
struct ApiEndpoint {
  std::string host = "127.0.0.1";  // an IP address or a host name
  uint16_t port = 0;
  std::string token;  // empty: requests carry no Authorization header

  // "host:port", "[v6]:port". kInvalidArgument naming `what` for anything else.
  static StatusOr<ApiEndpoint> ParseAddress(std::string_view address, std::string_view what);

  // The endpoint from explicit values first, then the environment: the address from `addr`
  // ("host:port") or MORPH_API_ADDR + MORPH_API_PORT; the token from `token`, or MORPH_TOKEN /
  // MORPH_TOKEN_FILE (collectives' JobTokenFromEnv; none set leaves it empty).
  // kInvalidArgument naming the flag or variable that is malformed, or when no port is known
  // (MORPH_API_PORT unset or 0 and no --addr); the token file's kNotFound /
  // kPermissionDenied / kInvalidArgument (empty file).
  static StatusOr<ApiEndpoint> Resolve(std::optional<std::string> addr,
                                       std::optional<std::string> token);

  std::string ToString() const;  // "host:port"
};

struct ApiResponse {
  int status = 0;
  std::string content_type;
  std::string body;
};

// The message of an error reply: the "error" member of its JSON body when there is one, else
// the body itself (trimmed), else the HTTP reason phrase.
std::string ServerMessage(const ApiResponse& response);

class ApiClient {
 public:
  ApiClient(ApiEndpoint endpoint, std::chrono::milliseconds timeout)
      : endpoint_(std::move(endpoint)), timeout_(timeout) {}

  // One request; any HTTP status is a successful call (the caller reads `status`).
  // kUnavailable when the server cannot be reached (refused, reset, closed before replying,
  // name not resolved), kDeadlineExceeded when a step takes longer than the timeout,
  // kDataLoss for a reply that is not HTTP or larger than 16 MiB.
  StatusOr<ApiResponse> Get(std::string_view target) const;
  StatusOr<ApiResponse> Post(std::string_view target, std::string_view json_body) const;

  const ApiEndpoint& endpoint() const { return endpoint_; }

 private:
  StatusOr<ApiResponse> Request(bool post, std::string_view target, std::string_view body) const;

  ApiEndpoint endpoint_;
  std::chrono::milliseconds timeout_;
};

}  // namespace morph

#endif  // MORPH_RUNTIME_TOOLS_API_CLIENT_H_
