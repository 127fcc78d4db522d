"""Exceptions: every failure of the library is an Error carrying the gRPC
status code of the failure."""

from typing import Dict, Optional, Type

CODE_NAMES: Dict[int, str] = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND", 6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
    10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL",
    14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}
CODES: Dict[str, int] = {name: code for code, name in CODE_NAMES.items()}


class Error(Exception):
    """A tensorrpc failure. code is the gRPC status code (an int; code_name
    spells it), message what went wrong (the gRPC status message), details
    more about it or None: for a failed call, the traceback of the remote
    handler's exception (str(err) shows it too)."""

    code: int = 2

    def __init__(self, message: str, code: Optional[int] = None, details: Optional[str] = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.details = details
        text = "[%s] %s" % (self.code_name, message)
        if details:
            text += "\n\nDetails from the server:\n" + details.rstrip("\n")
        super().__init__(text)

    @property
    def code_name(self) -> str:
        return CODE_NAMES.get(self.code, "CODE_%d" % self.code)


class InvalidArgumentError(Error, ValueError):
    """A bad argument: wrong dtype, non-contiguous or non-CPU tensor,
    malformed shape. Also a ValueError."""
    code = 3


class DeadlineExceededError(Error, TimeoutError):
    """The call's timeout expired. Also a TimeoutError."""
    code = 4


class NotFoundError(Error, LookupError):
    code = 5


class PermissionDeniedError(Error, PermissionError):
    """The peer refused the operation: rows written to a tensor not
    published writable (Server.publish(..., writable=True)). Also a
    PermissionError."""
    code = 7


class ResourceExhaustedError(Error, MemoryError):
    """The pool is full or the tensor is over the size limit."""
    code = 8


class FailedPreconditionError(Error):
    """The object is closed."""
    code = 9


class UnimplementedError(Error, NotImplementedError):
    """No handler for the method."""
    code = 12


class UnavailableError(Error, ConnectionError):
    """The peer or the data plane is gone."""
    code = 14


_BY_CODE: Dict[int, Type[Error]] = {c.code: c for c in (
    InvalidArgumentError, DeadlineExceededError, NotFoundError, PermissionDeniedError, ResourceExhaustedError,
    FailedPreconditionError, UnimplementedError, UnavailableError)}


def error(code: int, message: str, details: Optional[str] = None) -> Error:
    """Returns the exception for a status code."""
    # The C ABI's advice, in Python's terms.
    message = message.replace("fetch with the flag TRPC_FETCH_WAIT", "fetch with wait=True")
    cls = _BY_CODE.get(code)
    if cls is None:
        return Error(message, code, details)
    return cls(message, details=details)
