"""`StepListener`: the listening side both step sockets share (shared/step_frames.py says what they carry).

A worker serves one for the scheduler's Execute stream (services/worker/step_socket.py) and the
scheduler one for each frontend's Connect stream (services/scheduler/step_socket.py); each
subclass serves a connection in `_serve`, with the heartbeat settings kept here.

Beside the TCP port, on Linux, the same streams are served on a Unix socket in the abstract
namespace under a random name (`local_name`), which the service announces with its port. A
dialer in the same network namespace (the services of `spindle serve`, or containers of one pod)
reaches it and skips the TCP stack: on loopback a TCP write runs the receiver's TCP work in the
sender's system call, and a Unix socket's costs ~40 % less CPU a message (README, "Step sockets
between co-located services"). Elsewhere the name does not exist and the dialer takes the port
(shared/step_dial.py). An abstract name has no file to clean up and is reachable from exactly
where the loopback port is: the network namespace. `SPINDLE_DISABLE_LOCAL_STEP_SOCKET=1` offers
only the port.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import sys
from collections.abc import Awaitable, Callable

from shared.step_frames import HEARTBEAT_INTERVAL_S, SILENCE_TIMEOUT_S
from shared.switches import switch_on

logger = logging.getLogger(__name__)

DISABLE_LOCAL_ENV = "SPINDLE_DISABLE_LOCAL_STEP_SOCKET"
LOCAL_NAME_PREFIX = "spindle-step-"


def local_address(name: str) -> str:
    """The abstract-namespace address of a local step socket's name (a leading NUL byte)."""
    return "\0" + name


def local_sockets_supported() -> bool:
    """Abstract Unix sockets exist on Linux only."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def peer_name(writer: asyncio.StreamWriter) -> str:
    """Who is on the other end of a step connection, for logs (host:port, or a local process)."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return "a local process"


async def serve_local(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                      name: str, backlog: int = 128) -> asyncio.Server:
    """A server calling `handler` for each connection to the local socket `name`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(local_address(name))
        sock.listen(backlog)
        sock.setblocking(False)
        # (uvloop refuses an abstract path given as a string; a bound socket is taken as it is)
        return await asyncio.start_unix_server(handler, sock=sock)
    except BaseException:
        sock.close()
        raise


class StepListener:
    """A TCP server on the service's listen host, beside its gRPC port, and the same on a local
    Unix socket; one `_serve` per connection."""

    def __init__(self, heartbeat_s: float = HEARTBEAT_INTERVAL_S, silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        self._heartbeat_s = heartbeat_s
        self._silence_timeout_s = silence_timeout_s
        self._servers: list[asyncio.Server] = []
        self.local_name = ""  # the local socket's abstract name once started ("": none)

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0: a free one), and on a local socket where supported; returns the port."""
        server = await asyncio.start_server(self._serve, host.strip("[]"), port)
        self._servers.append(server)
        bound = server.sockets[0].getsockname()[1]
        if local_sockets_supported() and not switch_on(DISABLE_LOCAL_ENV):
            self.local_name = await self._start_local()
        logger.info("step socket listening on %s:%d%s", host, bound,
                    f" and on the local socket @{self.local_name}" if self.local_name else "")
        return bound

    async def _start_local(self) -> str:
        name = LOCAL_NAME_PREFIX + secrets.token_hex(8)
        self._servers.append(await serve_local(self._serve, name))
        return name

    def close(self) -> None:
        """Stop taking connections; the streams already running end on their own terms."""
        for server in self._servers:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
