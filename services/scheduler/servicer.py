"""SchedulerService gRPC adapter: decode, call the engine loop, encode. No state of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from services.scheduler import wire
from services.scheduler.engine_loop import EngineLoop
from shared.pb.spindle.v1 import scheduler_pb2, scheduler_pb2_grpc

SERVICE_NAME = "spindle.v1.SchedulerService"


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.ConnectResponse]:
        """One StepUpdates per step out; adds and aborts in; unfinished requests aborted at the end."""
        conn = self.engine.connect()
        reader = asyncio.create_task(self._read(conn.id, request_iterator))
        try:
            while (batch := await conn.outbox.get()) is not None:
                yield wire.step_updates_to_proto(batch.updates)
        finally:
            reader.cancel()
            self.engine.disconnect(conn.id)

    async def _read(self, connection_id: int, messages: AsyncIterator[scheduler_pb2.ConnectRequest]) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for msg in messages:
                if msg.HasField("add"):
                    self.engine.add_requests(connection_id, [
                        wire.request_from_proto(r, connection_id) for r in msg.add.requests])
                elif msg.HasField("abort"):
                    self.engine.abort_requests(connection_id, list(msg.abort.request_ids))
            self.engine.close_input(connection_id)

    async def GetSchedulerInfo(self, request: scheduler_pb2.GetSchedulerInfoRequest,
                               context: grpc.aio.ServicerContext) -> scheduler_pb2.GetSchedulerInfoResponse:
        return wire.info_to_proto(self.engine.info())


def register(server: grpc.aio.Server, engine: EngineLoop) -> None:
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(engine), server)
