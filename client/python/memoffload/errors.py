"""Errors that carry the daemon's status code (no torch needed).

Every error memoffload raises is a :class:`Error` whose ``code`` is a
:class:`StatusCode`: an ``IntEnum`` with gRPC's numbering, so that
``err.code.name`` is the status name (``"RESOURCE_EXHAUSTED"``) and
``int(err.code)`` its number (8). Each code has its own subclass, e.g.
``except memoffload.ResourceExhausted``. :class:`Error` is a ``RuntimeError``
(what the native part used to raise), and :class:`InvalidArgument` is a
``ValueError`` as well.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, Type

__all__ = [
    "StatusCode",
    "Error",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
    "error_from_status",
]


class StatusCode(enum.IntEnum):
    """The status codes of memoffloadd and libmemoffload (numbered like
    gRPC's canonical codes, as ``common/status.h``)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Error(RuntimeError):
    """A memoffload error. ``code``: the :class:`StatusCode`; ``message``: the
    text without the code. ``str(err)`` is ``"CODE: message"``, the code said
    once: ``args`` hold the message alone, so an error that is pickled (DCP
    moves a rank's exception to the others that way) or copied comes back
    as the same class with the same code and text."""

    code: StatusCode = StatusCode.UNKNOWN

    def __init__(self, message: str = "", code: "StatusCode | int | None" = None) -> None:
        if code is not None:
            self.code = StatusCode(int(code))
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.message, int(self.code)), self.__dict__)


class Cancelled(Error):
    code = StatusCode.CANCELLED


class Unknown(Error):
    code = StatusCode.UNKNOWN


class InvalidArgument(Error, ValueError):
    code = StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(Error):
    code = StatusCode.DEADLINE_EXCEEDED


class NotFound(Error):
    code = StatusCode.NOT_FOUND


class AlreadyExists(Error):
    code = StatusCode.ALREADY_EXISTS


class PermissionDenied(Error):
    code = StatusCode.PERMISSION_DENIED


class ResourceExhausted(Error):
    code = StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(Error):
    code = StatusCode.FAILED_PRECONDITION


class Aborted(Error):
    code = StatusCode.ABORTED


class OutOfRange(Error):
    code = StatusCode.OUT_OF_RANGE


class Unimplemented(Error):
    code = StatusCode.UNIMPLEMENTED


class Internal(Error):
    code = StatusCode.INTERNAL


class Unavailable(Error):
    code = StatusCode.UNAVAILABLE


class DataLoss(Error):
    code = StatusCode.DATA_LOSS


class Unauthenticated(Error):
    code = StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[StatusCode, Type[Error]] = {
    cls.code: cls
    for cls in (
        Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
        PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
        Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated,
    )
}


def _rebuild(cls: Type[Error], message: str, code: int) -> Error:
    """Unpickles an :class:`Error` (its ``__reduce__``)."""
    return cls(message, code)


def error_from_status(code: int, message: str) -> Error:
    """The exception for a non-OK status (the native part raises these)."""
    try:
        status = StatusCode(int(code))
    except ValueError:
        return Unknown(f"status code {code}: {message}")
    cls = _BY_CODE.get(status, Error)
    return cls(message, status)
