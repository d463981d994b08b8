"""`RoundPipeline`: runs one Execute stream's rounds on the single compute thread, in order.

Rounds go to a one-thread executor as they arrive (so the next round is queued while the
current one computes); each step's `SampledStep` (or `PooledStep`) comes back through an
asyncio queue fed with `loop.call_soon_threadsafe`, and is converted to a `StepOutput` here,
on the event loop, not in the compute thread. An `AbortRows` between rounds skips the queue:
it is handed to the runner the moment it arrives (`Runner.abort` is thread-safe), because the
round it concerns is usually the one computing. A failed round ends the stream with its
exception; later rounds are skipped. No grpc or protobuf here.

The compute thread should also be the thread that loaded the model (`compute_thread()`, used by
the worker's entry point): every thread that runs a parallel torch op keeps its own OpenMP
team, and with more OpenMP threads than cores libgomp stops spinning between parallel regions
(its "throttled" wait), so each of a decode step's ~60 regions waits for a sleeping thread to
wake. Loading on one thread and computing on another measured a medium single-stream step at
22-27 ms against 13.5-15.3 ms with both on one thread (2-core AMD EPYC).

After handing a step to the event loop the compute thread yields its core once
(`os.sched_yield`). Why: the hand-off wakes the event loop's thread, which often lands on the
compute thread's own core, and Linux lets the busy compute thread finish its time slice first
(milliseconds), so that step's tokens waited in the worker. `perf sched timehist` showed the
event loop's thread runnable but off a core for 3-5 ms a few times a second at one stream of
the small model. The yield lets it send the tokens now, for one system call a step, but the
compute thread runs again only once the event loop, gRPC's poller thread and the event loop again
have each had the core: at one stream of the small model (bf16, 2-core AMD EPYC Zen 4,
2026-12-01, timestamps from the hand-off, medians) the message was built at 60 us, its send
complete at 145 and the compute thread back at 154, ~0.15 ms of a 0.68 ms served step (README,
"Measured on 2026-12-01 (third session)"). Where the worker's threads are bound, the event loop
always shares the compute thread's core (services/cpu_affinity.py `compute_core`), so the yield
is what lets it run. Unbound, where the woken thread lands on the second core instead, the work
pool's helper there gives way to it (kernels/csrc/work_pool.cpp: SCHED_IDLE helpers). With both,
ITL p99 at one stream of the small model came down from 5-6x its median to about 3x (figures in
the README, "CPU speed").
SPINDLE_DISABLE_STEP_YIELD=1 turns the yield off (side-by-side runs).

With `send_step` (the step socket, services/worker/step_socket.py) none of that happens: the
compute thread converts each step and writes it to the socket itself, and `run` yields nothing;
only a failure still comes back through the queue, after the steps written before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from services.worker.step_output import StepResult
from services.worker.telemetry import WorkerTelemetry
from shared.errors import UnavailableError
from shared.execute import AbortRows, ExecuteRound, StepOutput
from shared.switches import switch_on

logger = logging.getLogger(__name__)

# Give the core to the event loop after each step's hand-off (module docstring); Linux has it.
YIELD_AFTER_STEP = hasattr(os, "sched_yield") and not switch_on("SPINDLE_DISABLE_STEP_YIELD")


class _ReaderGoneError(Exception):
    """Raised in the compute thread when the stream's event loop has closed, to stop the round."""


class Runner(Protocol):
    """What the pipeline drives: `ModelRunner` (generative) or `PoolingRunner` (prefill-only)."""

    def reset(self) -> None: ...

    def execute_round(self, round_: ExecuteRound, on_step: Callable[[StepResult], None]) -> None: ...

    def abort(self, request_ids: list[str]) -> None:
        """Called from the event loop while a round may be computing: stop computing these."""
        ...


class RoundFailedError(Exception):
    """A round raised in the compute thread; `cause` holds the original exception."""

    def __init__(self, round_id: int, cause: BaseException) -> None:
        super().__init__(f"round {round_id} failed: {type(cause).__name__}: {cause}")
        self.round_id = round_id
        self.cause = cause


