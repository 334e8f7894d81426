// getpeername(2) for Gloo's accept path. Linux hands out from accept(2) a connection whose peer
// reset it while it waited in the backlog, and getpeername on it then fails with ENOTCONN.
// Gloo's tcp::Pair::handleConnected enforces that call on its event thread, where the exception
// ends the process (std::terminate): a peer dying while it connects (a killed rank, an abandoned
// rendezvous) took its peers down with it (seen in CI: gloo_communicator_test,
// APeerThatDiesBeforeConnectingEndsTheRendezvousAtTheDeadline).
//
// This definition, which the dynamic linker finds before libc's, answers that one case (a call
// from libgloo that failed with ENOTCONN) with an unspecified address of the socket's own family.
// The pair then reads its reset socket and fails the way any closed connection does. Every other
// call, and every other result, is the next definition's (libc's, or a sanitizer's).
#include <dlfcn.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "collectives/gloo/gloo_support.h"

namespace {

using GetPeerName = int (*)(int, sockaddr*, socklen_t*);

GetPeerName Next() {
  static GetPeerName next = reinterpret_cast<GetPeerName>(dlsym(RTLD_NEXT, "getpeername"));
  return next;
}

bool CalledFromGloo(const void* return_address) {
  Dl_info info;
  return dladdr(return_address, &info) != 0 && info.dli_fname != nullptr &&
         std::strstr(info.dli_fname, "libgloo") != nullptr;
}

}  // namespace

// Exported (default visibility, and listed in libmorph.map): the dynamic linker must find it.
extern "C" __attribute__((visibility("default"))) int getpeername(int fd, __SOCKADDR_ARG addr,
                                                                  socklen_t* __restrict len)
    __THROW {
  GetPeerName next = Next();
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  sockaddr* out = reinterpret_cast<sockaddr*>(addr);
  const int rv = next(fd, out, len);
  if (rv == 0 || errno != ENOTCONN || out == nullptr || len == nullptr ||
      !CalledFromGloo(__builtin_return_address(0))) {
    return rv;
  }
  sockaddr_storage self{};
  socklen_t self_len = sizeof(self);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_len) != 0) {
    errno = ENOTCONN;
    return -1;
  }
  sockaddr_storage unspecified{};
  unspecified.ss_family = self.ss_family;  // address and port zero
  const socklen_t n = std::min<socklen_t>(*len, self_len);
  std::memcpy(out, &unspecified, n);
  *len = self_len;
  return 0;
}

namespace morph::gloo_support {

bool AcceptGuardLinked() { return Next() != nullptr; }

}  // namespace morph::gloo_support
