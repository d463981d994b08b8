"""`StepListener`: the listening side both step sockets share (shared/step_frames.py says what they carry).

A worker serves one for the scheduler's Execute stream (services/worker/step_socket.py) and the
scheduler one for each frontend's Connect stream (services/scheduler/step_socket.py); each
subclass serves a connection in `_serve`, with the heartbeat settings kept here.
"""

from __future__ import annotations

import asyncio
import logging

from shared.step_frames import HEARTBEAT_INTERVAL_S, SILENCE_TIMEOUT_S

logger = logging.getLogger(__name__)


class StepListener:
    """A TCP server on the service's listen host, beside its gRPC port; one `_serve` per connection."""

    def __init__(self, heartbeat_s: float = HEARTBEAT_INTERVAL_S, silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        self._heartbeat_s = heartbeat_s
        self._silence_timeout_s = silence_timeout_s
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0: a free one); returns the port."""
        self._server = await asyncio.start_server(self._serve, host.strip("[]"), port)
        bound = self._server.sockets[0].getsockname()[1]
        logger.info("step socket listening on %s:%d", host, bound)
        return bound

    def close(self) -> None:
        """Stop taking connections; the streams already running end on their own terms."""
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
