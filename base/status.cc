#include "morph/status.h"

#include <glog/logging.h>

#include <algorithm>

namespace morph {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnknown: return "UNKNOWN";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
  }
  return "UNKNOWN_CODE";
}

std::ostream& operator<<(std::ostream& os, StatusCode code) { return os << StatusCodeName(code); }

std::string_view CollectiveFailureKindName(CollectiveFailure::Kind kind) {
  switch (kind) {
    case CollectiveFailure::Kind::kPeerClosed: return "peer_closed";
    case CollectiveFailure::Kind::kTimeout: return "timeout";
    case CollectiveFailure::Kind::kRemoteError: return "remote_error";
    case CollectiveFailure::Kind::kAborted: return "aborted";
  }
  return "unknown";
}

Status::Status(StatusCode code, std::string_view message) {
  if (code != StatusCode::kOk) {
    rep_ = std::make_shared<const Rep>(Rep{code, std::string(message), nullptr});
  }
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code()));
  if (!rep_->message.empty()) {
    out += ": ";
    out += rep_->message;
  }
  return out;
}

Status Status::WithContext(std::string_view context) const& {
  if (ok() || context.empty()) return *this;
  std::string msg(context);
  if (!rep_->message.empty()) {
    msg += ": ";
    msg += rep_->message;
  }
  Status out;
  out.rep_ = std::make_shared<const Rep>(Rep{rep_->code, std::move(msg), rep_->failure});
  return out;
}

Status Status::WithContext(std::string_view context) && {
  return static_cast<const Status&>(*this).WithContext(context);
}

Status Status::WithCollectiveFailure(CollectiveFailure failure) const {
  if (ok()) return *this;
  std::sort(failure.peers.begin(), failure.peers.end());
  failure.peers.erase(std::unique(failure.peers.begin(), failure.peers.end()),
                      failure.peers.end());
  Status out;
  out.rep_ = std::make_shared<const Rep>(
      Rep{rep_->code, rep_->message, std::make_shared<const CollectiveFailure>(std::move(failure))});
  return out;
}

void Status::CheckOk(std::string_view what) const {
  if (!ok()) LOG(FATAL) << what << (what.empty() ? "" : ": ") << ToString();
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

#define MORPH_DEFINE_ERROR_(Name, Code) \
  Status Name(std::string_view message) { return Status(StatusCode::Code, message); }
MORPH_DEFINE_ERROR_(CancelledError, kCancelled)
MORPH_DEFINE_ERROR_(UnknownError, kUnknown)
MORPH_DEFINE_ERROR_(InvalidArgumentError, kInvalidArgument)
MORPH_DEFINE_ERROR_(DeadlineExceededError, kDeadlineExceeded)
MORPH_DEFINE_ERROR_(NotFoundError, kNotFound)
MORPH_DEFINE_ERROR_(AlreadyExistsError, kAlreadyExists)
MORPH_DEFINE_ERROR_(PermissionDeniedError, kPermissionDenied)
MORPH_DEFINE_ERROR_(ResourceExhaustedError, kResourceExhausted)
MORPH_DEFINE_ERROR_(FailedPreconditionError, kFailedPrecondition)
MORPH_DEFINE_ERROR_(AbortedError, kAborted)
MORPH_DEFINE_ERROR_(OutOfRangeError, kOutOfRange)
MORPH_DEFINE_ERROR_(UnimplementedError, kUnimplemented)
MORPH_DEFINE_ERROR_(InternalError, kInternal)
MORPH_DEFINE_ERROR_(UnavailableError, kUnavailable)
MORPH_DEFINE_ERROR_(DataLossError, kDataLoss)
MORPH_DEFINE_ERROR_(UnauthenticatedError, kUnauthenticated)
#undef MORPH_DEFINE_ERROR_

}  // namespace morph
