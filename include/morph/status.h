// Status and StatusOr<T>: how every fallible morph call reports what went wrong.
//
// Codes are chosen by what the caller should do next, as Abseil's are:
//   kUnavailable       a peer or service is not reachable now: retry later
//   kAborted           membership changed under the call: re-rendezvous, retry the step
//   kDeadlineExceeded  the call's timeout passed
//   kInvalidArgument   the caller's input is wrong: fix the call, retrying will not help
//   kFailedPrecondition the object is not in a state that allows the call
//   kInternal          a broken invariant inside morph: a bug
// Messages gain context as they cross layers:
//
//   Status s = ReadShard(path);           // "open(/ckpt/3.bin): No such file or directory"
//   return s.WithContext("loading step 7"); // "loading step 7: open(/ckpt/3.bin): ..."
//
//   MORPH_RETURN_IF_ERROR(Send(peer)) << "sending tensor " << name;
//   MORPH_ASSIGN_OR_RETURN(Plan plan, MakePlan(a, b));
//   MORPH_ASSIGN_OR_RETURN(auto bytes, ReadAll(fd), "reading " << path);
//
// A failed collective can carry a typed CollectiveFailure (which peers, what kind), so the
// runtime reacts to it without parsing messages; WithContext and copies keep it:
//
//   Status s = comm->Allreduce(...);
//   for (int peer : s.failed_peers()) suspects.insert(peer);
//
// Thread-safety: Status and StatusOr are values; distinct objects may be used concurrently.
#ifndef MORPH_STATUS_H_
#define MORPH_STATUS_H_

#include "morph/api.h"

#include <cstdlib>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace morph {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// "INVALID_ARGUMENT", "ABORTED", ...
MORPH_API std::string_view StatusCodeName(StatusCode code);
MORPH_API std::ostream& operator<<(std::ostream& os, StatusCode code);

// What a failed collective knows about its cause. Set by the communicator backends
// (collectives/) on the Status they return; read by whoever decides what to do next.
struct MORPH_API CollectiveFailure {
  enum class Kind : uint8_t {
    kPeerClosed,   // a peer's connection closed or reset (Gloo): `peers` says whose
    kTimeout,      // the operation's deadline passed; `peers` usually unknown (empty)
    kRemoteError,  // NCCL reported a remote or system error; it does not say which peer
    kAborted,      // Abort() was called on this rank's communicator
  };
  Kind kind = Kind::kPeerClosed;
  // Ranks, numbered in the communicator that failed, whose connection this rank saw fail.
  // Empty when unknown. A suspect list, not a verdict: a survivor that closed its own
  // connections in reaction to a failure can appear too. The coordinator's membership
  // decides who is dead.
  std::vector<int> peers;
  // The failed communicator's name, where the backend knows it ("world", "dp/p0t1", ...: the
  // group builder's names), so that its ranks can be mapped to workers.
  std::string group;
};
MORPH_API std::string_view CollectiveFailureKindName(CollectiveFailure::Kind kind);  // "peer_closed", ...

class [[nodiscard]] MORPH_API Status {
 public:
  // OK.
  Status() = default;
  // A non-OK status. `code == kOk` yields OK and drops the message.
  Status(StatusCode code, std::string_view message);

  static Status Ok() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // The message with all context prefixes, "" when OK.
  std::string_view message() const { return rep_ ? std::string_view(rep_->message) : ""; }
  // "OK" or "ABORTED: generation 3: allreduce: peer 2 closed the connection".
  std::string ToString() const;

  // Returns this status with "context: " prepended to its message. OK stays OK.
  Status WithContext(std::string_view context) const&;
  Status WithContext(std::string_view context) &&;

  // This status carrying `failure` (peers sorted, duplicates dropped). OK stays OK.
  Status WithCollectiveFailure(CollectiveFailure failure) const;
  // The failure a collective attached, null if none.
  const CollectiveFailure* collective_failure() const {
    return rep_ && rep_->failure ? rep_->failure.get() : nullptr;
  }
  // collective_failure()->peers, or empty.
  std::span<const int> failed_peers() const {
    const CollectiveFailure* f = collective_failure();
    return f ? std::span<const int>(f->peers) : std::span<const int>();
  }

  // Aborts the process (LOG(FATAL)) with `what` and the status if not OK. Only for
  // broken internal invariants, never for what a peer or user can cause.
  void CheckOk(std::string_view what = "") const;

  // Code and message only: the payload is extra detail.
  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    std::shared_ptr<const CollectiveFailure> failure;  // may be null
  };
  // Shared and immutable: copying a Status is a refcount bump.
  std::shared_ptr<const Rep> rep_;
};

MORPH_API std::ostream& operator<<(std::ostream& os, const Status& s);

