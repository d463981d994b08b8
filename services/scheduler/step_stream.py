"""The scheduler's end of a worker's step socket (shared/step_frames.py says why and what).

`stream_steps` runs one Execute stream over the socket: rounds from the outbox go out as
REQUEST frames in order, each STEP frame comes back through `on_step`, and it returns why the
stream ended, in the words `WorkerClient` reports for a gRPC stream. `None` in the outbox ends
the scheduler's side (the worker then finishes its rounds and ends with an END frame). Both
ends exchange heartbeats; a worker silent for `silence_timeout_s` ends the stream
(shared/step_frames.py `keep_alive`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from shared.execute import AbortRows, ExecuteRound, StepOutput
from shared.execute_wire import execute_request_to_proto, step_from_proto
from shared.pb.spindle.v1 import worker_pb2
from shared.step_frames import (
    END,
    HEARTBEAT_INTERVAL_S,
    REQUEST,
    SILENCE_TIMEOUT_S,
    STEP,
    FrameError,
    FrameReader,
    frame,
    keep_alive,
    parse_end,
)

Outgoing = ExecuteRound | AbortRows | None  # None ends the stream

STREAM_CLOSED = "the worker closed its Execute stream"
CONNECT_TIMEOUT_S = 5.0  # a port a firewall drops would otherwise take the kernel's ~2 min


class StepSocketUnreachableError(ConnectionError):
    """The worker offered a step socket, but no connection to it could be made."""


def step_socket_host(address: str) -> str | None:
    """The host of a plain `host:port` gRPC target (brackets of an IPv6 literal removed), else None
    (a target with a scheme, such as dns:/// or unix:, is left to gRPC)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or ":/" in address or address.startswith("unix:"):
        return None
    return host.strip("[]")


async def stream_steps(host: str, port: int, outbox: asyncio.Queue[Outgoing], on_step: Callable[[StepOutput], None],
                       heartbeat_s: float = HEARTBEAT_INTERVAL_S, silence_timeout_s: float = SILENCE_TIMEOUT_S) -> str:
    """Run one stream on host:port until it ends; why it ended. An exception of `on_step` propagates,
    and StepSocketUnreachableError where no connection could be made (nothing was sent)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        raise StepSocketUnreachableError(f"step socket {host}:{port} unreachable ({exc!r})") from None
    frames = FrameReader(reader)
    silent: list[str] = []

    async def watch() -> None:
        silent.append(await keep_alive(writer.write, frames, heartbeat_s, silence_timeout_s))
        writer.transport.abort()  # the read below ends

    helpers = [asyncio.create_task(_send_rounds(writer, outbox), name=f"step-socket-{host}:{port}-sender"),
               asyncio.create_task(watch(), name=f"step-socket-{host}:{port}-heartbeat")]
    try:
        why = await _read_steps(frames, on_step)
    except (OSError, FrameError) as exc:
        why = f"step socket broke ({type(exc).__name__}: {exc})"
    finally:
        for task in helpers:
            task.cancel()
        writer.close()
    return f"the worker went silent ({silent[0]})" if silent else why


async def _read_steps(frames: FrameReader, on_step: Callable[[StepOutput], None]) -> str:
    while (item := await frames.read()) is not None:
        kind, payload = item
        if kind == STEP:
            on_step(step_from_proto(worker_pb2.ExecuteResponse.FromString(payload)))
        elif kind == END:
            code, message = parse_end(payload)
            return STREAM_CLOSED if code == grpc.StatusCode.OK else f"Execute stream broke ({code.name}: {message})"
        else:
            raise FrameError(f"frame kind {kind} where a step ({STEP}) or the end ({END}) was expected")
    return "the worker closed its step socket without ending the stream"


async def _send_rounds(writer: asyncio.StreamWriter, outbox: asyncio.Queue[Outgoing]) -> None:
    """Writes the outbox's rounds and aborts in order; at None, ends the scheduler's side."""
    with contextlib.suppress(OSError):  # the connection broke: the reading side reports it
        while (item := await outbox.get()) is not None:
            writer.write(frame(REQUEST, execute_request_to_proto(item).SerializeToString()))
            await writer.drain()
        writer.write_eof()
