"""The scheduler's step socket on loopback: a frontend's Connect stream without gRPC.

Against a real scheduler service in front of fake workers: what the socket streams, how a
stream ends (a frontend that leaves, sends garbage or goes silent has its requests aborted),
and the frontend's own client on it, including a broken connection it resumes from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from services.frontend.messages import AddRequest
from services.frontend.scheduler_client import SchedulerClient
from services.scheduler import wire
from services.scheduler.updates import RequestUpdate
from shared.pb.spindle.v1 import scheduler_pb2
from shared.ports import free_port
from shared.sampling import SamplingOptions
from shared.step_dial import dial
from shared.step_frames import END, REQUEST, STEP, frame, parse_end, read_frame
from shared.types import StopReason
from tests.scheduler.fake_worker import reference_output
from tests.scheduler.scheduler_stack import EOS_PERIOD, Stack, make_request, running_stack, until, wait_ready


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack() as running:
        yield running


def _expected(prompt: list[int], max_tokens: int) -> list[int]:
    return reference_output(prompt, SamplingOptions(temperature=0.0, max_tokens=max_tokens), 128, 64, EOS_PERIOD)


def _add_frame(*requests: tuple[str, list[int], int]) -> bytes:
    message = wire.add_requests_to_proto([make_request(*request) for request in requests])
    return frame(REQUEST, message.SerializeToString())


async def _open(stack: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    await wait_ready(stack.stub)
    return await asyncio.open_connection("127.0.0.1", stack.step_port)


async def _next_step(reader: asyncio.StreamReader) -> scheduler_pb2.ConnectResponse:
    while (item := await read_frame(reader)) is not None:
        if item[0] == STEP:
            return scheduler_pb2.ConnectResponse.FromString(item[1])
    raise AssertionError("the stream ended before a step")


async def _all_released(stack: Stack) -> None:
    scheduler = stack.engine.scheduler
    assert scheduler is not None
    await until(lambda: not scheduler.requests)
    await until(lambda: all(ws.kv is not None and ws.kv.num_free_blocks == ws.kv.num_blocks
                            for ws in scheduler.workers))


async def test_info_announces_the_step_socket(stack: Stack) -> None:
    info = await wait_ready(stack.stub)
    assert info.step_port == stack.step_port > 0


async def test_the_socket_streams_what_connect_would_and_a_closed_connection_ends_it(stack: Stack) -> None:
    await wait_ready(stack.stub)
    prompts = {"a": [5, 6, 7], "b": [10, 11]}
    max_tokens = {"a": 12, "b": 20}
    outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None] = asyncio.Queue()
    outbox.put_nowait(wire.add_requests_to_proto([make_request(r, p, max_tokens[r]) for r, p in prompts.items()]))
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    finals: dict[str, RequestUpdate] = {}

    def on_payload(payload: bytes) -> None:
        for update in map(wire.update_from_proto, scheduler_pb2.ConnectResponse.FromString(payload).step.updates):
            assert update.request_id not in finals, "update after the final one"
            tokens[update.request_id].extend(update.token_ids)
            if update.is_final:
                finals[update.request_id] = update
        if len(finals) == len(prompts):
            outbox.put_nowait(None)  # done: the connection ends from this side

    async with asyncio.timeout(10):
        ended = await dial("127.0.0.1", stack.step_port, outbox, lambda m: m.SerializeToString(), on_payload,
                           "scheduler")
    for request_id, prompt in prompts.items():
        assert finals[request_id].stop_reason == StopReason.LENGTH
        assert tokens[request_id] == _expected(prompt, max_tokens[request_id])
    # No half-close on the socket: the frontend left, which the scheduler tells it ended the stream.
    assert (ended.code, ended.why) == (grpc.StatusCode.UNAVAILABLE,
                                       "reading the stream failed: the frontend closed its connection")
    assert stack.engine.scheduler is not None and stack.engine.scheduler.stats().num_aborted == 0


async def test_a_frontend_that_closes_its_connection_has_its_requests_aborted(stack: Stack) -> None:
    reader, writer = await _open(stack)
    writer.write(_add_frame(("x", [5, 6], 100), ("y", [7], 100)))
    assert (await _next_step(reader)).step.updates
    writer.close()
    await _all_released(stack)
    assert stack.engine.scheduler is not None and stack.engine.scheduler.stats().num_aborted == 2


async def test_an_unreadable_frame_ends_the_stream_with_unavailable_and_aborts_its_requests(
        stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    reader, writer = await _open(stack)
    writer.write(_add_frame(("x", [5, 6], 100)))
    assert (await _next_step(reader)).step.updates
    writer.write(frame(9, b""))
    async with asyncio.timeout(10):
        while (item := await read_frame(reader)) is not None and item[0] != END:
            pass
    assert item is not None
    assert parse_end(item[1]) == (grpc.StatusCode.UNAVAILABLE,
                                  "reading the stream failed: unreadable frame: frame kind 9 where a request (1) "
                                  "was expected")
    writer.close()
    await _all_released(stack)
    assert stack.engine.scheduler is not None and stack.engine.scheduler.stats().num_aborted == 1
    assert "unreadable frame" in caplog.text  # logged as the warning it is


async def test_a_silent_frontend_is_given_up_and_its_requests_aborted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with running_stack(step_delay_s=0.05, heartbeat_s=0.05, silence_timeout_s=0.3) as stack:
        reader, writer = await _open(stack)
        writer.write(_add_frame(("x", [5, 6], 100)))  # ~5 s of steps; then not even a heartbeat
        assert (await _next_step(reader)).step.updates
        await _all_released(stack)
        assert stack.engine.scheduler is not None and stack.engine.scheduler.stats().num_aborted == 1
        writer.close()
    assert "nothing came from the peer" in caplog.text


class _Relay:
    """A TCP relay to the scheduler's step socket that the test can cut, and that counts its connections."""

    def __init__(self, target_port: int, bad_steps: tuple[bytes, ...] = ()) -> None:
        self._target_port = target_port
        self._bad_steps = bad_steps  # the first connections each get one of these as a step, then end
        self._writers: list[asyncio.StreamWriter] = []
        self.num_connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        if self.num_connections <= len(self._bad_steps):
            writer.write(frame(STEP, self._bad_steps[self.num_connections - 1]))
            await reader.read(1 << 16)  # the client's first requests, or its end
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    def close(self) -> None:
        assert self._server is not None
        self._server.close()


