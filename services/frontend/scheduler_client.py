"""The frontend's one Connect stream to the scheduler, shared by every request.

Adds and aborts issued in the same event-loop iteration leave as one batched message each;
each StepUpdates coming back is split by request_id into per-request queues. When the
stream breaks (the scheduler restarted, or the network hiccuped) nothing in flight fails:
the client reconnects with exponential backoff (waiting until GetSchedulerInfo says the
workers are ready) and re-submits every unfinished request with the output tokens its client
already received, so the scheduler recomputes from there and streams only what follows; no
token is sent twice or lost. Requests fail with UNAVAILABLE only if no scheduler comes back
within `resume_timeout_s`.

The stream runs on the scheduler's step socket where it offers one (shared/step_frames.py:
the same messages without gRPC, a fraction of the CPU a step), else, with internal TLS, or
when the socket cannot be reached, on gRPC's Connect. GetSchedulerInfo stays on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import grpc

from services.frontend import wire
from services.frontend.messages import AddRequest, RequestUpdate, SchedulerInfo
from shared.errors import InvalidArgumentError, UnavailableError
from shared.grpc_channel import open_channel
from shared.metrics import seconds_since_unix_ns
from shared.pb.spindle.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.step_dial import StepSocketFallback, StepSocketUnreachableError, dial, step_socket_host
from shared.tls import TlsFiles

logger = logging.getLogger(__name__)

_PROGRESS_LOG_INTERVAL_S = 10.0
_STABLE_STREAM_S = 1.0  # a stream that lasted this long resets the reconnect backoff
_INFO_INTERVAL_S = 1.0


class _Expired:
    """Queued by a stream's deadline timer: what came before it is still delivered, then TimeoutError."""


_EXPIRED = _Expired()


