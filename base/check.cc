#include "base/check.h"

#include <cstring>
#include <string>

namespace morph {

StatusCode ErrnoToStatusCode(int err) {
  switch (err) {
    case ECONNREFUSED:
    case ECONNRESET:
    case ECONNABORTED:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case EAGAIN:
    case ENOTCONN:
      return StatusCode::kUnavailable;
    case ETIMEDOUT:
      return StatusCode::kDeadlineExceeded;
    case ENOENT:
      return StatusCode::kNotFound;
    case EEXIST:
    case EADDRINUSE:
      return StatusCode::kAlreadyExists;
    case EACCES:
    case EPERM:
      return StatusCode::kPermissionDenied;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case EDQUOT:
      return StatusCode::kResourceExhausted;
    case EINVAL:
    case EBADF:
    case ENAMETOOLONG:
    case ENOTDIR:
    case EISDIR:
      return StatusCode::kInvalidArgument;
    case ECANCELED:
      return StatusCode::kCancelled;
    default:
      return StatusCode::kInternal;
  }
}

static std::string Where(const char* file, int line) {
  std::string_view f(file);
  // Keep the path from the repository root: ".../morph/base/x.cc" -> "base/x.cc".
  for (std::string_view root : {"/base/", "/reshard/", "/collectives/", "/runtime/", "/tests/",
                                "/bench/", "/examples/"}) {
    if (auto pos = f.rfind(root); pos != std::string_view::npos) {
      f.remove_prefix(pos + 1);
      break;
    }
  }
  return std::string(f) + ":" + std::to_string(line);
}

Status ErrnoToStatus(int err, std::string_view call, const char* file, int line) {
  char buf[256];
  // GNU strerror_r returns the message pointer, which may or may not be buf.
  const char* msg = strerror_r(err, buf, sizeof(buf));
  std::string out(call);
  out += " failed: ";
  out += msg;
  out += " (errno " + std::to_string(err) + ") [" + Where(file, line) + "]";
  return Status(ErrnoToStatusCode(err), out);
}

Status ApiError(StatusCode status_code, std::string_view api, std::string_view call,
                long long api_code, std::string_view api_message, const char* file, int line) {
  std::string out(call);
  out += " failed: ";
  out += api_message;
  out += " (";
  out += api;
  out += " error " + std::to_string(api_code) + ") [" + Where(file, line) + "]";
  return Status(status_code, out);
}

}  // namespace morph
