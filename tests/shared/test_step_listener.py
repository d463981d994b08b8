"""A step socket's local Unix socket beside its TCP port: offered, dialed first, and left for the port where
it cannot be reached."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from shared.step_dial import StepSocketUnreachableError, dial, open_local
from shared.step_frames import REQUEST, STEP, FrameReader, end_frame, frame
from shared.step_listener import DISABLE_LOCAL_ENV, LOCAL_NAME_PREFIX, StepListener, local_sockets_supported, peer_name

pytestmark = pytest.mark.skipif(not local_sockets_supported(), reason="abstract Unix sockets are Linux's")


class EchoListener(StepListener):
    """Answers each REQUEST frame with a STEP frame of the same payload, then ends OK; records its peers."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: list[str] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peers.append(peer_name(writer))
        frames = FrameReader(reader)
        while (item := await frames.read()) is not None:
            kind, payload = item
            assert kind == REQUEST
            writer.write(frame(STEP, payload))
        writer.write(end_frame(grpc.StatusCode.OK))
        writer.close()


@pytest.fixture
async def listener() -> AsyncIterator[tuple[EchoListener, int]]:
    server = EchoListener()
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        server.close()


async def echo(port: int, local_name: str, items: list[bytes]) -> list[bytes]:
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
    for item in [*items, None]:
        outbox.put_nowait(item)
    received: list[bytes] = []
    async with asyncio.timeout(10):
        ended = await dial("127.0.0.1", port, outbox, lambda item: item, received.append, "echo", local_name=local_name)
    assert ended.closed
    return received


async def test_a_listener_offers_a_local_socket_that_a_dialer_takes_first(
    listener: tuple[EchoListener, int], caplog: pytest.LogCaptureFixture
) -> None:
    server, port = listener
    assert server.local_name.startswith(LOCAL_NAME_PREFIX)
    with caplog.at_level(logging.INFO, logger="shared.step_dial"):
        assert await echo(port, server.local_name, [b"a", b"bc"]) == [b"a", b"bc"]
    assert server.peers == ["a local process"]
    assert f"runs on its local socket @{server.local_name}" in caplog.text


async def test_without_a_local_name_the_port_serves_the_same_stream(listener: tuple[EchoListener, int]) -> None:
    server, port = listener
    assert await echo(port, "", [b"x"]) == [b"x"]
    assert server.peers[0].startswith("127.0.0.1:")


async def test_a_local_name_out_of_reach_falls_back_to_the_port(
    listener: tuple[EchoListener, int], caplog: pytest.LogCaptureFixture
) -> None:
    """As from another network namespace (another pod), where the name does not exist."""
    server, port = listener
    with caplog.at_level(logging.INFO, logger="shared.step_dial"):
        assert await echo(port, LOCAL_NAME_PREFIX + "elsewhere", [b"y"]) == [b"y"]
    assert server.peers[0].startswith("127.0.0.1:")
    assert "not reachable from here" in caplog.text


async def test_neither_reachable_raises_so_the_client_can_fall_back_to_grpc(listener: tuple[EchoListener, int]) -> None:
    server, port = listener
    server.close()
    await asyncio.sleep(0)
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
    outbox.put_nowait(b"z")
    with pytest.raises(StepSocketUnreachableError):
        await dial("127.0.0.1", port, outbox, lambda item: item, lambda payload: None, "echo",
                   local_name=server.local_name)
    assert outbox.qsize() == 1  # nothing was taken


async def test_closing_the_listener_closes_its_local_socket(listener: tuple[EchoListener, int]) -> None:
    server, _ = listener
    reader, writer = await open_local(server.local_name)
    writer.close()
    server.close()
    await asyncio.sleep(0)
    with pytest.raises(ConnectionRefusedError):
        await open_local(server.local_name)


async def test_each_listener_gets_a_name_of_its_own() -> None:
    first, second = EchoListener(), EchoListener()
    try:
        await first.start("127.0.0.1", 0)
        await second.start("127.0.0.1", 0)
        assert first.local_name != second.local_name
    finally:
        first.close()
        second.close()


async def test_the_switch_offers_only_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_LOCAL_ENV, "1")
    server = EchoListener()
    try:
        port = await server.start("127.0.0.1", 0)
        assert server.local_name == ""
        assert await echo(port, server.local_name, [b"w"]) == [b"w"]
    finally:
        server.close()


def test_the_same_on_uvloop_as_the_services_run() -> None:
    """uvloop refuses an abstract path given by name; the listener and the dialer hand it bound sockets."""
    import uvloop

    async def scenario() -> tuple[list[bytes], list[str]]:
        server = EchoListener()
        port = await server.start("127.0.0.1", 0)
        try:
            return await echo(port, server.local_name, [b"u", b"v"]), server.peers
        finally:
            server.close()

    assert uvloop.run(scenario()) == ([b"u", b"v"], ["a local process"])
