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

Both ends send an empty `HEARTBEAT` frame every `HEARTBEAT_INTERVAL_S` and give the stream up
once nothing at all has come from the other for `SILENCE_TIMEOUT_S` (`keep_alive`): what gRPC's
keepalive pings did for Execute. A stopped or unplugged worker's kernel may still accept and
acknowledge bytes, so only the peer's own frames tell that it lives; and a worker must let go of
a scheduler that vanished, or it would refuse the next one's stream as "another stream is active".
The same messages as Execute, so everything else about a round is unchanged. gRPC stays for
GetWorkerInfo (which tells the step socket's port), health and TLS: with internal TLS the worker
offers no step socket and steps go over Execute.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable

import grpc

from shared.pb.spindle.v1 import worker_pb2

HEADER = struct.Struct("<IB")
REQUEST, STEP, END, HEARTBEAT = 1, 2, 3, 4
MAX_FRAME_BYTES = 256 * 1024 * 1024  # as gRPC's grpc.max_receive_message_length on the services
HEARTBEAT_INTERVAL_S = 1.0
# Generous against an event loop that is merely slow (10 s of silence is a failure in itself);
# gRPC's pings noticed a silent peer within ~4 s.
SILENCE_TIMEOUT_S = 10.0

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


class FrameReader:
    """Reads a stream's frames, skipping heartbeats, and notes when the last frame of any kind came."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self.last_frame_at = time.monotonic()

    async def read(self) -> tuple[int, bytes] | None:
        """The next frame that is not a heartbeat (read_frame's result)."""
        while (item := await read_frame(self._reader)) is not None:
            self.last_frame_at = time.monotonic()
            if item[0] != HEARTBEAT:
                return item
        return None


HEARTBEAT_FRAME = frame(HEARTBEAT, b"")


async def keep_alive(send: Callable[[bytes], Awaitable[None] | None], frames: FrameReader,
                     interval_s: float = HEARTBEAT_INTERVAL_S, timeout_s: float = SILENCE_TIMEOUT_S) -> str:
    """Send a heartbeat every `interval_s` until the peer has sent nothing for `timeout_s`; why it ended."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            sent = send(HEARTBEAT_FRAME)
            if sent is not None:
                await sent
        except OSError as exc:
            return f"a heartbeat could not be sent ({exc})"
        if (silent_s := time.monotonic() - frames.last_frame_at) > timeout_s:
            return f"nothing came from the peer for {silent_s:.1f} s"
