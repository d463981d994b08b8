"""Frames of a step socket: a gRPC stream of steps carried on a plain TCP socket (or a local
Unix socket between services of one network namespace: shared/step_listener.py).

Two streams have one. A worker's step socket carries the scheduler's Execute stream (rounds
in, each step's tokens out: services/worker/step_socket.py), and the scheduler's carries each
frontend's Connect stream (adds and aborts in, each step's updates out:
services/scheduler/step_socket.py); the dialing end is shared/step_dial.py.

Why: at one stream of a small model every decode step is one message on each hop, and over
gRPC aio that message costs a hand-off to gRPC's poller thread and back to the event loop on
each side (~0.15 ms of a 0.68 ms served step on the worker's hop, README "Measured on
2026-12-01 (third session)"), and gRPC costs ~170 us of CPU a message across both sides against
~73 for the same protobuf on a plain socket (`python -m benchmarks.transport_bench`).

A frame is a 4-byte little-endian payload length, a kind byte and the payload: `REQUEST` frames
(an `ExecuteRequest` or a `ConnectRequest`) go to the server, `STEP` frames (an
`ExecuteResponse` or a `ConnectResponse`) come back, and the server's last frame is one `END`
(a `StreamEnd`: the status the gRPC call would have ended with).

Both ends send an empty `HEARTBEAT` frame every `HEARTBEAT_INTERVAL_S` and give the stream up
once nothing at all has come from the other for `SILENCE_TIMEOUT_S` (`keep_alive`): what gRPC's
keepalive pings did. A stopped or unplugged peer's kernel may still accept and acknowledge
bytes, so only the peer's own frames tell that it lives; and a server must let go of a client
that vanished (a worker would refuse the next scheduler's stream as "another stream is active";
a scheduler aborts the requests of a frontend that is gone). The messages are the gRPC stream's,
so everything else is unchanged. gRPC stays for the info calls (which tell the step socket's
port), health and TLS: with internal TLS no step socket is offered and the streams run on gRPC.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable

import grpc

from shared.pb.spindle.v1 import common_pb2

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
    return frame(END, common_pb2.StreamEnd(code=code.value[0], message=message).SerializeToString())


def parse_end(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """(status, message) of an `END` frame's payload; an unknown code reads as UNKNOWN."""
    end = common_pb2.StreamEnd.FromString(payload)
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
        self.heard = False  # whether any frame came, a heartbeat included

    async def read(self) -> tuple[int, bytes] | None:
        """The next frame that is not a heartbeat (read_frame's result)."""
        while (item := await read_frame(self._reader)) is not None:
            self.last_frame_at = time.monotonic()
            self.heard = True
            if item[0] != HEARTBEAT:
                return item
        return None


HEARTBEAT_FRAME = frame(HEARTBEAT, b"")


async def keep_alive(send: Callable[[bytes], Awaitable[None] | None], frames: FrameReader,
                     interval_s: float = HEARTBEAT_INTERVAL_S, timeout_s: float = SILENCE_TIMEOUT_S) -> str:
    """Send a heartbeat every `interval_s` until the peer has sent nothing for `timeout_s`; why it ended.

    Once this side has ended its half of the stream (asyncio's writer after `write_eof` raises
    RuntimeError), no more heartbeats go out, but the peer's silence is still watched."""
    sending = True
    while True:
        await asyncio.sleep(interval_s)
        try:
            if sending and (sent := send(HEARTBEAT_FRAME)) is not None:
                await sent
        except RuntimeError:  # this side's half is closed: the peer finishes without our heartbeats
            sending = False
        except OSError as exc:
            return f"a heartbeat could not be sent ({exc})"
        if (silent_s := time.monotonic() - frames.last_frame_at) > timeout_s:
            return f"nothing came from the peer for {silent_s:.1f} s"
