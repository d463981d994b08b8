"""WorkerService over gRPC backed by `FakeWorker` (no model): for testing the scheduler service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from shared.execute import AbortRows
from shared.execute_wire import execute_request_from_proto, step_to_proto, worker_info_to_proto
from shared.grpc_server import GRPC_OPTIONS
from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc
from tests.scheduler.fake_worker import FakeWorker


class FakeWorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Answers GetWorkerInfo after `not_ready_calls` UNAVAILABLE answers; runs rounds in order."""

    def __init__(self, worker: FakeWorker, not_ready_calls: int = 0, step_delay_s: float = 0.0) -> None:
        self.worker = worker
        self.not_ready_calls = not_ready_calls
        self.step_delay_s = step_delay_s
        self.num_info_calls = 0

    async def GetWorkerInfo(self, request: worker_pb2.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.GetWorkerInfoResponse:
        self.num_info_calls += 1
        if self.num_info_calls <= self.not_ready_calls:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model still loading")
        return worker_info_to_proto(self.worker.info)

    async def Execute(self, request_iterator: AsyncIterator[worker_pb2.ExecuteRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.ExecuteResponse]:
        rounds: asyncio.Queue[worker_pb2.ExecuteRequest | None] = asyncio.Queue()

        async def read() -> None:
            async for msg in request_iterator:
                rounds.put_nowait(msg)
            rounds.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (msg := await rounds.get()) is not None:
                item = execute_request_from_proto(msg)
                if isinstance(item, AbortRows):
                    self.worker.abort(item.request_ids)
                    continue
                self.worker.submit(item)
                while self.worker.has_work:
                    step = self.worker.step()
                    step.sampled_unix_ns = time.time_ns()  # as a real worker stamps it
                    yield step_to_proto(step)
                    await asyncio.sleep(self.step_delay_s)
        finally:
            reader.cancel()


async def start_fake_worker_server(servicer: FakeWorkerServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