@contextlib.asynccontextmanager
async def _ready_client(address: str) -> AsyncIterator[SchedulerClient]:
    """The frontend's SchedulerClient for the scheduler at `address`, started and ready, closed after."""
    client = SchedulerClient(address, backoff_initial_s=0.01)
    client.start()
    try:
        await client.wait_ready(10)
        yield client
    finally:
        await client.close()


async def _generate(client: SchedulerClient, request_id: str, prompt: list[int], max_tokens: int,
                    after_first: asyncio.Event | None = None) -> list[int]:
    add = AddRequest(request_id, prompt, SamplingOptions(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    async with client.submit(add) as stream:
        async for batch in stream:
            for update in batch:
                assert update.error is None, update.error
                tokens.extend(update.token_ids)
            if after_first is not None:
                after_first.set()
    return tokens


async def test_the_frontends_client_streams_on_the_socket_and_resumes_a_cut_connection_exactly() -> None:
    async with running_stack(step_delay_s=0.01) as stack:
        relay = _Relay(stack.step_port)
        stack.servicer.step_port = await relay.start()  # the scheduler announces the relay
        stack.servicer.step_local_socket = ""  # (the scheduler's own would answer)
        client = SchedulerClient(stack.service.address, backoff_initial_s=0.01)
        client.start()
        try:
            await client.wait_ready(10)
            started = asyncio.Event()
            cut_one = asyncio.create_task(_generate(client, "cut", [5, 6, 7], 60, started))
            whole = await _generate(client, "whole", [9, 10], 8)
            assert whole == _expected([9, 10], 8)
            await started.wait()
            relay.cut()  # mid-stream: the client reconnects and re-submits what it has not finished
            async with asyncio.timeout(20):
                cut = await cut_one
            assert cut == _expected([5, 6, 7], 60)  # every token once, in order
            assert relay.num_connections == 2
        finally:
            await client.close()
            relay.close()


async def test_the_frontends_client_falls_back_to_grpc_where_the_socket_cannot_be_reached(
        caplog: pytest.LogCaptureFixture) -> None:
    async with running_stack() as stack:
        stack.servicer.step_port = free_port()  # announced, but nothing listens there
        stack.servicer.step_local_socket = ""  # (the scheduler's own would answer)
        client = SchedulerClient(stack.service.address, backoff_initial_s=0.01)
        client.start()
        try:
            await client.wait_ready(10)
            assert await _generate(client, "r", [5, 6], 10) == _expected([5, 6], 10)
        finally:
            await client.close()
    assert "unreachable" in caplog.text and "this stream goes over gRPC" in caplog.text


async def test_the_frontends_client_goes_over_grpc_where_the_socket_takes_connections_and_drops_them(
        caplog: pytest.LogCaptureFixture) -> None:
    """A port that accepts and drops (a mesh proxy that cannot route it) must not keep the client
    reconnecting forever: after three streams that never heard the scheduler, gRPC carries them."""
    caplog.set_level(logging.INFO, "services.frontend.scheduler_client")
    connections: list[int] = []

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    async with running_stack() as stack:
        dropper = await asyncio.start_server(drop, "127.0.0.1", 0)
        stack.servicer.step_port = dropper.sockets[0].getsockname()[1]
        stack.servicer.step_local_socket = ""  # (the scheduler's own would answer)
        try:
            async with _ready_client(stack.service.address) as client, asyncio.timeout(20):
                assert await _generate(client, "r", [5, 6], 10) == _expected([5, 6], 10)
            assert len(connections) == 3
        finally:
            dropper.close()
    assert "the scheduler's step socket ended 3 streams in a row without a frame" in caplog.text
    assert "requests stream over gRPC" in caplog.text


async def test_the_frontends_client_reconnects_after_a_step_message_it_cannot_handle(
        caplog: pytest.LogCaptureFixture) -> None:
    unknown_stop = scheduler_pb2.ConnectResponse(step=scheduler_pb2.StepUpdates(updates=[
        scheduler_pb2.RequestUpdate(request_id="r", token_ids=[7], stop_reason=99)]))  # no such StopReason
    async with running_stack() as stack:
        relay = _Relay(stack.step_port, bad_steps=(b"\xff\xff\xff", unknown_stop.SerializeToString()))
        stack.servicer.step_port = await relay.start()
        stack.servicer.step_local_socket = ""  # (the scheduler's own would answer)
        try:
            async with _ready_client(stack.service.address) as client, asyncio.timeout(20):
                assert await _generate(client, "r", [5, 6], 10) == _expected([5, 6], 10)
            assert relay.num_connections == 3
        finally:
            relay.close()
    assert "DecodeError" in caplog.text and "ValueError" in caplog.text


async def test_a_draining_scheduler_reports_not_ready_so_frontends_wait_for_the_next(stack: Stack) -> None:
    assert (await wait_ready(stack.stub)).ready
    await stack.engine.drain(0)
    info = await stack.stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
    assert not info.ready
