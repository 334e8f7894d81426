// Turning errors of the APIs morph calls into Status, with the API's own message and the
// call site's file:line. Syscalls are retried on EINTR.
//
//   MORPH_SYSCALL_RETURN_IF_ERROR(::fsync(fd)) << "syncing " << path;
//   MORPH_ASSIGN_SYSCALL_OR_RETURN(int fd, ::open(path, O_RDONLY));
//   MORPH_ASSIGN_SYSCALL_OR_RETURN(ssize_t n, ::read(fd, buf, len), "reading " << path);
//
// CUDA, NCCL and MPI have their own headers (cuda_check.h, nccl_check.h, mpi_check.h) so that
// code which does not use those APIs does not need their headers.
#ifndef MORPH_BASE_CHECK_H_
#define MORPH_BASE_CHECK_H_

#include <cerrno>
#include <string_view>

#include "morph/status.h"

namespace morph {

// The code a caller should act on for an errno value: ECONNREFUSED/ECONNRESET/EPIPE/
// EHOSTUNREACH -> kUnavailable, ETIMEDOUT -> kDeadlineExceeded, ENOENT -> kNotFound,
// EEXIST -> kAlreadyExists, EACCES/EPERM -> kPermissionDenied, ENOMEM/ENOSPC/EMFILE/ENFILE/
// EDQUOT -> kResourceExhausted, EINVAL/EBADF -> kInvalidArgument, EAGAIN -> kUnavailable,
// ECANCELED -> kCancelled, anything else -> kInternal.
StatusCode ErrnoToStatusCode(int err);

// "<call> failed: <strerror(err)> (errno <err>) [file:line]".
Status ErrnoToStatus(int err, std::string_view call, const char* file, int line);

// "<api> failed: <api message> (<api> error <code>) [file:line]" with the given status code.
Status ApiError(StatusCode status_code, std::string_view api, std::string_view call,
                long long api_code, std::string_view api_message, const char* file, int line);

namespace internal {

// Runs `fn` until it returns something other than -1 with errno EINTR.
template <typename Fn>
auto RetryOnEintr(Fn&& fn) -> decltype(fn()) {
  decltype(fn()) r;
  do {
    r = fn();
  } while (r == -1 && errno == EINTR);
  return r;
}

}  // namespace internal
}  // namespace morph

// Evaluates a syscall-like expression (returns -1 and sets errno on failure), retrying EINTR.
#define MORPH_SYSCALL_RETURN_IF_ERROR(call)                                                  \
  if (auto _morph_sys_r = ::morph::internal::RetryOnEintr([&] { return (call); });           \
      _morph_sys_r != -1) {                                                                  \
  } else                                                                                     \
    return ::morph::internal::StatusBuilder(                                                 \
        ::morph::ErrnoToStatus(errno, #call, __FILE__, __LINE__))

// MORPH_ASSIGN_SYSCALL_OR_RETURN(lhs, call[, context-stream]).
#define MORPH_ASSIGN_SYSCALL_OR_RETURN(lhs, ...)                                             \
  MORPH_ASSIGN_SYSCALL_OR_RETURN_IMPL_(MORPH_STATUS_CONCAT_(_morph_sys_, __COUNTER__), lhs,   \
                                       __VA_ARGS__)
#define MORPH_ASSIGN_SYSCALL_OR_RETURN_IMPL_(var, lhs, call, ...)                            \
  auto var = ::morph::internal::RetryOnEintr([&] { return (call); });                        \
  if (var == -1) {                                                                           \
    ::morph::internal::StatusBuilder _morph_builder(                                         \
        ::morph::ErrnoToStatus(errno, #call, __FILE__, __LINE__));                           \
    __VA_OPT__(_morph_builder << __VA_ARGS__;)                                               \
    return _morph_builder;                                                                   \
  }                                                                                          \
  lhs = var

#endif  // MORPH_BASE_CHECK_H_
