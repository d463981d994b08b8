"""Prometheus `/metrics` for every service, served on its own port from the service's event loop.

Each service defines its metrics in its own `metrics.py` on a `CollectorRegistry` it owns
(tests make fresh ones); `serve_metrics` exposes that registry. Serving from the event loop,
not prometheus_client's thread, means collectors that read live scheduler or worker state
never race the loop that mutates it. Names follow vLLM's (`spindle:` instead of `vllm:`), so
its dashboards and alerts carry over.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest

logger = logging.getLogger(__name__)

# Latency buckets (seconds) shared by the request histograms: sub-millisecond host work up to
# multi-minute generations.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# Token-count buckets (prompt lengths, tokens per step).
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Per-step times: steps on a CPU take milliseconds, on a GPU tens of microseconds; a step's
# tokens cross a hop between services in tens of microseconds to milliseconds.
STEP_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
                        1.28, 2.56, 5.12)


def seconds_since_unix_ns(unix_ns: int) -> float:
    """Seconds from wall time `unix_ns` to now; 0 where another host's clock runs ahead of ours."""
    return max(time.time_ns() - unix_ns, 0) / 1e9


def step_transit_histogram(registry: CollectorRegistry, hop: str) -> Histogram:
    """spindle:step_transit_seconds{hop}: from the moment a worker step's tokens reached the
    worker's host to their arrival at this service (wall clocks: across hosts, their skew too).
    One series per service kind: worker_to_scheduler, worker_to_frontend; where a token's
    inter-token latency tail comes from when the worker's steps are even."""
    return Histogram("spindle:step_transit_seconds",
                     "A worker step's tokens: from reaching the worker's host to arriving here",
                     ["hop"], buckets=STEP_LATENCY_BUCKETS, registry=registry).labels(hop)


class MetricsServer:
    """A running `/metrics` endpoint; `stop()` it with the service."""

    def __init__(self, runner: web.AppRunner, address: str) -> None:
        self.runner = runner
        self.address = address

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics (port 0: a free one)."""

    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    address = f"{host}:{bound}"
    logger.info("metrics at http://%s/metrics", address)
    return MetricsServer(runner, address)
