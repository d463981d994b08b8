"""Serve a `Worker` over loopback gRPC for tests, exactly as `services.worker.service` wires it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import grpc

from services.worker.round_pipeline import RoundPipeline
from services.worker.service import SERVICE_NAME
from services.worker.servicer import WorkerServicer
from services.worker.step_socket import StepSocket
from services.worker.worker import Worker
from shared.execute import ExecuteRound
from shared.execute_wire import round_to_proto
from shared.grpc_server import start_grpc
from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc


@contextlib.asynccontextmanager
async def worker_service(worker: Worker, step_socket: bool = False) -> AsyncIterator[str]:
    """`worker` served on a free port (with its step socket if asked), as service.py wires it; its address."""
    servicer = WorkerServicer()
    service = await start_grpc(
        "127.0.0.1:0",
        lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s),
        [SERVICE_NAME],
    )
    pipeline = RoundPipeline(worker.runner)
    steps = StepSocket(pipeline)
    info = worker.info
    if step_socket:
        info = dataclasses.replace(info, step_port=await steps.start("127.0.0.1", 0),
                                   step_local_socket=steps.local_name)
    servicer.attach(info, pipeline)
    await service.set_serving([SERVICE_NAME])
    try:
        yield service.address
    finally:
        steps.close()
        await service.server.stop(0)
        pipeline.close()


@contextlib.asynccontextmanager
async def serve_worker(worker: Worker) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    """A stub for `worker` served on a free port; the server stops when the block ends."""
    async with worker_service(worker) as address, grpc.aio.insecure_channel(address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


async def as_requests(rounds: list[ExecuteRound]) -> AsyncIterator[worker_pb2.ExecuteRequest]:
    """The request stream of an Execute call carrying `rounds`."""
    for round_ in rounds:
        yield round_to_proto(round_)
