"""OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health,
and vLLM's /tokenize and /detokenize.

Thin like the gRPC servicer: parse (openai_protocol), one EngineClient call, format
(openai_format). Typed errors become OpenAI-shaped error bodies with the mapped status.
Streams are server-sent events ending with `data: [DONE]`. The server cancels a handler whose
client disconnected, which aborts the request in the scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from services.frontend import openai_pooling, openai_tokenize
from services.frontend.engine_client import EngineClient
from services.frontend.http_auth import api_key_id, api_key_middleware
from services.frontend.messages import GenerateChunk, GenerateComplete, GenerateEvent
from services.frontend.openai_format import (
    ChatFormatter,
    Choice,
    CompletionFormatter,
    ResponseFormatter,
    dumps_json,
    error_body,
)
from services.frontend.openai_protocol import Endpoint, OpenAIRequest, parse_chat, parse_completion, read_json
from services.frontend.pooling import PoolingClient
from services.frontend.tool_parsers import format_for_template
from shared.api_keys import ApiKeys
from shared.errors import SpindleError, http_status

logger = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", EngineClient)
REQUEST_ID_HEADER = "X-Request-Id"

# Per endpoint: the response id prefix and the formatter class.
FORMATTERS: dict[Endpoint, tuple[str, type[ResponseFormatter]]] = {
    Endpoint.COMPLETIONS: ("cmpl-", CompletionFormatter),
    Endpoint.CHAT: ("chatcmpl-", ChatFormatter),
}


def error_response(error: SpindleError) -> web.Response:
    status = http_status(error)
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return web.Response(body=dumps_json(error_body(error, status)), status=status, content_type="application/json",
                        headers=headers)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except SpindleError as exc:
        logger.debug("%s %s failed: %s", request.method, request.path, exc.message)
        return error_response(exc)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion(await read_json(request)))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat(await read_json(request)))


async def _generate(http_request: web.Request, parsed: OpenAIRequest) -> web.StreamResponse:
    engine = http_request.app[ENGINE]
    parsed.input.request_id = http_request.headers.get(REQUEST_ID_HEADER, "")
    parsed.input.traceparent = http_request.headers.get("traceparent", "")
    parsed.input.api_key_id = api_key_id(http_request)
    prepared = await engine.prepare(parsed.input)
    prefix, formatter_class = FORMATTERS[parsed.endpoint]
    formatter = formatter_class(prefix + prepared.request_id, engine.model_name, engine.tokenizer.token_text,
                                parsed.stream and parsed.include_usage, engine.system_fingerprint,
                                parsed.stream and parsed.continuous_usage, len(prepared.add.prompt_token_ids))
    tools = parsed.input.tools
    if isinstance(formatter, ChatFormatter) and tools is not None and tools.is_active:
        formatter.read_tool_calls(tools, format_for_template(engine.tokenizer.chat_template))
    async with contextlib.aclosing(engine.run(prepared)) as events:
        if parsed.stream:
            return await _stream(http_request, formatter, events, parsed.include_usage, prepared.n)
        return await _collect(formatter, events, prepared.n)


async def _collect(formatter: ResponseFormatter, events: AsyncIterator[GenerateEvent], n: int) -> web.Response:
    choices = [Choice(i) for i in range(n)]
    async for event in events:
        choice = choices[event.index]
        if isinstance(event, GenerateComplete):
            choice.complete = event
            if event.total_usage is not None:  # the last choice to finish
                body = formatter.response(choices, event.total_usage)
                return web.Response(body=dumps_json(body), content_type="application/json")
            continue
        choice.texts.append(event.text)
        if event.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + event.logprobs
    raise AssertionError("a generation ended without its last GenerateComplete")


async def _stream(http_request: web.Request, formatter: ResponseFormatter, events: AsyncIterator[GenerateEvent],
                  include_usage: bool, n: int) -> web.StreamResponse:
    # Wait for the first event before answering 200, so a request the scheduler rejects at
    # once still gets its proper status code.
    event = await anext(events)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http_request)
    try:
        await _stream_events(response, formatter, events, event, include_usage, n)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client hung up mid-stream: routine; the caller's aclosing() aborts it
        logger.debug("%s %s: client disconnected mid-stream", http_request.method, http_request.path)
    return response


async def _stream_events(response: web.StreamResponse, formatter: ResponseFormatter,
                         events: AsyncIterator[GenerateEvent], event: GenerateEvent, include_usage: bool,
                         n: int) -> None:
    try:
        for start in formatter.start_chunks(n):
            await _send(response, start)
        while True:
            if isinstance(event, GenerateChunk):
                await _send_json(response, formatter.chunk_json(event))
            else:
                await _send(response, formatter.end_chunk(event))
                if event.total_usage is not None:  # the last choice to finish
                    if include_usage:
                        await _send(response, formatter.usage_chunk(event.total_usage))
                    return
            event = await anext(events)
    except SpindleError as exc:  # after the 200: report it in the stream, as OpenAI does
        await _send(response, error_body(exc, http_status(exc)))


async def _send(response: web.StreamResponse, body: object) -> None:
    await _send_json(response, dumps_json(body))


async def _send_json(response: web.StreamResponse, body: bytes) -> None:
    await response.write(b"data: " + body + b"\n\n")


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    cards = await engine.list_models()
    data = [{"id": c.id, "object": "model", "created": 0, "owned_by": "spindle", "max_model_len": c.max_model_len}
            for c in cards]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """200 once the scheduler is connected and ready, 503 before (and while reconnecting)."""
    scheduler = request.app[ENGINE].scheduler
    if not scheduler.accepting:
        return web.Response(status=503, text="shutting down")
    if scheduler.is_ready:
        return web.Response(text="ok")
    return web.Response(status=503, text="waiting for the scheduler")


def build_app(engine: EngineClient, pooling: PoolingClient, api_keys: ApiKeys | None = None) -> web.Application:
    """The app; with `api_keys` enabled, every route but /health needs a key (checked before anything else)."""
    middlewares = [error_middleware]
    if api_keys is not None and api_keys.is_enabled:
        middlewares.insert(0, api_key_middleware(api_keys))
    app = web.Application(middlewares=middlewares, client_max_size=engine.config.limits.max_body_bytes)
    app[ENGINE] = engine
    openai_pooling.add_routes(app, pooling)
    openai_tokenize.add_routes(app, engine)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    return app


async def start_http(app: web.Application, host: str, port: int,
                     ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, str]:
    """Serve `app` on host:port (0: a free port), over TLS with `ssl_context`; returns the runner and the address."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port  # the real port when port was 0
    return runner, f"{host}:{bound}"
