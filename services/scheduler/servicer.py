"""SchedulerService gRPC adapter: decode, call the engine loop, encode. No state of its own.

Each frontend's Connect stream is read by one task. One request that cannot be converted or
added fails alone (an error update to its frontend); a reader that fails for any other reason
ends the stream with UNAVAILABLE, loudly, so the frontend reconnects: a connection is never
left open with nobody reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from services.scheduler import wire
from services.scheduler.engine_loop import EngineLoop, FrontendConnection
from services.scheduler.updates import RequestError, RequestUpdate, StepUpdates
from shared.errors import ErrorKind
from shared.pb.spindle.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "spindle.v1.SchedulerService"


class StreamBrokenError(Exception):
    """The transport under a Connect stream broke, or the frontend left it, while it was read (the
    message says how); `expected` (a frontend that closed its connection) is logged as info."""

    def __init__(self, message: str, expected: bool = False) -> None:
        super().__init__(message)
        self.expected = expected


@dataclass
class ConnectionOutcome:
    """How a Connect stream must end: `failure` set, with UNAVAILABLE and that reason; else OK."""

    failure: str | None = None


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine
        self.step_port = 0  # the step socket's port that GetSchedulerInfo announces (0: none)
        self.step_local_socket = ""  # and its local socket's name ("": none; shared/step_listener.py)

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.ConnectResponse]:
        """One StepUpdates per step out; adds and aborts in; unfinished requests aborted at the end."""
        outcome = ConnectionOutcome()
        messages = _grpc_messages(request_iterator)
        async with contextlib.aclosing(self.serve_connection(messages, outcome, "gRPC")) as responses:
            async for response in responses:
                yield response
        if outcome.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, outcome.failure)

    async def serve_connection(self, messages: AsyncIterator[scheduler_pb2.ConnectRequest],
                               outcome: ConnectionOutcome, transport: str,
                               ) -> AsyncGenerator[scheduler_pb2.ConnectResponse, None]:
        """One frontend's Connect stream, whatever carries it (`transport`: gRPC, or the step socket):
        the responses to send, then how the stream must end in `outcome`."""
        conn = self.engine.connect(transport)
        reader = asyncio.create_task(self._read(conn, messages))
        try:
            while (batch := await conn.outbox.get()) is not None:
                yield wire.step_updates_to_proto(batch.updates, batch.sampled_unix_ns)
            if reader.done():
                outcome.failure = reader.result()
        finally:
            reader.cancel()
            self.engine.disconnect(conn.id)

    async def _read(self, conn: FrontendConnection,
                    messages: AsyncIterator[scheduler_pb2.ConnectRequest]) -> str | None:
        """Apply the frontend's adds and aborts until it closes its side (None), or why the stream must end."""
        try:
            async for msg in messages:
                if msg.HasField("add"):
                    for add in msg.add.requests:
                        self._add(conn, add)
                elif msg.HasField("abort"):
                    self._abort(conn, msg.abort.request_ids)
                elif msg.HasField("resubmitted"):
                    self.engine.drop_orphans_of(msg.resubmitted.frontend_id)
        except asyncio.CancelledError:
            raise
        except StreamBrokenError as exc:
            failure = f"reading the stream failed: {exc}"
            logger.log(logging.INFO if exc.expected else logging.WARNING, "frontend connection %d: %s", conn.id,
                       failure)
        except Exception as exc:
            failure = f"the scheduler failed reading this stream ({type(exc).__name__}: {exc}); reconnect"
            logger.exception("frontend connection %d: reader failed; ending the stream", conn.id)
        else:
            self.engine.close_input(conn.id)
            return None
        conn.outbox.put_nowait(None)  # ends Connect, which aborts the connection's requests
        return failure

    def _add(self, conn: FrontendConnection, msg: scheduler_pb2.AddRequest) -> None:
        """Queue one request; failing to convert or add it fails it alone."""
        try:
            request = wire.request_from_proto(msg, conn.id)
        except ValueError as exc:  # e.g. an enum value this scheduler does not know
            _reject(conn, msg.request_id, ErrorKind.INVALID_ARGUMENT, f"the request cannot be read: {exc}")
            return
        try:
            self.engine.add_requests(conn.id, [request])
        except Exception as exc:
            logger.exception("adding request %s failed; failing it alone", msg.request_id)
            _reject(conn, msg.request_id, ErrorKind.INTERNAL, f"the scheduler failed to add the request: {exc}")
            with contextlib.suppress(Exception):  # drop whatever part of it was added
                self.engine.abort_requests(conn.id, [msg.request_id])

    def _abort(self, conn: FrontendConnection, request_ids: Sequence[str]) -> None:
        try:
            self.engine.abort_requests(conn.id, list(request_ids))
        except Exception:  # those requests end with the connection at the latest
            logger.exception("frontend connection %d: aborting %d request(s) failed", conn.id, len(request_ids))

    async def GetSchedulerInfo(self, request: scheduler_pb2.GetSchedulerInfoRequest,
                               context: grpc.aio.ServicerContext) -> scheduler_pb2.GetSchedulerInfoResponse:
        msg = wire.info_to_proto(self.engine.info())
        msg.step_port = self.step_port
        msg.step_local_socket = self.step_local_socket
        return msg


def _reject(conn: FrontendConnection, request_id: str, kind: ErrorKind, message: str) -> None:
    """Tell the frontend its request failed (its final update); nothing of it stays here."""
    update = RequestUpdate(request_id, error=RequestError(kind, f"request {request_id!r}: {message}"))
    conn.outbox.put_nowait(StepUpdates([update]))


async def _grpc_messages(request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                         ) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
    """Connect's requests, with a broken call told as StreamBrokenError."""
    try:
        async for msg in request_iterator:
            yield msg
    except grpc.aio.AioRpcError as exc:
        raise StreamBrokenError(f"{exc.code().name} {exc.details()}") from None


def register(server: grpc.aio.Server, servicer: SchedulerServicer) -> None:
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
