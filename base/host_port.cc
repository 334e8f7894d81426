#include "base/host_port.h"

#include <cstdlib>

namespace morph {

StatusOr<HostPort> SplitHostPort(std::string_view what, const std::string& address) {
  const std::string head = std::string(what) + " '" + address + "': ";
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) return InvalidArgumentError(head + "expected host:port");
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::string port_text = address.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port < 1 || port > 65535) {
    return InvalidArgumentError(head + "bad port '" + port_text + "'");
  }
  if (host.empty()) return InvalidArgumentError(head + "empty host");
  return HostPort{host, port_text};
}

}  // namespace morph