// Constructors named by code.
MORPH_API Status CancelledError(std::string_view message);
MORPH_API Status UnknownError(std::string_view message);
MORPH_API Status InvalidArgumentError(std::string_view message);
MORPH_API Status DeadlineExceededError(std::string_view message);
MORPH_API Status NotFoundError(std::string_view message);
MORPH_API Status AlreadyExistsError(std::string_view message);
MORPH_API Status PermissionDeniedError(std::string_view message);
MORPH_API Status ResourceExhaustedError(std::string_view message);
MORPH_API Status FailedPreconditionError(std::string_view message);
MORPH_API Status AbortedError(std::string_view message);
MORPH_API Status OutOfRangeError(std::string_view message);
MORPH_API Status UnimplementedError(std::string_view message);
MORPH_API Status InternalError(std::string_view message);
MORPH_API Status UnavailableError(std::string_view message);
MORPH_API Status DataLossError(std::string_view message);
MORPH_API Status UnauthenticatedError(std::string_view message);

// StatusOr<T>: a T or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "StatusOr<Status> is not allowed");

 public:
  // A non-OK status. Passing OK is a bug and becomes kInternal.
  StatusOr(const Status& status) : status_(status) { FixOk(); }  // NOLINT: implicit
  StatusOr(Status&& status) : status_(std::move(status)) { FixOk(); }  // NOLINT: implicit
  StatusOr(const T& value) : value_(value) {}                           // NOLINT: implicit
  StatusOr(T&& value) : value_(std::move(value)) {}                      // NOLINT: implicit
  template <typename U,
            typename = std::enable_if_t<std::is_constructible_v<T, U&&> &&
                                        !std::is_same_v<std::decay_t<U>, StatusOr> &&
                                        !std::is_same_v<std::decay_t<U>, Status> &&
                                        !std::is_same_v<std::decay_t<U>, T>>>
  StatusOr(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT: implicit

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // Accessors abort the process when !ok(): check ok() first.
  const T& value() const& { EnsureOk(); return *value_; }
  T& value() & { EnsureOk(); return *value_; }
  T&& value() && { EnsureOk(); return std::move(*value_); }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& { return ok() ? *value_ : static_cast<T>(std::forward<U>(fallback)); }

 private:
  void FixOk() {
    if (status_.ok()) status_ = InternalError("StatusOr constructed from an OK status");
  }
  void EnsureOk() const {
    if (!ok()) status_.CheckOk("StatusOr::value() on an error");
  }

  Status status_;
  std::optional<T> value_;
};

namespace internal {

// Accumulates "<< context" after MORPH_RETURN_IF_ERROR and converts to Status or StatusOr.
class MORPH_API StatusBuilder {
 public:
  explicit StatusBuilder(Status status) : status_(std::move(status)) {}

  template <typename V>
  StatusBuilder& operator<<(const V& v) & {
    if (!context_) context_.emplace();
    *context_ << v;
    return *this;
  }
  template <typename V>
  StatusBuilder&& operator<<(const V& v) && {
    return std::move(*this << v);
  }

  operator Status() const { return Build(); }  // NOLINT: implicit
  template <typename T>
  operator StatusOr<T>() const {  // NOLINT: implicit
    return StatusOr<T>(Build());
  }
  Status Build() const { return context_ ? status_.WithContext(context_->str()) : status_; }

 private:
  Status status_;
  std::optional<std::ostringstream> context_;
};

inline const Status& AsStatus(const Status& s) { return s; }
template <typename T>
const Status& AsStatus(const StatusOr<T>& s) { return s.status(); }

}  // namespace internal
}  // namespace morph

#define MORPH_STATUS_CONCAT_INNER_(a, b) a##b
#define MORPH_STATUS_CONCAT_(a, b) MORPH_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if `expr` (a Status or StatusOr) is not OK.
// Optional context can be streamed: MORPH_RETURN_IF_ERROR(f()) << "while " << x;
#define MORPH_RETURN_IF_ERROR(expr)                                                   \
  if (::morph::Status _morph_status = ::morph::internal::AsStatus(expr);              \
      _morph_status.ok()) {                                                           \
  } else                                                                              \
    return ::morph::internal::StatusBuilder(std::move(_morph_status))

// MORPH_ASSIGN_OR_RETURN(lhs, rexpr[, context-stream]):
//   evaluates rexpr (a StatusOr<T>); on error returns its status (with context prepended);
//   else assigns the value to lhs, which may be a declaration ("auto x").
#define MORPH_ASSIGN_OR_RETURN(lhs, ...)                                              \
  MORPH_ASSIGN_OR_RETURN_IMPL_(MORPH_STATUS_CONCAT_(_morph_statusor_, __COUNTER__), lhs, \
                               __VA_ARGS__)
#define MORPH_ASSIGN_OR_RETURN_IMPL_(var, lhs, rexpr, ...)                            \
  auto var = (rexpr);                                                                 \
  if (!var.ok()) {                                                                    \
    ::morph::internal::StatusBuilder _morph_builder(std::move(var).status());        \
    __VA_OPT__(_morph_builder << __VA_ARGS__;)                                        \
    return _morph_builder;                                                            \
  }                                                                                   \
  lhs = std::move(var).value()

#endif  // MORPH_STATUS_H_
