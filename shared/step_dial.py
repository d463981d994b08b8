"""The dialing end of a step socket (shared/step_frames.py says why and what), for any stream on one.

Both streams that have a step socket are dialed the same way: the scheduler dials a worker's
(Execute: rounds out, steps back) and a frontend dials the scheduler's (Connect: adds and aborts
out, step updates back). `dial` runs one such stream until it ends: the outbox's items go out as
REQUEST frames in order, each STEP frame's payload goes to `on_payload`, heartbeats flow both
ways, and it returns how the stream ended. `None` in the outbox ends the dialer's side: a worker
then finishes its rounds and ends with an END frame, while the scheduler takes a frontend that
ends its side as gone (services/scheduler/step_socket.py).

Where the server announced a local socket (shared/step_listener.py), `dial` tries it first and
takes host:port where it cannot be reached (another network namespace: another pod or machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

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
from shared.step_listener import local_address

Item = TypeVar("Item")

STEP_TRANSPORTS = ("socket", "grpc")  # a client's choice: the step socket where offered, or always gRPC
CONNECT_TIMEOUT_S = 5.0  # a port a firewall drops would otherwise take the kernel's ~2 min
MUTE_STREAMS_BEFORE_FALLBACK = 3  # socket streams in a row that never heard the peer (StepSocketFallback)
FALLBACK_HOLD_S = 300.0  # then gRPC for this long before the socket is tried again

logger = logging.getLogger(__name__)


class StepSocketUnreachableError(ConnectionError):
    """The server offered a step socket, but no connection to it could be made (nothing was sent)."""


@dataclass(frozen=True)
class StreamEnded:
    """How a dialed stream ended: `code` from the server's END frame (None: no END came), why in
    words, and whether any frame came from the server at all (a live one sends a heartbeat within
    HEARTBEAT_INTERVAL_S)."""

    code: grpc.StatusCode | None
    why: str
    heard: bool = True

    @property
    def closed(self) -> bool:
        """The server ended it with OK: it closed the stream in order (a worker after the dialer's
        end and its last round; a scheduler that stops, whose frontends then re-submit)."""
        return self.code == grpc.StatusCode.OK


class StepSocketFallback:
    """Whether a client dials its peer's step socket, or streams on gRPC for a while instead.

    A port that takes connections and then drops them or never answers (a service mesh's proxy
    that cannot route a plain TCP port, a Service that sends the port elsewhere) would end every
    stream at once, and the client would dial it again forever while gRPC to the same peer works.
    So after `limit` socket streams in a row that ended without one frame from the peer (a live
    peer's first heartbeat comes within a second), the client's streams go over gRPC for
    `hold_s`, and then the socket is tried again. A port that refuses connections needs none of
    this: the dial fails and that stream goes over gRPC at once.
    """

    def __init__(self, peer: str, limit: int = MUTE_STREAMS_BEFORE_FALLBACK, hold_s: float = FALLBACK_HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.peer = peer
        self.limit = limit
        self.hold_s = hold_s
        self._clock = clock
        self._mute_in_a_row = 0
        self._grpc_until = 0.0

    def use_socket(self) -> bool:
        """Whether the next stream dials the step socket."""
        return self._clock() >= self._grpc_until

    def record(self, ended: StreamEnded) -> None:
        """Count a socket stream's end: one the peer never answered brings the fallback nearer."""
        if ended.heard:
            self._mute_in_a_row = 0
            return
        self._mute_in_a_row += 1
        if self._mute_in_a_row >= self.limit:
            self._mute_in_a_row = 0
            self._grpc_until = self._clock() + self.hold_s
            logger.warning("the %s's step socket ended %d streams in a row without a frame (the last: %s); "
                           "streaming over gRPC for %.0f s", self.peer, self.limit, ended.why, self.hold_s)


def step_socket_host(address: str) -> str | None:
    """The host of a plain `host:port` gRPC target (brackets of an IPv6 literal removed), else None
    (a target with a scheme, such as dns:/// or unix:, is left to gRPC)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or ":/" in address or address.startswith("unix:"):
        return None
    return host.strip("[]")


async def open_local(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the local step socket `name` (OSError where this network namespace has none)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, local_address(name))
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


async def _connect(host: str, port: int, local_name: str,
                   peer: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The local socket where it can be reached, else host:port (StepSocketUnreachableError: neither)."""
    if local_name:
        try:
            connection = await open_local(local_name)
        except OSError as exc:  # refused: not on this host, or not in this network namespace
            logger.info("the %s's local step socket @%s is not reachable from here (%s); dialing %s:%d",
                        peer, local_name, exc.strerror or exc, host, port)
        else:
            logger.info("the %s's step stream runs on its local socket @%s", peer, local_name)
            return connection
    try:
        return await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        raise StepSocketUnreachableError(f"step socket {host}:{port} unreachable ({exc!r})") from None


async def dial(host: str, port: int, outbox: asyncio.Queue[Item | None], encode: Callable[[Item], bytes],
               on_payload: Callable[[bytes], None], peer: str, heartbeat_s: float = HEARTBEAT_INTERVAL_S,
               silence_timeout_s: float = SILENCE_TIMEOUT_S, fallback: StepSocketFallback | None = None,
               local_name: str = "") -> StreamEnded:
    """Run one stream on the server's local socket `local_name` ("": none) where it can be reached, else
    on host:port, until it ends (`peer` names the server in the words of the end), and tell `fallback`
    how it ended. An exception of `on_payload` propagates; StepSocketUnreachableError where no
    connection could be made, with nothing taken from the outbox."""
    reader, writer = await _connect(host, port, local_name, peer)
    frames = FrameReader(reader)
    silent: list[str] = []

    async def watch() -> None:
        silent.append(await keep_alive(writer.write, frames, heartbeat_s, silence_timeout_s))
        writer.transport.abort()  # the read below ends

    helpers = [asyncio.create_task(_send(writer, outbox, encode), name=f"step-socket-{host}:{port}-sender"),
               asyncio.create_task(watch(), name=f"step-socket-{host}:{port}-heartbeat")]
    try:
        ended = await _read(frames, on_payload, peer)
    except (OSError, FrameError) as exc:
        ended = StreamEnded(None, f"step socket broke ({type(exc).__name__}: {exc})")
    finally:
        for task in helpers:
            task.cancel()
        writer.close()
    if silent:
        ended = StreamEnded(None, f"the {peer} went silent ({silent[0]})")
    ended = StreamEnded(ended.code, ended.why, frames.heard)
    if fallback is not None:
        fallback.record(ended)
    return ended


async def _read(frames: FrameReader, on_payload: Callable[[bytes], None], peer: str) -> StreamEnded:
    while (item := await frames.read()) is not None:
        kind, payload = item
        if kind == STEP:
            on_payload(payload)
        elif kind == END:
            return StreamEnded(*parse_end(payload))
        else:
            raise FrameError(f"frame kind {kind} where a step ({STEP}) or the end ({END}) was expected")
    return StreamEnded(None, f"the {peer} closed its step socket without ending the stream")


async def _send(writer: asyncio.StreamWriter, outbox: asyncio.Queue[Item | None],
                encode: Callable[[Item], bytes]) -> None:
    """Writes the outbox's items in order; at None, ends the dialer's side."""
    with contextlib.suppress(OSError):  # the connection broke: the reading side reports it
        while (item := await outbox.get()) is not None:
            writer.write(frame(REQUEST, encode(item)))
            await writer.drain()
        writer.write_eof()
