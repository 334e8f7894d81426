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

Status CheckHostName(std::string_view field, std::string_view host) {
  if (host.empty()) return InvalidArgumentError(std::string(field) + ": empty");
  if (host.size() > kMaxHostBytes) {
    return InvalidArgumentError(std::string(field) + ": " + std::to_string(host.size()) +
                                " bytes, more than " + std::to_string(kMaxHostBytes));
  }
  for (size_t i = 0; i < host.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(host[i]);
    if (c > 0x20 && c < 0x7f) continue;
    static constexpr char kHex[] = "0123456789abcdef";
    return InvalidArgumentError(std::string(field) + ": byte " + std::to_string(i) + " is 0x" +
                                kHex[c >> 4] + kHex[c & 0xf] +
                                ", not printable ASCII without spaces (0x21-0x7e)");
  }
  return Status::Ok();
}

}  // namespace morph
