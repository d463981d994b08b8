"""Frames of the worker's step socket: the Execute stream without gRPC.

Why: at one stream of a small model every decode step is one message from the worker, and over
gRPC aio that message costs the worker's compute core a hand-off to the event loop, gRPC's
poller thread and the event loop again before it can start the next step (~0.15 ms of a 0.68 ms
served step, README "Measured on 2026-12-01 (third session)"), and gRPC costs ~170 us of CPU a
message across both sides against ~73 for the same protobuf on a plain socket
(`python -m benchmarks.transport_bench`). On the step socket the compute thread writes each
step's frame to the socket itself (services/worker/step_socket.py) and the scheduler reads it
with a plain asyncio stream (services/scheduler/step_stream.py).

A frame is a 4-byte little-endian payload length, a kind byte and the payload: `REQUEST` frames
(an `ExecuteRequest`) go to the worker, `STEP` frames (an `ExecuteResponse`) come back, and the
worker's last frame is one `END` (an `ExecuteStreamEnd`: the status Execute would have ended with).
The same messages as Execute, so everything else about a round is unchanged. gRPC stays for
GetWorkerInfo (which tells the step socket's port), health and TLS: with internal TLS the worker
offers no step socket and steps go over Execute.
"""

from __future__ import annotations

import asyncio
import struct

import grpc

from shared.pb.spindle.v1 import worker_pb2

HEADER = struct.Struct("<IB")
REQUEST, STEP, END = 1, 2, 3
MAX_FRAME_BYTES = 256 * 1024 * 1024  # as gRPC's grpc.max_receive_message_length on the services

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


class FrameError(ValueError):
    """The peer sent something that is not a frame of this protocol."""


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def end_frame(code: grpc.StatusCode, message: str = "") -> bytes:
    return frame(END, worker_pb2.ExecuteStreamEnd(code=code.value[0], message=message).SerializeToString())


def parse_end(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """(status, message) of an `END` frame's payload; an unknown code reads as UNKNOWN."""
    end = worker_pb2.ExecuteStreamEnd.FromString(payload)
    return _STATUS_BY_CODE.get(end.code, grpc.StatusCode.UNKNOWN), end.message


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes] | None:
    """The next (kind, payload), or None where the stream ends cleanly between frames."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("the stream ended inside a frame header") from None
        return None
    size, kind = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {size} bytes is over the limit of {MAX_FRAME_BYTES}")
    try:
        return kind, await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise FrameError(f"the stream ended inside a frame of {size} bytes") from None
