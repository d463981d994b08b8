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

from shared.errors import GRPC_CODES, SpindleError

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns a `SpindleError` raised by any handler into its gRPC status and message."""

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
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except SpindleError as exc:
            await context.abort(GRPC_CODES[exc.kind], exc.message)

    return wrapper


def _wrap_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in fn(request, context):
                yield item
        except SpindleError as exc:
            await context.abort(GRPC_CODES[exc.kind], exc.message)

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
) -> GrpcService:
    """Start a server on `address`; health stays NOT_SERVING until `set_serving` is called.

    `credentials` (see shared/tls.py) serve TLS instead of plaintext; `interceptors` run
    before the error mapping (an authentication check rejects a call before any handler).
    """
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()], options=GRPC_OPTIONS)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in ("", *names):
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
