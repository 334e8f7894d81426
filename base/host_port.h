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

#include "base/status.h"

namespace morph {

struct HostPort {
  std::string host;  // brackets of a "[v6]" literal removed
  std::string port;  // decimal, 1..65535
};

// kInvalidArgument "<what> '<address>': expected host:port" / ": bad port 'x'" / ": empty host".
StatusOr<HostPort> SplitHostPort(std::string_view what, const std::string& address);

}  // namespace morph

#endif  // MORPH_BASE_HOST_PORT_H_
