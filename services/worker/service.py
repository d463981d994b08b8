"""The worker's gRPC service: load the model on the compute thread, serve rounds until told to stop.

Imports torch (through the worker); the entry point (__main__.py) imports this only after it has
set what the OpenMP runtime reads as torch loads it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import grpc

from services.cpu_affinity import compute_core
from services.worker.config import WorkerConfig
from services.worker.round_pipeline import RoundPipeline, compute_thread
from services.worker.servicer import WorkerServicer
from services.worker.step_socket import StepSocket
from services.worker.telemetry import WorkerTelemetry
from services.worker.worker import Worker, runs_on_cpu
from shared.grpc_server import start_grpc, wait_for_shutdown
from shared.metrics import serve_metrics
from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc
from shared.startup_heap import freeze_startup_heap
from shared.tls import grpc_server_credentials
from shared.tracing import Tracing

logger = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def pin_event_loop(config: WorkerConfig) -> None:
    """On a CPU worker whose OpenMP threads are bound, this thread (the event loop) and the threads
    it starts from now on (gRPC's, the compute thread) go to the compute thread's core, within the
    worker's own cores (services/cpu_affinity.py `compute_core` says why). A CUDA worker's compute
    thread waits on the device instead: untested there, so left as it was."""
    cores = os.sched_getaffinity(0)
    first_place = set(compute_core()) & cores if runs_on_cpu(config.device) else set()
    if first_place:
        os.sched_setaffinity(0, first_place)


async def serve(config: WorkerConfig) -> None:
    """Serve until SIGTERM/SIGINT; SERVING once the model is loaded and the KV cache allocated."""
    pin_event_loop(config)  # before gRPC starts its threads and the compute thread starts
    servicer = WorkerServicer()

    def register(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)

    service = await start_grpc(config.listen, register, [SERVICE_NAME],
                               credentials=grpc_server_credentials(config.internal_tls))
    telemetry = WorkerTelemetry(Tracing.from_env("worker"))
    metrics_server = None
    if config.metrics_port is not None:
        # Up before the model loads, so a scrape tells "loading" (worker_ready 0) from "down".
        metrics_server = await serve_metrics(telemetry.metrics.registry, config.listen.rsplit(":", 1)[0],
                                             config.metrics_port)
    compute = compute_thread()  # loads the model, then runs every round (round_pipeline.py says why)
    try:
        worker = await asyncio.get_running_loop().run_in_executor(compute, Worker, config)
    except BaseException:
        compute.shutdown(wait=False)
        await service.server.stop(0)
        raise
    pipeline = RoundPipeline(worker.runner, telemetry, config.fault_fail_round, compute)
    telemetry.metrics.report_step_phases(worker.runner.phases)
    if worker.device.type == "cpu":
        from services.worker.kernels.build import loaded_build

        telemetry.metrics.report_cpu_kernels(loaded_build())
    step_socket = StepSocket(pipeline)
    info = worker.info
    if config.internal_tls is not None:
        logger.info("no step socket: with internal TLS steps go over Execute")
    elif config.step_port >= 0:
        step_port = await step_socket.start(config.listen.rsplit(":", 1)[0], config.step_port)
        info = dataclasses.replace(info, step_port=step_port, step_local_socket=step_socket.local_name)
    servicer.attach(info, pipeline)
    freeze_startup_heap()
    await service.set_serving([SERVICE_NAME])
    telemetry.metrics.ready.set(1)
    logger.info("listening on %s", service.address)
    try:
        await wait_for_shutdown(service)
    finally:
        step_socket.close()
        pipeline.close()
        if metrics_server is not None:
            await metrics_server.stop()
        telemetry.tracing.shutdown()