class RequestStream:
    """The updates of one submitted request, in batches; closing it early aborts the request.

    Use as `async with client.submit(add) as stream: async for updates in stream: ...`.
    Each batch holds every update that arrived since the previous one (usually one per
    step; more when the consumer fell behind), and the last batch ends with the final one.
    With a `deadline` (event-loop time), the first wait that ends past it raises TimeoutError;
    one timer per request does that, not a timeout context per update (a token's host cost).
    """

    def __init__(self, client: SchedulerClient, request_id: str, deadline: float | None = None) -> None:
        self.request_id = request_id
        self._client = client
        self._queue: asyncio.Queue[RequestUpdate | _Expired] = asyncio.Queue()
        self._final_pushed = False  # the scheduler is done with it: no abort needed
        self._final_taken = False  # the consumer has seen the final update
        self._expired = False
        self.output_token_ids: list[int] = []  # received so far: what a re-submission reports
        self._timer = (None if deadline is None
                       else asyncio.get_running_loop().call_at(deadline, self._queue.put_nowait, _EXPIRED))

    def _push(self, update: RequestUpdate) -> None:
        self._final_pushed = self._final_pushed or update.is_final
        self.output_token_ids.extend(update.token_ids)
        self._queue.put_nowait(update)

    def __aiter__(self) -> AsyncIterator[list[RequestUpdate]]:
        return self

    async def __anext__(self) -> list[RequestUpdate]:
        if self._final_taken:
            raise StopAsyncIteration
        if self._expired:
            raise TimeoutError
        batch: list[RequestUpdate] = []
        item = await self._queue.get()
        while True:
            if isinstance(item, _Expired):
                self._expired = True
                if not batch:
                    raise TimeoutError
                break
            batch.append(item)
            if item.is_final or self._queue.empty():
                break
            item = self._queue.get_nowait()
        self._final_taken = batch[-1].is_final
        return batch

    def close(self) -> None:
        """Stop following the request; abort it in the scheduler if it is still running."""
        if self._timer is not None:
            self._timer.cancel()
        if not self._final_pushed:
            self._final_pushed = True
            self._client._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class SchedulerClient:
    """Owns the Connect stream; `submit` requests, `get_info` for the served model's limits."""

    def __init__(self, address: str, backoff_initial_s: float = 0.05, backoff_max_s: float = 5.0,
                 info_timeout_s: float = 5.0, resume_timeout_s: float = 120.0, tls: TlsFiles | None = None,
                 step_socket: bool = True) -> None:
        self.address = address
        self._tls = tls  # mutual TLS to the scheduler; None: plaintext
        # Where the scheduler's step socket is dialed (None: never, the stream is gRPC's Connect).
        self._step_host = step_socket_host(address) if step_socket and tls is None else None
        self._socket_fallback = StepSocketFallback("scheduler")  # gRPC for a while where the socket never answers
        self._resume_timeout_s = resume_timeout_s
        self._submitted: dict[str, AddRequest] = {}  # live requests as first submitted
        self._connection_generation = 0
        self.accepting = True  # False once shutting down: new requests are refused
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._info_timeout_s = info_timeout_s
        # Names this process's requests to the scheduler: after a scheduler restart it drops the
        # journaled requests of this id that `_resubmit` did not send again (they had finished).
        self.frontend_id = uuid.uuid4().hex
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: dict[str, AddRequest] = {}
        self._pending_aborts: list[str] = []
        self._flush_scheduled = False
        self._outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None] | None = None
        self._info: SchedulerInfo | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Called with True when the stream is up and the scheduler ready, False when lost.
        self.on_ready_change: list[Callable[[bool], None]] = []
        # Called per worker step received with the seconds since its tokens reached the worker's host.
        self.on_step_transit: Callable[[float], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-client")

    async def close(self) -> None:
        self.on_ready_change.clear()  # shutting down: nobody needs to hear about it
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def get_info(self) -> SchedulerInfo:
        """The scheduler's description of the model, cached from the last (re)connect.

        While the stream is down after having been up (a scheduler restarting), the last
        description still holds: new requests are validated with it and wait, like the held
        ones, for the next scheduler (see `submit`). Connected but not ready (no live worker)
        and never connected are UNAVAILABLE.
        """
        if self._info is None or (self._outbox is not None and not self.is_ready):
            raise UnavailableError(f"the scheduler at {self.address} is not connected or not ready yet")
        return self._info

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests -----------------------------------------------------------------------

    def submit(self, request: AddRequest, deadline: float | None = None) -> RequestStream:
        """Queue `request` for the scheduler; its updates arrive on the returned stream (reading it
        raises TimeoutError once event-loop time `deadline` has passed; None: never).

        While disconnected (after a first connection) it is held with the unfinished requests:
        sent when a scheduler is back, failed with them if none is within the resume timeout.
        """
        if not self.accepting:
            raise UnavailableError("this frontend is shutting down: retry (another replica takes it)")
        if self._info is None:
            raise UnavailableError(f"the scheduler at {self.address} is not connected")
        if request.request_id in self._streams:
            raise InvalidArgumentError(f"request_id={request.request_id!r} is already in use")
        stream = RequestStream(self, request.request_id, deadline)
        self._streams[request.request_id] = stream
        self._submitted[request.request_id] = request
        self._pending_adds[request.request_id] = request
        self._schedule_flush()
        return stream

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._submitted.pop(request_id, None)
        if self._pending_adds.pop(request_id, None) is None:
            self._pending_aborts.append(request_id)  # it was sent, so the scheduler must drop it
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send this loop iteration's adds (then aborts) as one message each."""
        self._flush_scheduled = False
        if self._outbox is None:
            return  # disconnected: they wait for the next stream (`_resubmit`) or the resume timeout
        adds, self._pending_adds = list(self._pending_adds.values()), {}
        aborts, self._pending_aborts = self._pending_aborts, []
        batch = []
        for add in adds:
            try:
                batch.append(wire.add_request_to_proto(add, self.frontend_id))
            except ValueError as exc:  # a value its wire type cannot carry, which validation should have caught
                logger.error("request %s cannot be sent to the scheduler: %s", add.request_id, exc)
                # Fail it alone, as if the scheduler had refused it; the others in `adds` still go.
                self._dispatch(wire.rejection_to_proto(add.request_id, InvalidArgumentError(
                    f"request {add.request_id!r} cannot be sent to the scheduler: {exc}")))
        if batch:
            self._outbox.put_nowait(wire.add_requests_to_proto(batch))
        if aborts:
            self._outbox.put_nowait(wire.abort_requests_to_proto(aborts))

    def _dispatch(self, response: scheduler_pb2.ConnectResponse) -> None:
        if response.WhichOneof("message") != "step":
            return
        sampled_unix_ns = response.step.sampled_unix_ns
        if sampled_unix_ns and self.on_step_transit is not None:
            self.on_step_transit(seconds_since_unix_ns(sampled_unix_ns))
        for msg in response.step.updates:
            stream = self._streams.get(msg.request_id)
            if stream is None:
                continue  # aborted by us, or a late update for a finished request
            update = wire.update_from_proto(msg)
            if update.is_final:
                del self._streams[msg.request_id]
                self._submitted.pop(msg.request_id, None)
            stream._push(update)

    def _resubmit(self) -> None:
        """Re-submit every unfinished request on a new stream, with what its client already has."""
        for request_id, stream in self._streams.items():
            if request_id in self._pending_adds:
                continue  # never sent (it came while disconnected): it goes as it is
            add = dataclasses.replace(self._submitted[request_id], output_token_ids=list(stream.output_token_ids),
                                      resumed=True)
            self._pending_adds[request_id] = add
        if self._streams:
            logger.info("re-submitted %d unfinished request(s) to the scheduler at %s", len(self._streams),
                        self.address)
            self._schedule_flush()

    def _expire_held(self, generation: int) -> None:
        """No scheduler came back in time: fail the requests held since the stream broke."""
        if generation == self._connection_generation and not self.is_ready and self._streams:
            self._fail_all(f"lost the connection to the scheduler at {self.address} and it did not come back "
                           f"within {self._resume_timeout_s:.0f} s")

    def _fail_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        self._submitted.clear()
        self._pending_adds.clear()
        self._pending_aborts.clear()
        for request_id, stream in streams.items():
            stream._push(RequestUpdate(request_id=request_id, error=UnavailableError(message)))

    # ---- connection ---------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = self._backoff_initial_s
        while True:
            channel = open_channel(self.address, self._tls)
            try:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                info = await self._wait_until_ready(stub)
                outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None] = asyncio.Queue()
                self._outbox, self._info = outbox, info
                self._connection_generation += 1
                self._resubmit()
                self._flush()  # the re-submissions, then the marker saying they are all there
                outbox.put_nowait(wire.resubmitted_to_proto(self.frontend_id))
                self._set_ready(True)
                on_socket = self._step_host is not None and bool(info.step_port) and self._socket_fallback.use_socket()
                logger.info("connected to the scheduler at %s: model %s, max_model_len %d, %d worker(s); "
                            "requests stream over %s", self.address, info.model_id, info.max_model_len,
                            info.num_workers, f"its step socket (port {info.step_port})" if on_socket else "gRPC")
                poller = asyncio.create_task(self._follow_info(stub), name="scheduler-info")
                started = time.monotonic()
                try:
                    broke = await self._stream(stub, info, outbox, on_socket)
                finally:
                    poller.cancel()
                if time.monotonic() - started >= _STABLE_STREAM_S:
                    backoff = self._backoff_initial_s  # a stream that ends at once keeps backing off
                if broke is None:
                    self._log_lost("the scheduler at %s closed the stream", self.address)
                else:
                    self._log_lost("the stream to the scheduler at %s broke: %s", self.address, broke)
            finally:
                if self._outbox is not None:
                    self._outbox.put_nowait(None)
                    self._outbox = None
                    self._connection_generation += 1
                    if self._streams:
                        logger.warning("holding %d unfinished request(s) until a scheduler is back (up to %.0f s)",
                                       len(self._streams), self._resume_timeout_s)
                    asyncio.get_running_loop().call_later(self._resume_timeout_s, self._expire_held,
                                                          self._connection_generation)
                self._set_ready(False)
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)

    async def _stream(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, info: SchedulerInfo,
                      outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None], on_socket: bool) -> str | None:
        """Run the Connect stream until it ends: None where the scheduler closed it, else how it broke.
        `on_socket`: on the scheduler's step socket (gRPC where it cannot be reached)."""
        if on_socket:
            assert self._step_host is not None
            try:
                ended = await dial(self._step_host, info.step_port, outbox, _encode, self._dispatch_payload,
                                   "scheduler", fallback=self._socket_fallback, local_name=info.step_local_socket)
            except StepSocketUnreachableError as exc:
                logger.warning("the scheduler's %s; this stream goes over gRPC", exc)
            except Exception as exc:  # a step message that cannot be read or applied: reconnect, re-submit
                return _unhandled_step(exc)
            else:
                if ended.closed:
                    return None
                return ended.why if ended.code is None else f"{ended.code.name} {ended.why}"
        call = stub.Connect(_drain(outbox))
        try:
            async for response in call:
                self._dispatch(response)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name} {exc.details()}"
        except Exception as exc:
            return _unhandled_step(exc)
        return None

    def _dispatch_payload(self, payload: bytes) -> None:
        self._dispatch(scheduler_pb2.ConnectResponse.FromString(payload))

    @property
    def loss_level(self) -> int:
        """How loudly to log that the scheduler went away: a warning, but info for a frontend
        that drains (SIGTERM), whose scheduler `spindle serve` or a rollout stops alongside."""
        return logging.WARNING if self.accepting else logging.INFO

    def _log_lost(self, message: str, *args: object) -> None:
        logger.log(self.loss_level, message, *args)

    async def _follow_info(self, stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
        """While connected, re-read GetSchedulerInfo every second: readiness follows the workers."""
        while True:
            await asyncio.sleep(_INFO_INTERVAL_S)
            try:
                msg = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest(), timeout=self._info_timeout_s)
            except grpc.aio.AioRpcError:
                continue  # the stream's own failure handling takes over if the scheduler is gone
            self._info = wire.info_from_proto(msg)
            self._set_ready(self._info.ready)

    async def _wait_until_ready(self, stub: scheduler_pb2_grpc.SchedulerServiceStub) -> SchedulerInfo:
        """Poll GetSchedulerInfo with backoff until the scheduler says its workers are ready."""
        backoff = self._backoff_initial_s
        last_log = 0.0
        while True:
            try:
                msg = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest(),
                                                  timeout=self._info_timeout_s)
                info = wire.info_from_proto(msg)
                if info.ready:
                    return info
                state = "reachable, waiting for its workers to be ready"
            except grpc.aio.AioRpcError as exc:
                state = f"not reachable yet ({exc.code().name})"
            if time.monotonic() - last_log >= _PROGRESS_LOG_INTERVAL_S:
                logger.info("scheduler at %s is %s", self.address, state)
                last_log = time.monotonic()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)

    def _set_ready(self, ready: bool) -> None:
        if ready == self._ready.is_set():
            return
        if ready:
            self._ready.set()
        else:
            self._ready.clear()
        for callback in self.on_ready_change:
            callback(ready)


def _unhandled_step(exc: Exception) -> str:
    """Log a step message the client could not read or apply; why its stream ends (the client then
    reconnects and re-submits, rather than stopping and leaving every request waiting)."""
    logger.exception("a step message from the scheduler could not be handled; reconnecting")
    return f"a step message could not be handled ({type(exc).__name__}: {exc})"


def _encode(message: scheduler_pb2.ConnectRequest) -> bytes:
    return message.SerializeToString()


async def _drain(outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None],
                 ) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
    """The request side of the Connect stream: whatever `_flush` queued, until None."""
    while (message := await outbox.get()) is not None:
        yield message
