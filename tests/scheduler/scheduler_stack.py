"""A real scheduler service (gRPC and its step socket) on loopback, in front of fake worker servers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.request import Request
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer, register
from services.scheduler.step_socket import StepSocket
from services.scheduler.worker_client import WorkerClient
from shared.grpc_server import GrpcService, start_grpc
from shared.pb.spindle.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.sampling import SamplingOptions
from shared.state_store import StateStore
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.fake_worker_server import FakeWorkerServicer, start_fake_worker_server

EOS_PERIOD = 10**9  # the fake model (practically) never samples EOS here


@dataclass
class Stack:
    engine: EngineLoop
    service: GrpcService
    workers: list[FakeWorker]
    worker_servers: list[grpc.aio.Server]
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    servicer: SchedulerServicer
    step_port: int  # the scheduler's step socket


@contextlib.asynccontextmanager
async def running_stack(store: StateStore | None = None, step_delay_s: float = 0.002,
                        **socket_timeouts: float) -> AsyncIterator[Stack]:
    """Two fake workers (a step every `step_delay_s`) behind a real scheduler service (gRPC and its step
    socket, with `socket_timeouts` for StepSocket); `store` holds its journal."""
    workers = [FakeWorker(32, 4, eos_period=EOS_PERIOD, max_model_len=128) for _ in range(2)]
    servers, links = [], []
    for index, worker in enumerate(workers):
        # The first worker is "still loading" for a few calls: the client must retry.
        server, address = await start_fake_worker_server(
            FakeWorkerServicer(worker, not_ready_calls=3 if index == 0 else 0, step_delay_s=step_delay_s))
        servers.append(server)
        links.append(WorkerClient(index, address, backoff_initial_s=0.01))
    config = SchedulerConfig(worker_addresses=tuple(link.address for link in links), num_scheduler_steps=4)
    engine = EngineLoop(config, links, store=store)
    servicer = SchedulerServicer(engine)
    service = await start_grpc("127.0.0.1:0", lambda s: register(s, servicer), [SERVICE_NAME])
    step_socket = StepSocket(servicer, **socket_timeouts)
    servicer.step_port = await step_socket.start("127.0.0.1", 0)
    servicer.step_local_socket = step_socket.local_name
    starter = asyncio.create_task(engine.start())
    channel = grpc.aio.insecure_channel(service.address)
    try:
        yield Stack(engine, service, workers, servers, channel, scheduler_pb2_grpc.SchedulerServiceStub(channel),
                    servicer, servicer.step_port)
    finally:
        await channel.close()
        starter.cancel()
        await engine.stop()
        step_socket.close()
        await service.server.stop(0)
        for server in servers:
            await server.stop(0)


async def wait_ready(stub: scheduler_pb2_grpc.SchedulerServiceStub) -> scheduler_pb2.GetSchedulerInfoResponse:
    for _ in range(200):
        info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
        if info.ready:
            return info
        await asyncio.sleep(0.02)
    raise AssertionError("scheduler never became ready")


async def until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def make_request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id, prompt, SamplingOptions(temperature=0.0, max_tokens=max_tokens))
