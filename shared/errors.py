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


class SpindleError(Exception):
    """Base class: an error a client should see with a specific status."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(SpindleError):
    """The request is malformed or out of range; retrying it unchanged cannot succeed."""

    kind = ErrorKind.INVALID_ARGUMENT


class NotFoundError(SpindleError):
    """A named thing (model, request) does not exist."""

    kind = ErrorKind.NOT_FOUND


class ResourceExhaustedError(SpindleError):
    """The server is at capacity; the request may succeed later."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class UnavailableError(SpindleError):
    """A service this request needs is not ready or went away."""

    kind = ErrorKind.UNAVAILABLE


class InternalError(SpindleError):
    """A bug or an unexpected failure inside spindle."""

    kind = ErrorKind.INTERNAL


_ERROR_CLASSES: dict[ErrorKind, type[SpindleError]] = {
    cls.kind: cls
    for cls in (InvalidArgumentError, NotFoundError, ResourceExhaustedError, UnavailableError, InternalError)
}

GRPC_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

HTTP_STATUSES: dict[ErrorKind, int] = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}


def error_from_kind(kind: ErrorKind, message: str) -> SpindleError:
    """Rebuild a typed error that crossed a service boundary as (kind, message)."""
    return _ERROR_CLASSES.get(kind, InternalError)(message)
