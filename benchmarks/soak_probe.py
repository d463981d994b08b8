"""Look at a running `spindle serve` from outside: its service processes, their memory, and the
scheduler's and frontend's own account of open requests and KV blocks.

Everything is read the way an operator would: processes and resident memory from /proc, KV
usage from the scheduler's Prometheus /metrics (`spindle:kv_cache_usage_perc` counts a block
that only the prefix cache holds as free, so an idle server reads 0), queue sizes from
GetSchedulerInfo, and requests in flight from the frontend's /metrics.
"""

from __future__ import annotations

import logging
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from shared.pb.spindle.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.faults import flag
from tests.e2e.server import descendants

logger = logging.getLogger(__name__)

SERVICES = ("frontend", "scheduler", "worker")


@dataclass(frozen=True, slots=True)
class ServiceProcess:
    name: str  # frontend, scheduler, worker-0, worker-1, ...
    pid: int
    cmdline: list[str]


def service_processes(launcher_pid: int) -> list[ServiceProcess]:
    """The services `spindle serve` (pid `launcher_pid`) runs now; workers numbered in start order."""
    found: dict[str, list[tuple[int, list[str]]]] = {s: [] for s in SERVICES}
    for pid in descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # exited meanwhile
        for service in SERVICES:
            if f"services.{service}" in cmdline:
                found[service].append((pid, cmdline))
    out = []
    for service, procs in found.items():
        for i, (pid, cmdline) in enumerate(sorted(procs)):
            out.append(ServiceProcess(f"{service}-{i}" if service == "worker" else service, pid, cmdline))
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (VmRSS); 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_metrics(port: int) -> str:
    """The Prometheus text a local service serves at /metrics on `port` (blocking; raises OSError)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric `name` in a Prometheus text exposition."""
    return [(sample.labels, sample.value) for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name]


def worker_phase_seconds(port: int) -> tuple[dict[str, float], float] | None:
    """The worker's step phase totals (seconds by phase, services/worker/step_phases.py) and its step
    count so far, from its /metrics at `port`; None (logged) when that cannot be read."""
    try:
        text = read_metrics(port)
    except OSError as exc:
        logger.warning("worker metrics on port %d unreadable: %s", port, exc)
        return None
    steps = sum(v for _, v in metric_samples(text, "spindle:worker_step_duration_seconds_count"))
    return ({labels["phase"]: seconds
             for labels, seconds in metric_samples(text, "spindle:worker_step_phase_seconds_total")}, steps)


SLOW_TRANSIT_S = 0.005  # a bucket bound of spindle:step_transit_seconds (shared/metrics.py)


def step_transit_from_text(text: str, hop: str) -> dict[str, float] | None:
    """`spindle:step_transit_seconds{hop}` in an exposition: the mean in ms and the share of steps
    whose tokens took over SLOW_TRANSIT_S to arrive; None when it has no observation."""
    def total(suffix: str, le: float | None = None) -> float:
        return sum(value for labels, value in metric_samples(text, f"spindle:step_transit_seconds{suffix}")
                   if labels.get("hop") == hop and (le is None or float(labels["le"]) == le))

    count = total("_count")
    if count <= 0:
        return None
    return {"mean_ms": total("_sum") / count * 1e3,
            "share_over_5_ms": 1.0 - total("_bucket", SLOW_TRANSIT_S) / count}


def frontend_step_transit(port: int) -> dict[str, float] | None:
    """`step_transit_from_text` for the frontend's worker_to_frontend series at `port`; None
    (logged) when its /metrics cannot be read."""
    try:
        return step_transit_from_text(read_metrics(port), "worker_to_frontend")
    except OSError as exc:
        logger.warning("frontend metrics on port %d unreadable: %s", port, exc)
        return None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The server at one moment."""

    pids: dict[str, int]
    rss: dict[str, int]  # bytes, by service name
    kv_used_blocks: int  # over all workers; blocks only the prefix cache holds count as free
    kv_blocks: int
    running: int
    waiting: int
    frontend_in_flight: int
    preemptions: int

    @property
    def idle(self) -> bool:
        return (self.kv_used_blocks, self.running, self.waiting, self.frontend_in_flight) == (0, 0, 0, 0)


class Probe:
    """Snapshots of `spindle serve` started with `--metrics-port metrics_port` (frontend there, scheduler +1)."""

    def __init__(self, launcher_pid: int, metrics_port: int) -> None:
        self.launcher_pid = launcher_pid
        self.metrics_port = metrics_port
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        scheduler = next((p for p in service_processes(launcher_pid) if p.name == "scheduler"), None)
        if scheduler is None:
            raise RuntimeError(f"spindle serve (pid {launcher_pid}) runs no scheduler process")
        self._channel = grpc.aio.insecure_channel(flag(scheduler.cmdline, "--listen"))
        self.scheduler = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)

    async def info(self) -> scheduler_pb2.GetSchedulerInfoResponse:
        return await self.scheduler.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest(), timeout=10)

    async def _metrics(self, port: int) -> str:
        async with self._http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            resp.raise_for_status()
            return await resp.text()

    async def snapshot(self) -> Snapshot:
        procs = service_processes(self.launcher_pid)
        info = await self.info()
        scheduler_metrics = await self._metrics(self.metrics_port + 1)
        frontend_metrics = await self._metrics(self.metrics_port)
        blocks = {labels.get("worker", ""): value
                  for labels, value in metric_samples(scheduler_metrics, "spindle:num_kv_blocks")}
        used = sum(round(value * blocks.get(labels.get("worker", ""), 0.0))
                   for labels, value in metric_samples(scheduler_metrics, "spindle:kv_cache_usage_perc"))
        in_flight = sum(v for _, v in metric_samples(frontend_metrics, "spindle:frontend_requests_in_flight"))
        return Snapshot(pids={p.name: p.pid for p in procs}, rss={p.name: rss_bytes(p.pid) for p in procs},
                        kv_used_blocks=int(used), kv_blocks=int(sum(blocks.values())),
                        running=info.stats.num_running, waiting=info.stats.num_waiting,
                        frontend_in_flight=int(in_flight), preemptions=info.stats.num_preemptions)

    async def close(self) -> None:
        await self._http.close()
        await self._channel.close()
