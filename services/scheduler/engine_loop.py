"""`EngineLoop`: the asyncio loop around `Scheduler`: frontends and workers in, rounds and updates out.

Adds, aborts and step outputs are applied the moment they arrive (updates go straight to the
frontend's outbox); each then wakes the loop, which expires deadlines and asks the scheduler
for rounds for every worker with a free round slot. Per wake-up the work is proportional to
what changed plus the rounds built. No protobuf here: servicer.py and worker_client.py convert.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence

from services.scheduler.config import SchedulerConfig
from services.scheduler.info import SchedulerInfo
from services.scheduler.journal import Journal
from services.scheduler.observer import ObserverGroup, RequestObserver
from services.scheduler.output_processor import ProtocolError
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import RequestError, RequestUpdate, StepUpdates, UpdateSink
from services.scheduler.worker_link import WorkerLink
from shared.errors import ErrorKind, UnavailableError
from shared.execute import StepOutput
from shared.logs import request_extra
from shared.metrics import seconds_since_unix_ns
from shared.state_store import StateStore

logger = logging.getLogger(__name__)

# 1: aborts reach a worker only through a later round's finished ids, as before AbortRows
# existed (for side-by-side benchmarks of what early aborts save).
DISABLE_EARLY_ABORTS_ENV = "SPINDLE_DISABLE_EARLY_ABORTS"


class FrontendConnection:
    """One frontend's Connect stream: the StepUpdates waiting to be written (None ends it)."""

    def __init__(self, connection_id: int) -> None:
        self.id = connection_id
        self.outbox: asyncio.Queue[StepUpdates | None] = asyncio.Queue()
        self.input_closed = False  # the frontend half-closed: end once its requests are done


