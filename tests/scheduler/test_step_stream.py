"""The scheduler's end of a step socket, against fake workers: hosts it will use, and why streams end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest

from services.scheduler.step_stream import STREAM_CLOSED, Outgoing, stream_steps
from shared.execute import ExecuteRound, StepOutput
from shared.pb.spindle.v1 import worker_pb2
from shared.ports import free_port
from shared.step_dial import StepSocketFallback, StepSocketUnreachableError, step_socket_host
from shared.step_frames import HEARTBEAT, REQUEST, STEP, end_frame, frame, read_frame


@pytest.mark.parametrize(("address", "host"), [
    ("127.0.0.1:50061", "127.0.0.1"),
    ("worker-0.spindle-worker:50061", "worker-0.spindle-worker"),
    ("[::1]:50061", "::1"),
    ("dns:///worker:50061", None),  # a gRPC resolver target: left to gRPC
    ("unix:/tmp/worker.sock", None),
    ("worker", None),
])
def test_only_plain_host_port_targets_get_a_step_socket(address: str, host: str | None) -> None:
    assert step_socket_host(address) == host


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def run_against(handler: Handler, rounds: int = 1) -> tuple[list[StepOutput], str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
    for i in range(rounds):
        outbox.put_nowait(ExecuteRound(round_id=i))
    outbox.put_nowait(None)
    steps: list[StepOutput] = []
    try:
        async with asyncio.timeout(10):
            return steps, await stream_steps("127.0.0.1", port, outbox, steps.append)
    finally:
        server.close()


def echo_worker(end: bytes | None) -> Handler:
    """Answers each round with one step, then (at the scheduler's end of stream) `end`, then closes."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (item := await read_frame(reader)) is not None:
            kind, payload = item
            assert kind == REQUEST
            round_id = worker_pb2.ExecuteRequest.FromString(payload).round_id
            writer.write(frame(STEP, worker_pb2.ExecuteResponse(round_id=round_id, is_last_step=True)
                               .SerializeToString()))
        if end is not None:
            writer.write(end)
        writer.close()
    return handle


async def test_steps_arrive_in_order_and_an_ok_end_closes_the_stream() -> None:
    steps, why = await run_against(echo_worker(end_frame(grpc.StatusCode.OK)), rounds=3)
    assert ([s.round_id for s in steps], why) == ([0, 1, 2], STREAM_CLOSED)


@pytest.mark.parametrize(("end", "why"), [
    (end_frame(grpc.StatusCode.INTERNAL, "round 0 failed: boom"),
     "Execute stream broke (INTERNAL: round 0 failed: boom)"),
    (None, "the worker closed its step socket without ending the stream"),
    (frame(9, b""), "step socket broke (FrameError: frame kind 9 where a step (2) or the end (3) was expected)"),
    (frame(STEP, b"xy")[:4], "step socket broke (FrameError: the stream ended inside a frame header)"),
])
async def test_every_other_end_is_reported_in_words(end: bytes | None, why: str) -> None:
    steps, got = await run_against(echo_worker(end))
    assert (len(steps), got) == (1, why)


async def test_a_refused_connection_raises_so_the_client_can_fall_back() -> None:
    port = free_port()
    outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
    outbox.put_nowait(ExecuteRound(round_id=0))
    with pytest.raises(StepSocketUnreachableError, match=f"step socket 127.0.0.1:{port} unreachable"):
        await stream_steps("127.0.0.1", port, outbox, lambda step: None)
    assert outbox.qsize() == 1  # nothing was taken: the fallback sends it


async def test_a_silent_worker_ends_the_stream_and_hears_heartbeats_meanwhile() -> None:
    """A worker whose kernel still takes our bytes but that sends nothing (stopped, hung) is given up."""
    heard: list[int] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (item := await read_frame(reader)) is not None:
            heard.append(item[0])

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
    try:
        async with asyncio.timeout(10):
            why = await stream_steps("127.0.0.1", server.sockets[0].getsockname()[1], outbox, lambda step: None,
                                     heartbeat_s=0.05, silence_timeout_s=0.4)
    finally:
        server.close()
    assert why.startswith("the worker went silent (nothing came from the peer for 0.")
    assert heard.count(HEARTBEAT) >= 4


async def test_heartbeats_keep_an_idle_stream_open_and_never_reach_the_steps() -> None:
    async def idle_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(20):  # 1 s of heartbeats only, over twice the silence timeout
            writer.write(frame(HEARTBEAT, b""))
            await asyncio.sleep(0.05)
        await echo_worker(end_frame(grpc.StatusCode.OK))(reader, writer)

    server = await asyncio.start_server(idle_then_answer, "127.0.0.1", 0)
    outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
    outbox.put_nowait(ExecuteRound(round_id=5))
    outbox.put_nowait(None)
    steps: list[StepOutput] = []
    try:
        async with asyncio.timeout(10):
            why = await stream_steps("127.0.0.1", server.sockets[0].getsockname()[1], outbox, steps.append,
                                     heartbeat_s=0.05, silence_timeout_s=0.4)
    finally:
        server.close()
    assert (why, [s.round_id for s in steps]) == (STREAM_CLOSED, [5])


async def _dial_once(handler: Handler, fallback: StepSocketFallback) -> str:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        async with asyncio.timeout(10):
            return await stream_steps("127.0.0.1", server.sockets[0].getsockname()[1], asyncio.Queue(),
                                      lambda step: None, heartbeat_s=0.05, silence_timeout_s=0.3, fallback=fallback)
    finally:
        server.close()


async def _drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()  # takes the connection and drops it: a proxy that cannot route the port


async def _mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # takes the connection and never answers: a black hole


async def _heartbeat_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(frame(HEARTBEAT, b""))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()


async def test_streams_the_worker_never_answers_send_the_next_ones_over_grpc_for_a_while(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    fallback = StepSocketFallback("worker 0", limit=3, hold_s=60.0, clock=lambda: now[0])
    await _dial_once(_drop, fallback)
    await _dial_once(_heartbeat_then_drop, fallback)  # a live peer that then broke: the count starts again
    await _dial_once(_drop, fallback)
    await _dial_once(_mute, fallback)
    assert fallback.use_socket()
    why = await _dial_once(_drop, fallback)  # the third in a row
    assert why == "the worker closed its step socket without ending the stream"
    assert not fallback.use_socket()
    assert "worker 0's step socket ended 3 streams in a row without a frame" in caplog.text
    now[0] += 59.0
    assert not fallback.use_socket()
    now[0] += 1.0
    assert fallback.use_socket()  # the socket is tried again


async def test_a_stream_that_heard_its_peer_never_counts_against_the_socket() -> None:
    fallback = StepSocketFallback("worker 0", limit=1)
    await _dial_once(_heartbeat_then_drop, fallback)

    async def failed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(end_frame(grpc.StatusCode.INTERNAL, "boom"))  # it answered: the stream failed, not the socket
        writer.close()

    assert await _dial_once(failed, fallback) == "Execute stream broke (INTERNAL: boom)"
    assert fallback.use_socket()
