"""`SchedulerTelemetry`: one span per request in the scheduler, plus the event metrics.

A request's span is the child of the frontend's (its `traceparent`) and lives from arrival to
finish; admission, preemption and the first token are events on it, and at the end it carries
the queue time, prefix-cache hits, preemptions and output tokens. Workers receive this span's
context, so their spans join the same trace. With tracing off only metrics are updated.
"""

from __future__ import annotations

import time

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.observer import RequestObserver
from services.scheduler.request import Request
from shared.execute import ExecuteRound
from shared.tracing import Span, SpanKind, Tracing, format_traceparent
from shared.types import StopReason


class _RequestTrace:
    __slots__ = ("arrival", "span", "queue_time_s")

    def __init__(self, arrival: float, span: Span | None) -> None:
        self.arrival = arrival
        self.span = span
        self.queue_time_s: float | None = None


class SchedulerTelemetry(RequestObserver):
    """Spans (when tracing is on) and metrics for every request the scheduler handles."""

    def __init__(self, tracing: Tracing, metrics: SchedulerMetrics) -> None:
        self.tracing = tracing
        self.metrics = metrics
        self._requests: dict[str, _RequestTrace] = {}

    def on_added(self, request: Request, worker_index: int) -> None:
        known = self._requests.get(request.request_id)
        if known is not None:  # moved off a failed worker
            if known.span is not None:
                known.span.add_event("moved", {"spindle.worker": worker_index})
            return
        span = None
        if self.tracing.enabled:
            span = self.tracing.start_span("scheduler.request", request.traceparent, SpanKind.INTERNAL, {
                "spindle.request_id": request.request_id,
                "spindle.worker": worker_index,
                "spindle.priority": request.priority,
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            })
            request.span_traceparent = format_traceparent(span)
        self._requests[request.request_id] = _RequestTrace(time.monotonic(), span)

    def on_admitted(self, request: Request, worker_index: int, num_hit_tokens: int) -> None:
        trace = self._requests.get(request.request_id)
        if trace is None:
            return
        first = trace.queue_time_s is None
        if first:
            trace.queue_time_s = time.monotonic() - trace.arrival
            self.metrics.queue_time.observe(trace.queue_time_s)
        if trace.span is not None:
            trace.span.add_event("scheduled" if first else "resumed", {
                "spindle.worker": worker_index, "spindle.prefix_cache_hit_tokens": num_hit_tokens})

    def on_preempted(self, request: Request, worker_index: int) -> None:
        trace = self._requests.get(request.request_id)
        if trace is not None and trace.span is not None:
            trace.span.add_event("preempted", {"spindle.worker": worker_index,
                                               "spindle.output_tokens": request.num_output_tokens})

    def on_first_token(self, request: Request) -> None:
        trace = self._requests.get(request.request_id)
        if trace is not None and trace.span is not None:
            trace.span.add_event("first_token")
            trace.span.set_attribute("spindle.time_to_first_token_s", time.monotonic() - trace.arrival)

    def on_finished(self, request: Request, reason: StopReason | None, worker_index: int) -> None:
        trace = self._requests.pop(request.request_id, None)
        if trace is None or trace.span is None:
            return
        span = trace.span
        span.set_attributes({
            "gen_ai.usage.output_tokens": request.num_output_tokens,
            "gen_ai.response.finish_reasons": [reason.name.lower() if reason is not None else "error"],
            "spindle.prefix_cache_hit_tokens": request.num_cached_tokens,
            "spindle.preemptions": request.num_preemptions,
            "spindle.queue_time_s": trace.queue_time_s or 0.0,
        })
        if reason is None:
            Tracing.fail(span, "the request failed")
        span.end()

    def on_step_output(self, worker_index: int, transit_s: float) -> None:
        self.metrics.step_transit.observe(transit_s)

    def on_round(self, worker_index: int, round_: ExecuteRound, num_samplers: int) -> None:
        m = self.metrics
        m.round_steps.observe(round_.num_steps)
        step0 = sum(round_.num_scheduled_tokens) + sum(len(p.token_ids) for p in round_.pooling_requests)
        m.iteration_tokens.observe(step0)
        for _ in range(round_.num_steps - 1):
            m.iteration_tokens.observe(num_samplers)
