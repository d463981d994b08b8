"""The scheduler's Prometheus metrics: queues, KV cache, prefix cache, preemptions, workers.

Event metrics (queue time, steps per round, tokens per step) are observed by
`SchedulerTelemetry` as they happen; state metrics (running / waiting / preempted requests,
KV-cache usage and prefix-cache hits per worker, worker health) are read from the live
`Scheduler` only when Prometheus scrapes, so they cost nothing per step. Names follow vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_state import WorkerState
from shared.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, step_transit_histogram

STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class SchedulerStateCollector(Collector):
    """Reads the scheduler's state at scrape time (on the event loop, so never mid-update)."""

    def __init__(self, get_scheduler: Callable[[], Scheduler | None]) -> None:
        self._get_scheduler = get_scheduler

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        scheduler = self._get_scheduler()
        if scheduler is None:
            return
        model = [scheduler.model_id]
        running = GaugeMetricFamily("spindle:num_requests_running", "Requests in a worker's running batch",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily("spindle:num_requests_waiting", "Requests queued, preempted ones included",
                                    labels=["model_name"])
        preempted = GaugeMetricFamily("spindle:num_requests_preempted",
                                      "Requests preempted and waiting to recompute", labels=["model_name"])
        stats = scheduler.stats()
        running.add_metric(model, stats.num_running)
        waiting.add_metric(model, stats.num_waiting)
        preempted.add_metric(model, sum(
            r.status is RequestStatus.PREEMPTED for ws in scheduler.workers for r in ws.requests.values()))
        yield from (running, waiting, preempted)
        yield from self._per_worker(scheduler)
        outcomes = CounterMetricFamily("spindle:scheduler_requests", "Requests the scheduler ended, by outcome",
                                       labels=["model_name", "outcome"])
        for outcome, count in (("finished", stats.num_finished), ("aborted", stats.num_aborted),
                               ("failed", stats.num_failed)):
            outcomes.add_metric([*model, outcome], count)
        yield outcomes

    @staticmethod
    def _per_worker(scheduler: Scheduler) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["model_name", "worker"]
        usage = GaugeMetricFamily("spindle:kv_cache_usage_perc", "Fraction of the worker's KV blocks in use (0-1)",
                                  labels=labels)
        blocks = GaugeMetricFamily("spindle:num_kv_blocks", "KV blocks the worker holds", labels=labels)
        queries = CounterMetricFamily("spindle:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=labels)
        hits = CounterMetricFamily("spindle:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   labels=labels)
        hit_rate = GaugeMetricFamily("spindle:prefix_cache_hit_rate", "Prefix-cache hits / queries since start",
                                     labels=labels)
        preemptions = CounterMetricFamily("spindle:num_preemptions", "Preemptions (blocks ran out)", labels=labels)
        healthy = GaugeMetricFamily("spindle:worker_healthy", "1 while the worker's stream is up, else 0",
                                    labels=labels)
        rounds = CounterMetricFamily("spindle:worker_rounds", "Rounds sent to the worker", labels=labels)
        encoder = EncoderCacheMetrics(labels)
        for ws in scheduler.workers:
            key = [scheduler.model_id, str(ws.index)]
            healthy.add_metric(key, 1.0 if ws.is_alive else 0.0)
            preemptions.add_metric(key, ws.num_preemptions)
            rounds.add_metric(key, ws.num_rounds)
            encoder.add(key, ws)
            kv = ws.kv
            if kv is None:
                continue
            usage.add_metric(key, 1.0 - kv.num_free_blocks / kv.num_blocks if kv.num_blocks else 0.0)
            blocks.add_metric(key, kv.num_blocks)
            queries.add_metric(key, kv.num_query_tokens)
            hits.add_metric(key, kv.num_hit_tokens)
            hit_rate.add_metric(key, kv.num_hit_tokens / kv.num_query_tokens if kv.num_query_tokens else 0.0)
        yield from (usage, blocks, queries, hits, hit_rate, preemptions, healthy, rounds)
        yield from encoder.families()


class EncoderCacheMetrics:
    """Per-worker encoder-cache families (vision-language models; empty for others)."""

    def __init__(self, labels: list[str]) -> None:
        self.usage = GaugeMetricFamily("spindle:encoder_cache_usage_perc",
                                       "Fraction of the worker's encoder-cache budget holding image features (0-1)",
                                       labels=labels)
        self.encoded = CounterMetricFamily("spindle:encoder_items_encoded", "Images the worker was told to encode",
                                           labels=labels)
        self.hits = CounterMetricFamily("spindle:encoder_cache_hits",
                                        "Images a chunk needed that were cached or being encoded already",
                                        labels=labels)

    def add(self, key: list[str], ws: WorkerState) -> None:
        if ws.encoder is None:
            return
        self.usage.add_metric(key, ws.encoder.usage)
        self.encoded.add_metric(key, ws.encoder.num_encoded)
        self.hits.add_metric(key, ws.encoder.num_hits)

    def families(self) -> tuple[GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return self.usage, self.encoded, self.hits


class SchedulerMetrics:
    """Event histograms plus the state collector, on one registry."""

    def __init__(self, get_scheduler: Callable[[], Scheduler | None],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.queue_time = Histogram("spindle:request_queue_time_seconds",
                                    "Arrival at the scheduler to first admission", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.round_steps = Histogram("spindle:round_num_steps", "Forward steps per round (multi-step)",
                                     buckets=STEP_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("spindle:iteration_tokens_total", "Tokens computed per forward step",
                                          buckets=TOKEN_BUCKETS, registry=r)
        self.step_transit = step_transit_histogram(r, "worker_to_scheduler")
        self.registry.register(SchedulerStateCollector(get_scheduler))
