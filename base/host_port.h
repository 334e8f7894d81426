// "host:port" addresses as morph's listeners hand them out (the store, the coordinator's control
// channel): an IP address, a "[v6]" literal or a host name, then a port in 1..65535.
//
//   MORPH_ASSIGN_OR_RETURN(HostPort hp, SplitHostPort("store address", "node7:29500"));
//   // hp.host == "node7", hp.port == "29500"
//
// Pure function; any thread.
#ifndef MORPH_BASE_HOST_PORT_H_
#define MORPH_BASE_HOST_PORT_H_

#include <string>
#include <string_view>

#include "morph/status.h"

namespace morph {

struct HostPort {
  std::string host;  // brackets of a "[v6]" literal removed
  std::string port;  // decimal, 1..65535
};

// kInvalidArgument "<what> '<address>': expected host:port" / ": bad port 'x'" / ": empty host".
StatusOr<HostPort> SplitHostPort(std::string_view what, const std::string& address);

// The longest host a peer may name itself by: a DNS name's limit.
inline constexpr size_t kMaxHostBytes = 255;

// A host as a peer names itself (a worker's Hello, shown in logs and /v1/status): 1 to 255
// bytes of printable ASCII other than the space (0x21..0x7e), which takes in every DNS name and
// IPv4 or IPv6 address and leaves out line breaks, terminal escapes and anything else that could
// forge a log line. kInvalidArgument naming `field` ("hello.host: byte 6 is 0x0a, ..."; the
// bytes themselves are not echoed).
Status CheckHostName(std::string_view field, std::string_view host);

}  // namespace morph

#endif  // MORPH_BASE_HOST_PORT_H_
