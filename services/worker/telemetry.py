"""`WorkerTelemetry`: round spans linked to the requests they served, and the worker's metrics.

Batched work is traced once per round, never per token: a `worker.round` span covers a
round's n steps and carries span links to the scheduler spans of the requests it computed.
The round that first carries a request also opens a `worker.prefill` span as the child of the
scheduler's span for it, so every request's own trace reaches the worker (a request's later
rounds are found through their links). Step and round durations are histograms. Called from the compute thread (the
OpenTelemetry SDK and prometheus_client are thread-safe); with tracing off only the
histograms are updated.
"""

from __future__ import annotations

import time

from opentelemetry.trace import Link, SpanContext
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.worker.head_screen_metric import HeadScreenCollector
from services.worker.step_phases import StepPhaseCollector, StepPhases
from shared.execute import ExecuteRound
from shared.metrics import LATENCY_BUCKETS, STEP_LATENCY_BUCKETS
from shared.tracing import Span, SpanKind, Tracing


class WorkerMetrics:
    """The worker's Prometheus metrics on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.step_duration = Histogram("spindle:worker_step_duration_seconds",
                                       "One forward step, sampling included", buckets=STEP_LATENCY_BUCKETS, registry=r)
        self.round_duration = Histogram("spindle:worker_round_duration_seconds", "One round of n steps",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.rounds_failed = Counter("spindle:worker_rounds_failed", "Rounds that raised", registry=r)
        self.ready = Gauge("spindle:worker_ready", "1 once the model is loaded and rounds can run", registry=r)
        self.encoder_duration = Histogram("spindle:worker_encoder_duration_seconds",
                                          "Encoding one round's images (vision-language models)",
                                          buckets=STEP_LATENCY_BUCKETS, registry=r)
        self.encoder_cache_tokens = Gauge("spindle:worker_encoder_cache_tokens",
                                          "Feature tokens of image encoder outputs the worker holds", registry=r)
        # Which build of the CPU kernels a CPU worker runs (kernels/targets.py): a worker that could
        # neither build nor find one runs torch's ops, several times slower, and says so only in its
        # log; here a dashboard or alert sees it (target="none").
        self.cpu_kernels = Gauge("spindle:worker_cpu_kernels",
                                 "1 for the CPU kernels' build a CPU worker runs: its target and vector "
                                 "instruction sets; target none: torch's ops only", ["target", "instruction_sets"],
                                 registry=r)
        self._step_phases = StepPhaseCollector(StepPhases())  # zeros until a runner reports its own
        r.register(self._step_phases)

    def report_cpu_kernels(self, build: tuple[str, frozenset[str]] | None) -> None:
        """The CPU kernels' build this worker loaded ((target, instruction sets)), or None for none;
        with a build, its LM head screen's counts are exposed too (head_screen_metric.py)."""
        target, sets = build if build is not None else ("none", frozenset())
        self.cpu_kernels.labels(target=target, instruction_sets=" ".join(sorted(sets))).set(1)
        if build is not None:
            self.registry.register(HeadScreenCollector())

    def report_step_phases(self, phases: StepPhases) -> None:
        """Expose these phase totals (the model runner's, step_phases.py) from now on."""
        self._step_phases.phases = phases


class RoundTrace:
    """The telemetry of one round in progress: step timer and (when tracing) its span."""

    __slots__ = ("_metrics", "_span", "_ends_with", "_start", "_last")

    def __init__(self, metrics: WorkerMetrics, span: Span | None, ends_with: list[Span] | None = None) -> None:
        self._metrics = metrics
        self._span = span
        self._ends_with = ends_with or []
        self._start = self._last = time.perf_counter()

    def step_done(self) -> None:
        now = time.perf_counter()
        self._metrics.step_duration.observe(now - self._last)
        self._last = now

    def encoder_done(self, num_images: int, seconds: float, cache_tokens: int) -> None:
        """The round's images were encoded before step 0: histogram, gauge and an `encoder` span event."""
        self._metrics.encoder_duration.observe(seconds)
        self._metrics.encoder_cache_tokens.set(cache_tokens)
        if self._span is not None:
            self._span.add_event("encoder", {"spindle.num_images": num_images, "spindle.encoder_seconds": seconds,
                                             "spindle.encoder_cache_tokens": cache_tokens})

    def end(self, error: BaseException | None = None) -> None:
        self._metrics.round_duration.observe(time.perf_counter() - self._start)
        if error is not None:
            self._metrics.rounds_failed.inc()
        if self._span is not None:
            if error is not None:
                Tracing.fail(self._span, f"{type(error).__name__}: {error}")
            self._span.end()
        for span in self._ends_with:
            span.end()


class WorkerTelemetry:
    """Round and prefill spans (when tracing is on) and the worker's metrics."""

    def __init__(self, tracing: Tracing | None = None, metrics: WorkerMetrics | None = None) -> None:
        self.tracing = tracing or Tracing.disabled()
        self.metrics = metrics or WorkerMetrics()
        # request_id -> the scheduler's span for it, to link later rounds (dropped when finished).
        self._request_spans: dict[str, SpanContext] = {}

    def start_round(self, round_: ExecuteRound) -> RoundTrace:
        """Called in the compute thread just before the round runs."""
        if not self.tracing.enabled:
            return RoundTrace(self.metrics, None)
        known = self._request_spans
        for request_id in round_.finished_request_ids:
            known.pop(request_id, None)
        children = []
        for new in (*round_.new_requests, *round_.pooling_requests):
            link = Tracing.link(new.traceparent)
            if link is None:
                continue
            known[new.request_id] = link.context
            children.append(self.tracing.start_span("worker.prefill", new.traceparent, SpanKind.INTERNAL, {
                "spindle.request_id": new.request_id, "spindle.round_id": round_.round_id,
                "spindle.num_prompt_tokens": len(new.token_ids)}))
        served = [r.request_id for r in round_.new_requests] + round_.cached_requests.request_ids
        served += [p.request_id for p in round_.pooling_requests]
        links = [Link(context) for rid in served if (context := known.get(rid)) is not None]
        span = self.tracing.start_span("worker.round", kind=SpanKind.INTERNAL, links=links, attributes={
            "spindle.round_id": round_.round_id,
            "spindle.num_steps": round_.num_steps,
            "spindle.num_requests": len(served),
            "spindle.num_new_requests": len(round_.new_requests) + len(round_.pooling_requests),
            "spindle.num_scheduled_tokens": sum(round_.num_scheduled_tokens),
            "spindle.num_images_to_encode": len(round_.encoder_hashes),
            "spindle.num_encoder_frees": len(round_.encoder_free_hashes),
        })
        for request in round_.pooling_requests:  # prefill-only: nothing follows this round
            known.pop(request.request_id, None)
        return RoundTrace(self.metrics, span, children)

    def reset(self) -> None:
        """A new Execute stream: the worker forgets every request."""
        self._request_spans.clear()