def compute_thread() -> ThreadPoolExecutor:
    """The one thread that loads the model and then runs its rounds (see the module docstring)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="spindle-compute")


class RoundPipeline:
    """Serialises Execute streams onto the worker's compute thread (one stream at a time)."""

    def __init__(self, runner: Runner, telemetry: WorkerTelemetry | None = None, fail_round: int = 0,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.runner = runner
        self.telemetry = telemetry or WorkerTelemetry()
        # Fault injection for tests (--fault-fail-round): the n-th round this process runs raises once.
        self._fail_round = fail_round
        self._num_rounds_run = 0
        self.executor = executor or compute_thread()  # pass the thread that loaded the runner's model
        self._active = False

    def _reset(self) -> None:
        self.runner.reset()
        self.telemetry.reset()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, rounds: AsyncIterator[ExecuteRound | AbortRows],
                  send_step: Callable[[StepOutput], None] | None = None) -> AsyncIterator[StepOutput]:
        """Step outputs of `rounds`, in order; raises RoundFailedError when a round fails.

        With `send_step`, the compute thread hands each step output to it instead (and nothing
        is yielded); an OSError from it (the peer is gone) stops the rounds and is raised here.
        """
        if self._active:
            raise UnavailableError("another Execute stream is active on this worker")
        self._active = True
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StepResult | BaseException | None] = asyncio.Queue()
        failed = threading.Event()

        def hand_over(item: StepResult | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop closed (the worker is stopping): nobody reads any more
                failed.set()
                raise _ReaderGoneError from None

        def deliver(item: StepResult | BaseException) -> None:
            if send_step is None or isinstance(item, BaseException):
                hand_over(item)
                if YIELD_AFTER_STEP:
                    os.sched_yield()
                return
            try:
                send_step(item.to_step_output())
            except OSError as exc:  # the reader is gone or stopped reading: tell `run`, stop the rounds
                failed.set()
                hand_over(exc)
                raise _ReaderGoneError from None

        def execute(round_: ExecuteRound) -> None:
            if failed.is_set():
                return  # an earlier round failed: the state is no longer trustworthy
            trace = self.telemetry.start_round(round_)

            def on_timed_step(step: StepResult) -> None:
                trace.step_done()
                deliver(step)

            try:
                self._num_rounds_run += 1
                if self._num_rounds_run == self._fail_round:
                    raise RuntimeError(f"injected fault: round {self._num_rounds_run} of this worker fails")
                self.runner.execute_round(round_, on_timed_step)
                encoder = getattr(self.runner, "encoder_cache", None)  # vision-language models only
                if encoder is not None and round_.encoder_hashes:
                    trace.encoder_done(len(round_.encoder_hashes), encoder.last_encode_seconds, encoder.num_tokens)
                trace.end()
            except _ReaderGoneError:
                trace.end()
                logger.info("round %d stopped: nobody reads its steps any more", round_.round_id)
            except Exception as exc:
                trace.end(exc)
                failed.set()
                logger.exception("round %d failed", round_.round_id)
                with contextlib.suppress(_ReaderGoneError):
                    deliver(RoundFailedError(round_.round_id, exc))

        async def feed() -> None:
            # The executor's own futures: a round that ends does not wake the event loop (which
            # shares the compute thread's core and would preempt it in its next round); only
            # those still running when the stream ends are awaited.
            pending: list[concurrent.futures.Future[None]] = []
            try:
                async for round_ in rounds:
                    if failed.is_set():
                        break
                    if isinstance(round_, AbortRows):
                        self.runner.abort(round_.request_ids)
                        continue
                    pending = [f for f in pending if not f.done()]
                    pending.append(self.executor.submit(execute, round_))
                await asyncio.gather(*map(asyncio.wrap_future, pending))
            except Exception as exc:  # the request stream itself broke (bad message, cancelled peer)
                failed.set()
                queue.put_nowait(exc)
            queue.put_nowait(None)

        try:
            await loop.run_in_executor(self.executor, self._reset)  # a stream starts from scratch
            feeder = asyncio.create_task(feed())
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item.to_step_output()
            finally:
                failed.set()
                feeder.cancel()
        finally:
            self._active = False
