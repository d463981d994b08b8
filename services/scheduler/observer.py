"""`RequestObserver`: the hooks a request's life calls, for spans and metrics outside the policy code.

`WorkerState` calls them as it moves a request (added, admitted, preempted, finished), the
output processor at a request's first token, the scheduler once per round sent and the engine
loop once per worker step received. The base class does nothing, so the scheduler core runs the
same with or without telemetry; `telemetry.SchedulerTelemetry` records spans and metrics. Hooks
run per request event, per round or per step, never per token of a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.request import Request
    from shared.execute import ExecuteRound
    from shared.types import StopReason


class RequestObserver:
    """No-op hooks; override the ones you need."""

    def on_added(self, request: Request, worker_index: int) -> None:
        """Accepted and queued on a worker."""

    def on_admitted(self, request: Request, worker_index: int, num_hit_tokens: int) -> None:
        """Waiting -> running: blocks allocated (`num_hit_tokens` found in the prefix cache)."""

    def on_preempted(self, request: Request, worker_index: int) -> None:
        """Blocks freed; it will recompute prompt + output when re-admitted."""

    def on_first_token(self, request: Request) -> None:
        """Its first output token came back from the worker."""

    def on_finished(self, request: Request, reason: StopReason | None, worker_index: int) -> None:
        """Stopped, aborted (reason ABORTED) or failed (reason None)."""

    def on_round(self, worker_index: int, round_: ExecuteRound, num_samplers: int) -> None:
        """A round was sent; `num_samplers` requests decode in each of its steps after step 0."""

    def on_step_output(self, worker_index: int, transit_s: float) -> None:
        """A worker's step arrived `transit_s` after its tokens reached the worker's host (wall clocks,
        0 where the worker's runs ahead)."""


class ObserverGroup(RequestObserver):
    """Calls every hook of each observer in turn (telemetry and the journal, say)."""

    def __init__(self, observers: list[RequestObserver]) -> None:
        self.observers = observers

    def on_added(self, request: Request, worker_index: int) -> None:
        for o in self.observers:
            o.on_added(request, worker_index)

    def on_admitted(self, request: Request, worker_index: int, num_hit_tokens: int) -> None:
        for o in self.observers:
            o.on_admitted(request, worker_index, num_hit_tokens)

    def on_preempted(self, request: Request, worker_index: int) -> None:
        for o in self.observers:
            o.on_preempted(request, worker_index)

    def on_first_token(self, request: Request) -> None:
        for o in self.observers:
            o.on_first_token(request)

    def on_finished(self, request: Request, reason: StopReason | None, worker_index: int) -> None:
        for o in self.observers:
            o.on_finished(request, reason, worker_index)

    def on_round(self, worker_index: int, round_: ExecuteRound, num_samplers: int) -> None:
        for o in self.observers:
            o.on_round(worker_index, round_, num_samplers)

    def on_step_output(self, worker_index: int, transit_s: float) -> None:
        for o in self.observers:
            o.on_step_output(worker_index, transit_s)
