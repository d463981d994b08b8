"""`StepSocket`: the scheduler's step socket, where frontends run their Connect stream without gRPC.

shared/step_frames.py says why and what. Each connection is one frontend's Connect stream,
served by the same `SchedulerServicer.serve_connection` as gRPC's: REQUEST frames carry its
`ConnectRequest`s, each step's `ConnectResponse` leaves as a STEP frame, and the stream's last
frame is an END with the status Connect would have ended with. A frame the scheduler cannot
read ends that stream with UNAVAILABLE (the frontend reconnects and re-submits). Unlike gRPC
there is no half-close: a frontend whose connection ends (it closed it, or its process died),
or that sends not even a heartbeat for `silence_timeout_s`, is gone, and its requests are
aborted at once, as when a gRPC stream is cancelled. Nothing a peer sends stops the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from services.scheduler.servicer import ConnectionOutcome, SchedulerServicer, StreamBrokenError
from shared.pb.spindle.v1 import scheduler_pb2
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


class StepSocket(StepListener):
    """Serves frontends' Connect streams for `servicer` on a TCP port beside the scheduler's gRPC one
    (and a local socket).

    Closing it only stops taking connections: the streams end with the engine, which ends every
    frontend's connection when it stops."""

    def __init__(self, servicer: SchedulerServicer, heartbeat_s: float = HEARTBEAT_INTERVAL_S,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        super().__init__(heartbeat_s, silence_timeout_s)
        self._servicer = servicer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_name(writer)
        frames = FrameReader(reader)
        stream = asyncio.create_task(self._stream(frames, writer, peer), name=f"step-socket-{peer}")
        silence = asyncio.create_task(keep_alive(writer.write, frames, self._heartbeat_s, self._silence_timeout_s),
                                      name=f"step-socket-{peer}-heartbeat")
        ended = False
        try:
            await asyncio.wait({stream, silence}, return_when=asyncio.FIRST_COMPLETED)
            if silence.done():  # a frontend that vanished must not keep its requests running
                logger.warning("step stream from %s: %s; ending it (its requests are aborted)", peer,
                               silence.result())
            ended = stream.done()
        finally:
            silence.cancel()
            stream.cancel()  # where it still runs, its connection's requests are aborted
            with contextlib.suppress(asyncio.CancelledError):
                await stream
            if ended:
                writer.close()  # after the END frame still buffered
            else:
                writer.transport.abort()

    async def _stream(self, frames: FrameReader, writer: asyncio.StreamWriter, peer: object) -> None:
        """Serve the Connect stream until it ends, then send the END frame."""
        outcome = ConnectionOutcome()
        try:
            connection = self._servicer.serve_connection(_messages(frames), outcome, f"step socket, from {peer}")
            async with contextlib.aclosing(connection) as responses:
                async for response in responses:  # closed on the way out: the connection's requests end with it
                    writer.write(frame(STEP, response.SerializeToString()))
                    await writer.drain()
            code = grpc.StatusCode.OK if outcome.failure is None else grpc.StatusCode.UNAVAILABLE
            writer.write(end_frame(code, outcome.failure or ""))
            await writer.drain()
        except OSError as exc:
            logger.info("step stream from %s closed by the peer (%s)", peer, exc)
        except Exception as exc:  # a bug in building a step message: end this stream, loudly; the frontend re-submits
            logger.exception("step stream from %s failed; ending it", peer)
            with contextlib.suppress(OSError):
                writer.write(end_frame(grpc.StatusCode.UNAVAILABLE, f"the scheduler failed on this stream: {exc}"))
                await writer.drain()


async def _messages(frames: FrameReader) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
    """The stream's requests until the frontend closes its connection; that, a frame that cannot be
    read, or a broken connection end it with StreamBrokenError (its requests are aborted)."""
    try:
        while (item := await frames.read()) is not None:
            kind, payload = item
            if kind != REQUEST:
                raise FrameError(f"frame kind {kind} where a request ({REQUEST}) was expected")
            yield scheduler_pb2.ConnectRequest.FromString(payload)
    except (FrameError, DecodeError) as exc:
        raise StreamBrokenError(f"unreadable frame: {exc}") from None
    except OSError as exc:
        raise StreamBrokenError(f"the connection broke ({type(exc).__name__}: {exc})") from None
    raise StreamBrokenError("the frontend closed its connection", expected=True)
