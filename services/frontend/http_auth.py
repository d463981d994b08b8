"""API-key authentication for the OpenAI HTTP app: `Authorization: Bearer <key>`, else 401.

Every route needs a key except /health (probes carry none). The accepted key's id (never the
key) is stored on the request for the handlers: `api_key_id(request)`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from shared.api_keys import ApiKeys

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
API_KEY_ID = web.RequestKey("api_key_id", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def api_key_id(request: web.Request) -> str:
    """The id of the key this request authenticated with ("" when keys are off)."""
    return request.get(API_KEY_ID, "")


def api_key_middleware(api_keys: ApiKeys) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware answering 401 (OpenAI-shaped body, `WWW-Authenticate: Bearer`) without a valid key."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        authorization = request.headers.get(hdrs.AUTHORIZATION, "")
        key_id = api_keys.check_authorization(authorization)
        if key_id is None:
            logger.debug("%s %s refused: %s", request.method, request.path,
                         "wrong API key" if authorization else "no Authorization header")
            return _unauthorized("Incorrect API key provided." if authorization else
                                 "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.")
        request[API_KEY_ID] = key_id
        return await handler(request)

    return authenticate


def _unauthorized(message: str) -> web.Response:
    # OpenAI's own 401: type invalid_request_error, code invalid_api_key; clients key off both.
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return web.Response(status=401, body=json.dumps(body).encode(), content_type="application/json",
                        headers={hdrs.WWW_AUTHENTICATE: "Bearer"})
