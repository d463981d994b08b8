"""API-key authentication for gRPC: `authorization: Bearer <key>` metadata, else UNAUTHENTICATED.

Every service on the server is guarded except health and reflection, so Kubernetes probes and
grpcurl's discovery work without a key. The accepted key's id (never the key) is visible to
the handler through `current_api_key_id()`.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from shared.api_keys import ApiKeys

logger = logging.getLogger(__name__)

OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})

# NOTE: grpc.aio runs each RPC in its own task, and a task works on a copy of the context, so
# the value set for one call is seen by that call's handler only.
_API_KEY_ID: contextvars.ContextVar[str] = contextvars.ContextVar("api_key_id", default="")


def current_api_key_id() -> str:
    """The id of the key the current call authenticated with ("" when keys are off)."""
    return _API_KEY_ID.get()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks the caller's key before a guarded method's handler runs."""

    def __init__(self, api_keys: ApiKeys) -> None:
        self._api_keys = api_keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        return _guarded(handler, self._authenticate)

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        authorization = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = str(value)
        key_id = self._api_keys.check_authorization(authorization)
        if key_id is None:
            logger.debug("refused a call without a valid API key (%s)",
                         "wrong key" if authorization else "no authorization metadata")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "a valid API key is required: send metadata 'authorization: Bearer <key>'")
        _API_KEY_ID.set(key_id or "")


Authenticate = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


def _guarded(handler: grpc.RpcMethodHandler, authenticate: Authenticate) -> grpc.RpcMethodHandler:
    """The same handler (serializers included) with `authenticate` run first, for any of the four call kinds."""
    if handler.unary_unary or handler.stream_unary:
        kind = "unary_unary" if handler.unary_unary else "stream_unary"
        respond = getattr(handler, kind)

        async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await authenticate(context)
            return await respond(request, context)

        return handler._replace(**{kind: unary_response})  # type: ignore[attr-defined]
    kind = "unary_stream" if handler.unary_stream else "stream_stream"
    stream = getattr(handler, kind)

    async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await authenticate(context)
        async for item in stream(request, context):
            yield item

    return handler._replace(**{kind: stream_response})  # type: ignore[attr-defined]
