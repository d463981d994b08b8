"""A gRPC server must refuse a port another server listens on, not share it (SO_REUSEPORT)."""

from __future__ import annotations

import asyncio

import pytest

from shared.grpc_server import start_grpc


def test_second_server_on_a_taken_port_fails_to_start() -> None:
    async def scenario() -> None:
        first = await start_grpc("127.0.0.1:0", lambda server: None, [])
        try:
            with pytest.raises((OSError, RuntimeError)):
                second = await start_grpc(first.address, lambda server: None, [])
                await second.server.stop(None)  # only reached if the bind wrongly succeeded
        finally:
            await first.server.stop(None)

    asyncio.run(scenario())
