"""`StepSocket`: the worker's end of the step socket (shared/step_frames.py says why and what).

Rounds are read on the event loop and go to the same `RoundPipeline` as Execute's; each step's
frame is written by the compute thread itself, blocking, on a duplicate of the connection's
socket (`StepSender`), so a step leaves the worker without waking another thread. As with
Execute, one stream runs at a time: a second connection is answered with an END frame
(UNAVAILABLE). A frame the worker cannot read ends that stream with INVALID_ARGUMENT; a peer
that goes away (reads nothing for `SEND_TIMEOUT_S`, or sends not even a heartbeat for
`silence_timeout_s`) stops its rounds. Nothing a peer sends stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from services.worker.round_pipeline import RoundFailedError, RoundPipeline
from services.worker.servicer import execute_status
from shared.errors import SpindleError
from shared.execute import AbortRows, ExecuteRound, StepOutput
from shared.execute_wire import execute_request_from_proto, step_to_proto
from shared.pb.spindle.v1 import worker_pb2
from shared.step_frames import (
    HEARTBEAT_INTERVAL_S,
    REQUEST,
    SILENCE_TIMEOUT_S,
    STEP,
    FrameError,
    FrameReader,
    end_frame,
    frame,
    keep_alive,
)
from shared.step_listener import StepListener, peer_name

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0  # a peer that takes no step for this long is taken as gone


class StepSender:
    """Writes whole frames to one connection from any thread (the compute thread's steps, the loop's END)."""

    def __init__(self, connection: socket.socket) -> None:
        # A duplicate descriptor of the event loop's socket: the loop keeps reading the original,
        # and this one blocks (up to the timeout) where the original may not.
        self._sock = socket.socket(fileno=os.dup(connection.fileno()))
        self._sock.settimeout(SEND_TIMEOUT_S)
        if connection.family in (socket.AF_INET, socket.AF_INET6):  # (a local Unix socket has no Nagle)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()

    def send_step(self, step: StepOutput) -> None:
        self.send(frame(STEP, step_to_proto(step).SerializeToString()))

    def send(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)

    def shutdown(self) -> None:
        """End the connection for every descriptor of it: reads see its end, the next send fails."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._sock.close()


class StepSocket(StepListener):
    """Serves the step socket for `pipeline` on a TCP port beside the worker's gRPC one (and a local socket)."""

    def __init__(self, pipeline: RoundPipeline, heartbeat_s: float = HEARTBEAT_INTERVAL_S,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        super().__init__(heartbeat_s, silence_timeout_s)
        self._pipeline = pipeline

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_name(writer)
        sender = StepSender(writer.get_extra_info("socket"))
        frames = FrameReader(reader)

        async def watch() -> None:  # a scheduler that vanished must not hold the worker
            why = await keep_alive(lambda data: asyncio.to_thread(sender.send, data), frames,
                                   self._heartbeat_s, self._silence_timeout_s)
            logger.warning("step stream from %s: %s; ending it", peer, why)
            sender.shutdown()

        watchdog = asyncio.create_task(watch(), name=f"step-socket-{peer}-heartbeat")
        try:
            code, message = await self._run(frames, sender)
            if code != grpc.StatusCode.OK:
                logger.warning("step stream from %s ended: %s: %s", peer, code.name, message)
            await asyncio.to_thread(sender.send, end_frame(code, message))
        except OSError as exc:
            logger.info("step stream from %s closed by the peer (%s)", peer, exc)
        finally:
            watchdog.cancel()
            sender.close()
            writer.close()

    async def _run(self, frames: FrameReader, sender: StepSender) -> tuple[grpc.StatusCode, str]:
        """Runs the stream's rounds; the status it ends with (OSError: the peer is gone)."""
        try:
            async for _ in self._pipeline.run(_rounds(frames), send_step=sender.send_step):
                pass  # with send_step, steps leave from the compute thread
        except (RoundFailedError, SpindleError) as exc:
            return execute_status(exc)
        except (FrameError, DecodeError) as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, f"unreadable frame: {exc}"
        return grpc.StatusCode.OK, ""


async def _rounds(frames: FrameReader) -> AsyncIterator[ExecuteRound | AbortRows]:
    while (item := await frames.read()) is not None:
        kind, payload = item
        if kind != REQUEST:
            raise FrameError(f"frame kind {kind} where a request ({REQUEST}) was expected")
        yield execute_request_from_proto(worker_pb2.ExecuteRequest.FromString(payload))
