"""gRPC adapter of the worker: decode, one core call, encode. State lives in the core objects."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from services.worker.round_pipeline import RoundFailedError, RoundPipeline
from shared.errors import GRPC_CODES, SpindleError, UnavailableError
from shared.execute import AbortRows, ExecuteRound, WorkerInfo
from shared.execute_wire import execute_request_from_proto, step_to_proto, worker_info_to_proto
from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Serves before the model is loaded (health says NOT_SERVING); `attach` makes it usable."""

    def __init__(self) -> None:
        self.info: WorkerInfo | None = None
        self.pipeline: RoundPipeline | None = None

    def attach(self, info: WorkerInfo, pipeline: RoundPipeline) -> None:
        self.info, self.pipeline = info, pipeline

    async def GetWorkerInfo(
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetWorkerInfoResponse:
        if self.info is None:
            raise UnavailableError("worker is still loading its model")
        return worker_info_to_proto(self.info)

    async def Execute(
        self, request_iterator: AsyncIterator[worker_pb2.ExecuteRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.ExecuteResponse]:
        if self.pipeline is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
            return
        try:
            async for step in self.pipeline.run(_rounds(request_iterator)):
                yield step_to_proto(step)
        except (RoundFailedError, SpindleError) as exc:
            await context.abort(*execute_status(exc))


def execute_status(exc: RoundFailedError | SpindleError) -> tuple[grpc.StatusCode, str]:
    """The status an Execute stream (or the step socket's, step_socket.py) ends with when `exc` ends it."""
    if isinstance(exc, SpindleError):
        return GRPC_CODES[exc.kind], exc.message
    cause = exc.cause
    return (GRPC_CODES[cause.kind] if isinstance(cause, SpindleError) else grpc.StatusCode.INTERNAL), str(exc)


async def _rounds(
    request_iterator: AsyncIterator[worker_pb2.ExecuteRequest],
) -> AsyncIterator[ExecuteRound | AbortRows]:
    async for msg in request_iterator:
        yield execute_request_from_proto(msg)
