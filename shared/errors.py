"""Typed errors raised at the edges; one place maps them to gRPC and HTTP status codes.

Core code raises these (never bare Exception for a user-facing failure); the gRPC
interceptor in `shared/grpc_server.py` and the frontend's HTTP app translate them.
"""

from __future__ import annotations

import enum

import grpc


class ErrorKind(enum.IntEnum):
    """Error categories (values match common.proto ErrorKind)."""

    INVALID_ARGUMENT = 1
    RESOURCE_EXHAUSTED = 2
    UNAVAILABLE = 3
    INTERNAL = 4
    NOT_FOUND = 5
    DEADLINE_EXCEEDED = 6


class SpindleError(Exception):
    """Base class: an error a client should see with a specific status."""

    kind: ErrorKind = ErrorKind.INTERNAL
    # HTTP status when it is more specific than the kind's (413 for a body too large).
    http_status: int | None = None
    # Seconds after which a retry may succeed: HTTP `Retry-After`, gRPC `retry-after` trailer.
    retry_after_s: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(SpindleError):
    """The request is malformed or out of range; retrying it unchanged cannot succeed."""

    kind = ErrorKind.INVALID_ARGUMENT


class PayloadTooLargeError(InvalidArgumentError):
    """The HTTP request body is larger than the server accepts (413, not 400)."""

    http_status = 413


class NotFoundError(SpindleError):
    """A named thing (model, request) does not exist."""

    kind = ErrorKind.NOT_FOUND


class ResourceExhaustedError(SpindleError):
    """The server is at capacity; the request may succeed later."""

    kind = ErrorKind.RESOURCE_EXHAUSTED
    retry_after_s = 1  # queues drain within seconds; clients back off further on repeats


class UnavailableError(SpindleError):
    """A service this request needs is not ready or went away."""

    kind = ErrorKind.UNAVAILABLE


class DeadlineExceededError(SpindleError):
    """The request's deadline (gRPC deadline or the frontend's request timeout) passed first."""

    kind = ErrorKind.DEADLINE_EXCEEDED


class InternalError(SpindleError):
    """A bug or an unexpected failure inside spindle."""

    kind = ErrorKind.INTERNAL


_ERROR_CLASSES: dict[ErrorKind, type[SpindleError]] = {
    cls.kind: cls
    for cls in (InvalidArgumentError, NotFoundError, ResourceExhaustedError, UnavailableError, DeadlineExceededError,
                InternalError)
}

GRPC_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

HTTP_STATUSES: dict[ErrorKind, int] = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.INTERNAL: 500,
}


def http_status(error: SpindleError) -> int:
    """The HTTP status of `error`: its own when it has one, else its kind's."""
    return error.http_status or HTTP_STATUSES[error.kind]


def error_from_kind(kind: ErrorKind, message: str) -> SpindleError:
    """Rebuild a typed error that crossed a service boundary as (kind, message)."""
    return _ERROR_CLASSES.get(kind, InternalError)(message)
