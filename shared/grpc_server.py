"""Serving plumbing every spindle service shares: health, reflection, error mapping, shutdown.

`serve_grpc` starts an asyncio gRPC server with `grpc.health.v1` and server reflection, maps
`SpindleError`s to their gRPC status in one interceptor, and stops gracefully on SIGTERM or
SIGINT (in-flight RPCs get `grace_s` to finish).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.errors import GRPC_CODES, InvalidArgumentError, SpindleError

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    # Heartbeat: a peer that stops answering (a hung or unplugged worker) is noticed within
    # about 4 s, not at the TCP timeout; servers accept pings that often.
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),  # the server side of the heartbeat
]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns a `SpindleError` raised by any handler into its gRPC status and message.

    A request whose bytes do not parse (bad UTF-8 in a string, a corrupt message) becomes
    INVALID_ARGUMENT too: gRPC's own answer to a failing deserializer is UNKNOWN, a server error.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


class _Undecodable:
    """What `_tolerant` hands the handler for bytes that are no valid request message."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or whatever a parser raises on garbage
            return _Undecodable(exc)

    return deserialize


def _decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidArgumentError(f"the request message cannot be parsed: {request.error}")
    return request


async def _abort(context: grpc.aio.ServicerContext, exc: SpindleError) -> None:
    trailers = (("retry-after", str(exc.retry_after_s)),) if exc.retry_after_s is not None else ()
    await context.abort(GRPC_CODES[exc.kind], exc.message, trailing_metadata=trailers)


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(_decoded(request), context)
        except SpindleError as exc:
            await _abort(context, exc)

    return wrapper


def _wrap_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in fn(_decoded(request), context):
                yield item
        except SpindleError as exc:
            await _abort(context, exc)

    return wrapper


class GrpcService:
    """A running gRPC server with its health servicer, so readiness can be flipped later."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, address: str):
        self.server = server
        self.health = health_servicer
        self.address = address

    async def set_serving(self, service_names: Iterable[str]) -> None:
        """Mark the server (and the named services) SERVING: called once the service is ready."""
        for name in ("", *service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)


async def start_grpc(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int | None = None,
) -> GrpcService:
    """Start a server on `address`; the named services stay NOT_SERVING until `set_serving`.

    Health has two meanings, as Kubernetes probes use them: the server-wide name "" is
    liveness (SERVING while the process serves at all, so a frontend that lost its scheduler is
    not restarted for it); each named service is readiness (SERVING only while it can do work).

    `credentials` (see shared/tls.py) serve TLS instead of plaintext; `interceptors` run
    before the error mapping (an authentication check rejects a call before any handler).
    `max_receive_bytes` bounds one request message (a public port's clients are untrusted);
    gRPC itself refuses a larger one with RESOURCE_EXHAUSTED before it is parsed.
    """
    options = dict(GRPC_OPTIONS)  # (gRPC takes the first of two equal keys, so replace, never append)
    if max_receive_bytes is not None:
        options["grpc.max_receive_message_length"] = max_receive_bytes
    # gRPC binds with SO_REUSEPORT by default: a second server on a taken port then starts
    # without error and the kernel splits connections between the two. A benchmark run saw its
    # frontend's gRPC port chosen again for the scheduler: the frontend's calls to "the
    # scheduler" reached the frontend itself (UNIMPLEMENTED) until the health wait gave up.
    options["grpc.so_reuseport"] = 0
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()], options=list(options.items()))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    host = address.rsplit(":", 1)[0]
    return GrpcService(server, health_servicer, f"{host}:{port}")


async def wait_for_shutdown(service: GrpcService, grace_s: float = 5.0,
                            on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Block until SIGTERM/SIGINT or server termination, then stop gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    terminated = asyncio.ensure_future(service.server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({terminated, stopper}, return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down %s", service.address)
    await service.health.enter_graceful_shutdown()
    if on_stop is not None:
        await on_stop()
    # grace: in-flight RPCs get this long to finish before they are cancelled.
    await service.server.stop(grace_s)
    terminated.cancel()
    stopper.cancel()
