"""Serve a small aiohttp app on a free loopback port for the load-client tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """Run `app` until the block ends; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # aiohttp has no public getter
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