class EngineLoop:
    """Owns the Scheduler once every worker is ready; the servicer talks only to this."""

    def __init__(self, config: SchedulerConfig, links: Sequence[WorkerLink],
                 clock: Callable[[], float] = time.time, observer: RequestObserver | None = None,
                 store: StateStore | None = None) -> None:
        self.config = config
        self.journal = Journal(store, self._live_request)  # no store: no journal (nothing outlives this process)
        self.observer = ObserverGroup([observer, self.journal] if observer is not None else [self.journal])
        # Requests a previous scheduler journaled, waiting for their frontend to re-submit them.
        self._orphans: dict[str, Request] = {}
        self._rejoining: set[int] = set()
        self._draining = False  # shutting down: new requests are refused
        # Called with False when no worker can serve, True when one can again (gRPC health).
        self.on_ready_change: Callable[[bool], None] | None = None
        self.links = list(links)
        self.scheduler: Scheduler | None = None
        self._clock = clock
        self._connections: dict[int, FrontendConnection] = {}
        self._connection_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._last_stats_log = time.monotonic()
        self._last_stats_steps = 0
        self._send_aborts = os.environ.get(DISABLE_EARLY_ABORTS_ENV) != "1"

    # ---- lifecycle ----

    async def start(self) -> None:
        """Wait for every worker, then open their streams and start scheduling."""
        infos = await asyncio.gather(*(link.wait_ready() for link in self.links))
        self.scheduler = Scheduler(self.config, infos, [link.address for link in self.links], self.observer)
        orphans = await self.journal.load()
        if orphans:
            self._orphans = {r.request_id: r for r in orphans}
            logger.info("journal: %d unfinished request(s) from a previous scheduler wait up to %.0f s for their "
                        "frontends", len(orphans), self.config.orphan_timeout_s)
            asyncio.get_running_loop().call_later(self.config.orphan_timeout_s, self._drop_orphans)
        for link in self.links:
            link.open(self._on_output, self._on_failure)
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        info = self.scheduler.info()
        logger.info("%d worker(s) ready: model %s, %d KV blocks x %d tokens in all, max_model_len %d, "
                    "max request %d tokens", info.num_workers, info.model_id, info.num_kv_blocks,
                    info.block_size, info.max_model_len, info.max_request_tokens)

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: refuse new requests; give running ones up to `grace_s` to finish."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self.scheduler is not None and self.scheduler.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = len(self.scheduler.requests) if self.scheduler is not None else 0
        logger.info("drained: %d request(s) left for the next scheduler (journaled; frontends re-submit them)", left)

    async def stop(self) -> None:
        self._stopping = True  # NOTE: a cancel alone can be lost when the wake-up races it
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for conn in self._connections.values():
            conn.outbox.put_nowait(None)
        await asyncio.gather(*(link.close() for link in self.links))
        try:
            await self.journal.drain()
        except Exception as exc:  # the store is down: the next scheduler reads what did land
            logger.error("could not write the last journal batch: %s", exc)

    def info(self) -> SchedulerInfo:
        """The scheduler's description; not ready while it drains or stops, so that a frontend whose
        stream ended waits for the next scheduler rather than re-submitting to this one (which would
        refuse every request as shutting down)."""
        if self.scheduler is None:
            return SchedulerInfo(ready=False)
        info = self.scheduler.info()
        return dataclasses.replace(info, ready=False) if self._draining or self._stopping else info

    # ---- frontends ----

    def connect(self, transport: str = "gRPC") -> FrontendConnection:
        """A frontend's stream began; `transport` (what carries it) is for the log."""
        conn = FrontendConnection(next(self._connection_ids))
        self._connections[conn.id] = conn
        logger.info("frontend connection %d opened (%s)", conn.id, transport)
        return conn

    def disconnect(self, connection_id: int) -> None:
        """The stream ended: abort what the frontend left unfinished."""
        if self._connections.pop(connection_id, None) is None:
            return
        num_aborted = self.scheduler.abort_connection(connection_id) if self.scheduler else 0
        logger.info("frontend connection %d closed (%d unfinished requests aborted)", connection_id,
                    num_aborted)
        self._wake.set()

    def close_input(self, connection_id: int) -> None:
        conn = self._connections.get(connection_id)
        if conn is not None:
            conn.input_closed = True
            self._end_if_done(conn)

    def add_requests(self, connection_id: int, requests: Sequence[Request]) -> None:
        sink = UpdateSink()
        if self.scheduler is None or self._draining:
            why = "is shutting down" if self._draining else "is not ready: waiting for workers"
            error = RequestError(ErrorKind.UNAVAILABLE, f"the scheduler {why}")
            for request in requests:
                sink.add(connection_id, RequestUpdate(request.request_id, error=error))
        else:
            for request in requests:
                request.connection_id = connection_id
                if request.is_resumed:
                    self._adopt(request)
                self.scheduler.add_request(request, sink)
        self._deliver(sink)
        self._wake.set()

    def abort_requests(self, connection_id: int, request_ids: Sequence[str]) -> None:
        if self.scheduler is None:
            return
        sink = UpdateSink()
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.connection_id == connection_id:
                self.scheduler.abort_request(request_id, sink)
        self._deliver(sink)
        self._wake.set()

    def _adopt(self, request: Request) -> None:
        """A frontend re-submitted a request: it replaces the journaled or stale incarnation."""
        assert self.scheduler is not None
        if self._orphans.pop(request.request_id, None) is not None:
            self.journal.replace(request.request_id)
        elif request.request_id in self.scheduler.requests:  # the old stream's copy, not yet aborted
            self.scheduler.abort_request(request.request_id, None)
        logger.debug("resumed after %d output tokens", request.num_output_tokens,
                     extra=request_extra(request.request_id, request.traceparent))

    def drop_orphans_of(self, frontend_id: str) -> None:
        """The frontend re-submitted everything it still follows: its other journaled requests had
        finished before the restart (their last journal write did not land), so drop them now."""
        done = [r.request_id for r in self._orphans.values() if frontend_id and r.frontend_id == frontend_id]
        if done:
            logger.info("journal: dropped %d request(s) that frontend %s no longer follows", len(done),
                        frontend_id)
        self._forget_orphans(done)

    def _drop_orphans(self) -> None:
        if self._orphans:
            logger.warning("journal: %d request(s) were never re-submitted by a frontend; dropped",
                           len(self._orphans))
        self._forget_orphans(list(self._orphans))

    def _forget_orphans(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            del self._orphans[request_id]
            self.journal.forget(request_id)

    def _live_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id) if self.scheduler is not None else None

    @property
    def num_orphans(self) -> int:
        return len(self._orphans)

    # ---- workers ----

    def _on_output(self, worker_index: int, output: StepOutput) -> None:
        assert self.scheduler is not None
        if output.sampled_unix_ns:
            self.observer.on_step_output(worker_index, seconds_since_unix_ns(output.sampled_unix_ns))
        sink = UpdateSink()
        try:
            self.scheduler.update_from_output(worker_index, output, sink)
        except ProtocolError as exc:
            self._fail_worker(worker_index, f"it broke the round protocol: {exc}", sink)
        self.journal.note_progress(output.request_ids)
        self._deliver(sink, output.sampled_unix_ns)
        self._wake.set()

    def _on_failure(self, worker_index: int, message: str) -> None:
        sink = UpdateSink()
        self._fail_worker(worker_index, message, sink)
        self._deliver(sink)
        self._wake.set()

    def _fail_worker(self, worker_index: int, message: str, sink: UpdateSink) -> None:
        """Move the worker's requests elsewhere, then reconnect to it in the background."""
        scheduler = self.scheduler
        assert scheduler is not None
        was_ready = scheduler.has_live_workers
        scheduler.fail_worker(worker_index, message, sink)
        if was_ready and not scheduler.has_live_workers and self.on_ready_change is not None:
            self.on_ready_change(False)
        if worker_index not in self._rejoining and not self._stopping:
            self._rejoining.add(worker_index)
            asyncio.get_running_loop().create_task(self._rejoin(worker_index), name=f"rejoin-worker-{worker_index}")

    async def _rejoin(self, worker_index: int) -> None:
        """Wait for the worker to answer again (restarted or reachable), then give it work."""
        link = self.links[worker_index]
        try:
            await link.reset()
            while True:
                try:
                    info = await link.wait_ready()
                    break
                except UnavailableError:  # --worker-ready-timeout-s passed: keep trying, it may return
                    await asyncio.sleep(1.0)
            scheduler = self.scheduler
            if self._stopping or scheduler is None:
                return
            was_ready = scheduler.has_live_workers
            scheduler.revive_worker(worker_index, info)
            link.open(self._on_output, self._on_failure)
            if not was_ready and self.on_ready_change is not None:
                self.on_ready_change(True)
            self._wake.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("worker %d could not rejoin; it stays out", worker_index)
        finally:
            self._rejoining.discard(worker_index)

    # ---- the loop ----

    async def _run(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        while not self._stopping:
            timeout = self.config.stats_interval_s
            deadline = scheduler.next_deadline()
            if deadline is not None:
                timeout = min(timeout, max(deadline - self._clock(), 0.0))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            self.step()

    def step(self) -> None:
        """One scheduling pass: expire deadlines, send aborts, then a round to every worker that can take one.

        Aborts go first: the worker must see an abort before the round that lists the request
        among its finished ids (round_stops.Aborts).
        """
        scheduler = self.scheduler
        assert scheduler is not None
        sink = UpdateSink()
        scheduler.expire_deadlines(self._clock(), sink)
        self._deliver(sink)
        for index, request_ids in scheduler.take_aborts().items():
            if self._send_aborts:
                self.links[index].abort(request_ids)
        # Until every worker's round slots are full or it has no more work: one round per wake-up
        # left 1-step rounds unpipelined (the second slot filled only when an add or abort woke
        # the loop), so the worker idled through every scheduler round trip.
        while rounds := scheduler.schedule():
            for index, rnd in rounds.items():
                self.links[index].send(rnd)
        self._maybe_log_stats()

    def _deliver(self, sink: UpdateSink, sampled_unix_ns: int = 0) -> None:
        """Each frontend connection's updates as one message (with the worker step's time, if from one)."""
        for connection_id, updates in sink.by_connection.items():
            conn = self._connections.get(connection_id)
            if conn is not None:
                conn.outbox.put_nowait(StepUpdates(updates, sampled_unix_ns))
                if conn.input_closed:
                    self._end_if_done(conn)

    def _end_if_done(self, conn: FrontendConnection) -> None:
        if self.scheduler is None or self.scheduler.num_unfinished(conn.id) == 0:
            conn.outbox.put_nowait(None)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_log < self.config.stats_interval_s or self.scheduler is None:
            return
        s = self.scheduler.stats()
        if s.num_steps != self._last_stats_steps or s.num_running or s.num_waiting:
            logger.info("steps %d (+%d), running %d, waiting %d, preemptions %d, prefix cache hit rate %.1f%%, "
                        "free KV blocks %d/%d, finished %d, aborted %d, failed %d", s.num_steps,
                        s.num_steps - self._last_stats_steps, s.num_running, s.num_waiting, s.num_preemptions,
                        100.0 * s.prefix_hit_rate, s.num_free_blocks, s.num_kv_blocks, s.num_finished,
                        s.num_aborted, s.num_failed)
        self._last_stats_log = now
        self._last_stats_steps = s.num_steps
