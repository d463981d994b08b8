"""`WorkerClient`: the scheduler's link to one worker (GetWorkerInfo over gRPC, then one Execute stream).

Waits until the worker answers GetWorkerInfo (backoff, progress logged), then keeps one
Execute stream: rounds go out in the order `send` is called, step outputs come back through a
callback. The stream runs on the worker's step socket where the worker offers one
(step_stream.py; `--step-transport socket`, the default, without internal TLS), else as gRPC's
bidi Execute. A broken stream is reported once through `on_failure`; the client never
reconnects by itself: the engine loop moves the worker's requests elsewhere, calls `reset`,
waits for the worker again and `open`s a new stream (the worker starts it from scratch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.scheduler.step_stream import STREAM_CLOSED, Outgoing, stream_steps
from services.scheduler.worker_link import OnFailure, OnOutput
from shared.errors import UnavailableError
from shared.execute import AbortRows, ExecuteRound, StepOutput, WorkerInfo
from shared.execute_wire import execute_request_to_proto, step_from_proto, worker_info_from_proto
from shared.grpc_channel import open_channel
from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc
from shared.step_dial import StepSocketFallback, StepSocketUnreachableError, step_socket_host
from shared.tls import TlsFiles

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0


class WorkerClient:
    """`WorkerLink` for the worker at `address` (index = its position in the config).

    `step_socket`: run the stream on the worker's step socket where it offers one (never with `tls`).
    """

    def __init__(self, index: int, address: str, ready_timeout_s: float = 0.0,
                 backoff_initial_s: float = 0.05, backoff_max_s: float = 2.0, tls: TlsFiles | None = None,
                 step_socket: bool = True) -> None:
        self.index = index
        self.address = address
        self._step_host = step_socket_host(address) if step_socket and tls is None else None
        self._step_port = 0  # the step socket's port the worker offered (0: none), from wait_ready
        self._step_local_socket = ""  # and its local socket's name ("": none)
        self._socket_fallback = StepSocketFallback(f"worker {index}")  # gRPC for a while where it never answers
        self._ready_timeout_s = ready_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._channel = open_channel(address, tls)  # mutual TLS when `tls` is given
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closing = False

    async def wait_ready(self) -> WorkerInfo:
        """Poll GetWorkerInfo until it answers (raises UnavailableError past the timeout)."""
        start = last_log = time.monotonic()
        backoff = self._backoff_initial_s
        while True:
            try:
                msg = await self._stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10.0)
                info = worker_info_from_proto(msg)
                self._step_port = info.step_port if self._step_host is not None else 0
                self._step_local_socket = info.step_local_socket if self._step_port else ""
                logger.info("worker %d at %s ready: model %s (%s on %s), %d KV blocks x %d tokens; steps over %s",
                            self.index, self.address, info.model_id, info.dtype, info.device,
                            info.num_kv_blocks, info.block_size,
                            f"its step socket (port {self._step_port})" if self._step_port else "gRPC")
                return info
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            now = time.monotonic()
            if self._ready_timeout_s and now - start > self._ready_timeout_s:
                raise UnavailableError(f"worker {self.address} not ready after {self._ready_timeout_s} s "
                                       f"({reason})")
            if now - last_log >= _LOG_EVERY_S:
                logger.info("waiting for worker %d at %s (%s)", self.index, self.address, reason)
                last_log = now
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)

    def open(self, on_output: OnOutput, on_failure: OnFailure) -> None:
        self._outbox = asyncio.Queue()  # a fresh stream starts with no rounds of an old one

        def on_step(step: StepOutput) -> None:
            on_output(self.index, step)

        on_socket = bool(self._step_port) and self._socket_fallback.use_socket()
        ended = self._stream_on_socket(on_step) if on_socket else self._stream_on_grpc(on_step)
        self._reader = asyncio.create_task(self._watch(ended, on_failure), name=f"worker-{self.index}-reader")

    def send(self, rnd: ExecuteRound) -> None:
        self._outbox.put_nowait(rnd)

    def abort(self, request_ids: list[str]) -> None:
        self._outbox.put_nowait(AbortRows(request_ids))

    async def close(self) -> None:
        self._closing = True
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._channel.close()

    async def reset(self) -> None:
        """Drop the broken stream (its queued rounds too), so `wait_ready` and `open` can start anew."""
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
            self._call = None
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _requests(self, outbox: asyncio.Queue[Outgoing]) -> AsyncIterator[worker_pb2.ExecuteRequest]:
        while (item := await outbox.get()) is not None:
            yield execute_request_to_proto(item)

    async def _stream_on_socket(self, on_step: Callable[[StepOutput], None]) -> str:
        """The stream on the worker's step socket; on gRPC where the socket cannot be reached (a
        firewall that lets only the gRPC port through), for this stream. Why it ended."""
        assert self._step_host is not None
        try:
            return await stream_steps(self._step_host, self._step_port, self._outbox, on_step,
                                      fallback=self._socket_fallback, local_name=self._step_local_socket)
        except StepSocketUnreachableError as exc:
            logger.warning("worker %d: %s; this stream goes over gRPC", self.index, exc)
            return await self._stream_on_grpc(on_step)

    async def _stream_on_grpc(self, on_step: Callable[[StepOutput], None]) -> str:
        """The stream as gRPC's Execute; why it ended."""
        self._call = call = self._stub.Execute(self._requests(self._outbox))
        try:
            async for msg in call:
                on_step(step_from_proto(msg))
            return STREAM_CLOSED
        except grpc.aio.AioRpcError as exc:
            return f"Execute stream broke ({exc.code().name}: {exc.details()})"
        finally:
            call.cancel()

    async def _watch(self, ended: Awaitable[str], on_failure: OnFailure) -> None:
        """Waits for the stream to end and reports why, once (not when the scheduler closed it)."""
        try:
            message = await ended
        except Exception as exc:  # a bad step output: fail this worker, keep serving the others
            logger.exception("processing a step output of worker %d failed", self.index)
            message = f"its step output could not be processed: {exc}"
        if not self._closing:
            on_failure(self.index, message)
