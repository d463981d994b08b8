"""The heartbeat between services must not get an idle connection closed for "too many pings".

Clients ping every 2 s (shared/grpc_server.py GRPC_OPTIONS) so a hung peer is noticed fast; a
server that does not accept pings that often answers with GOAWAY too_many_pings after a few,
and every idle channel (a frontend with no traffic, a worker between rounds) drops.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.grpc_channel import open_channel
from shared.grpc_server import start_grpc


def test_idle_channel_survives_the_heartbeat() -> None:
    async def scenario() -> list[grpc.ChannelConnectivity]:
        service = await start_grpc("127.0.0.1:0", lambda server: None, [])
        channel = open_channel(service.address, None)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(service=""))
            states = []
            for _ in range(10):  # five pings' worth of idle time
                await asyncio.sleep(1.0)
                states.append(channel.get_state())
            return states
        finally:
            await channel.close()
            await service.server.stop(None)

    states = asyncio.run(scenario())
    assert set(states) == {grpc.ChannelConnectivity.READY}, states
