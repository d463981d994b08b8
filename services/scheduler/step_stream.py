"""The scheduler's end of a worker's step socket (shared/step_frames.py says why and what).

`stream_steps` runs one Execute stream over the socket: rounds from the outbox go out as
REQUEST frames in order, each STEP frame comes back through `on_step`, and it returns why the
stream ended, in the words `WorkerClient` reports for a gRPC stream. `None` in the outbox ends
the scheduler's side (the worker then finishes its rounds and ends with an END frame).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from shared.execute import AbortRows, ExecuteRound, StepOutput
from shared.execute_wire import execute_request_to_proto, step_from_proto
from shared.pb.spindle.v1 import worker_pb2
from shared.step_frames import END, REQUEST, STEP, FrameError, frame, parse_end, read_frame

Outgoing = ExecuteRound | AbortRows | None  # None ends the stream

STREAM_CLOSED = "the worker closed its Execute stream"


def step_socket_host(address: str) -> str | None:
    """The host of a plain `host:port` gRPC target (brackets of an IPv6 literal removed), else None
    (a target with a scheme, such as dns:/// or unix:, is left to gRPC)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or ":/" in address or address.startswith("unix:"):
        return None
    return host.strip("[]")


async def stream_steps(host: str, port: int, outbox: asyncio.Queue[Outgoing],
                       on_step: Callable[[StepOutput], None]) -> str:
    """Run one stream on host:port until it ends; why it ended. An exception of `on_step` propagates."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return f"step socket {host}:{port} refused the stream ({exc})"
    sending = asyncio.create_task(_send_rounds(writer, outbox), name=f"step-socket-{host}:{port}-sender")
    try:
        while (item := await read_frame(reader)) is not None:
            kind, payload = item
            if kind == STEP:
                on_step(step_from_proto(worker_pb2.ExecuteResponse.FromString(payload)))
            elif kind == END:
                code, message = parse_end(payload)
                return STREAM_CLOSED if code == grpc.StatusCode.OK else f"Execute stream broke ({code.name}: {message})"
            else:
                raise FrameError(f"frame kind {kind} where a step ({STEP}) or the end ({END}) was expected")
        return "the worker closed its step socket without ending the stream"
    except (OSError, FrameError) as exc:
        return f"step socket broke ({type(exc).__name__}: {exc})"
    finally:
        sending.cancel()
        writer.close()


async def _send_rounds(writer: asyncio.StreamWriter, outbox: asyncio.Queue[Outgoing]) -> None:
    """Writes the outbox's rounds and aborts in order; at None, ends the scheduler's side."""
    with contextlib.suppress(OSError):  # the connection broke: the reading side reports it
        while (item := await outbox.get()) is not None:
            writer.write(frame(REQUEST, execute_request_to_proto(item).SerializeToString()))
            await writer.drain()
        writer.write_eof()
