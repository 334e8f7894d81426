"""morph's Status codes as exception classes (include/morph/status.h says what each code asks the
caller to do). Every error libmorph returns reaches Python as one of these, raised by the binding
through `_from_status`."""
from __future__ import annotations

from typing import Optional, Sequence


class MorphError(RuntimeError):
    """A non-OK morph Status.

    Attributes:
      code: the numeric StatusCode (morph/status.h).
      code_name: "ABORTED", "UNAVAILABLE", ...
      message: the message with its context prefixes.
      failed_peers: ranks (numbered in `group`) a failed collective saw fail; empty when unknown.
      failure_kind: "peer_closed", "timeout", "remote_error", "aborted", or None.
      group: the communicator that failed ("world", "dp/p0t1", ...), or None.
    """

    code: int = 2
    code_name: str = "UNKNOWN"

    def __init__(self, message: str, failed_peers: Sequence[int] = (),
                 failure_kind: Optional[str] = None, group: Optional[str] = None) -> None:
        super().__init__(f"{self.code_name}: {message}")
        self.message = message
        self.failed_peers = tuple(failed_peers)
        self.failure_kind = failure_kind
        self.group = group


def _make(name: str, code: int, code_name: str, *bases: type, doc: str) -> type:
    return type(name, (MorphError, *bases), {"code": code, "code_name": code_name, "__doc__": doc,
                                             "__module__": "morph"})


CancelledError = _make("CancelledError", 1, "CANCELLED", doc="The operation was cancelled.")
UnknownError = _make("UnknownError", 2, "UNKNOWN", doc="An error without a better code.")
InvalidArgumentError = _make("InvalidArgumentError", 3, "INVALID_ARGUMENT", ValueError,
                             doc="The caller's input is wrong: fix the call; retrying will not help.")
DeadlineExceededError = _make("DeadlineExceededError", 4, "DEADLINE_EXCEEDED",
                              doc="The call's timeout passed.")
NotFoundError = _make("NotFoundError", 5, "NOT_FOUND", LookupError,
                      doc="No such tensor, scalar or file.")
AlreadyExistsError = _make("AlreadyExistsError", 6, "ALREADY_EXISTS", doc="It exists already.")
PermissionDeniedError = _make("PermissionDeniedError", 7, "PERMISSION_DENIED",
                              doc="Not allowed (a file's mode, a token for reads).")
ResourceExhaustedError = _make("ResourceExhaustedError", 8, "RESOURCE_EXHAUSTED",
                               doc="Out of memory or another limit.")
FailedPreconditionError = _make("FailedPreconditionError", 9, "FAILED_PRECONDITION",
                                doc="The object is not in a state that allows the call.")
AbortedError = _make("AbortedError", 10, "ABORTED",
                     doc="Membership changed under the call: end the step (abort_step); the "
                         "next step applies the recovery.")
OutOfRangeError = _make("OutOfRangeError", 11, "OUT_OF_RANGE", doc="A value out of range.")
UnimplementedError = _make("UnimplementedError", 12, "UNIMPLEMENTED", NotImplementedError,
                           doc="Not supported by this build or backend.")
InternalError = _make("InternalError", 13, "INTERNAL", doc="A broken invariant inside morph: a bug.")
UnavailableError = _make("UnavailableError", 14, "UNAVAILABLE",
                         doc="A peer or the coordinator is not reachable: a collective's peer "
                             "failed (end the step) or the job is gone.")
DataLossError = _make("DataLossError", 15, "DATA_LOSS",
                      doc="A piece of the state has no copy left anywhere.")
UnauthenticatedError = _make("UnauthenticatedError", 16, "UNAUTHENTICATED", doc="A wrong token.")

_BY_CODE = {c.code: c for c in (
    CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError, NotFoundError,
    AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError, FailedPreconditionError,
    AbortedError, OutOfRangeError, UnimplementedError, InternalError, UnavailableError,
    DataLossError, UnauthenticatedError)}

__all__ = ["MorphError"] + sorted(c.__name__ for c in _BY_CODE.values())


def _from_status(code: int, message: str, peers: Sequence[int], kind: Optional[str],
                 group: Optional[str]) -> MorphError:
    """The exception for a Status (called by the binding)."""
    cls = _BY_CODE.get(code, UnknownError)
    return cls(message, peers, kind, group)


def error_code(exc: BaseException) -> int:
    """The StatusCode to report for an exception that ended a step (abort_step)."""
    if isinstance(exc, MorphError):
        return exc.code
    return UnavailableError.code
