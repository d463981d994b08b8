"""The frontend's Prometheus metrics: what clients experience, per request.

Names and labels follow vLLM's (`vllm:time_to_first_token_seconds` becomes
`spindle:time_to_first_token_seconds`), so its Grafana dashboards work with a prefix change.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, step_transit_histogram


class FrontendMetrics:
    """Every frontend metric, registered on `registry`, labelled with the served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._success = Counter("spindle:request_success", "Requests finished, by finish reason",
                                [*labels, "finished_reason"], registry=r)
        self._failure = Counter("spindle:request_failure", "Requests that failed, by error kind",
                                [*labels, "error"], registry=r)
        self.prompt_tokens = Counter("spindle:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("spindle:generation_tokens", "Generated tokens", labels,
                                         registry=r).labels(model_name)
        self.cached_prompt_tokens = Counter("spindle:prompt_tokens_cached",
                                            "Prompt tokens served from the prefix cache", labels,
                                            registry=r).labels(model_name)
        self.time_to_first_token = Histogram("spindle:time_to_first_token_seconds",
                                             "Arrival to first generated token", labels, buckets=LATENCY_BUCKETS,
                                             registry=r).labels(model_name)
        self.inter_token_latency = Histogram("spindle:inter_token_latency_seconds",
                                             "Time between consecutive output chunks of a stream", labels,
                                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e_latency = Histogram("spindle:e2e_request_latency_seconds", "Arrival to the last output",
                                     labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_prompt_tokens = Histogram("spindle:request_prompt_tokens", "Prompt tokens per request",
                                               labels, buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.request_generation_tokens = Histogram("spindle:request_generation_tokens",
                                                   "Generated tokens per request", labels, buckets=TOKEN_BUCKETS,
                                                   registry=r).labels(model_name)
        self.step_transit = step_transit_histogram(r, "worker_to_frontend")
        self.requests_in_flight = Gauge("spindle:frontend_requests_in_flight",
                                        "Requests this frontend is streaming now", labels,
                                        registry=r).labels(model_name)
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):  # every series exists from start-up, at 0
            self._success.labels(model_name, reason)

    def finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()

    def failed(self, error: str) -> None:
        self._failure.labels(self._model_name, error).inc()
