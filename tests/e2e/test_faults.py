"""Nothing lost: every accepted request completes with transformers' tokens through each fault.

The faults, each mid-stream, through the real services (`spindle serve`, whose launcher
restarts a dead child as Kubernetes would) with a real redis-server holding the journal:
`kill -9` of the scheduler with 32 streams in flight, `kill -9` of one of two workers, a round
that raises inside the worker, and a Redis restart (AOF on). Afterwards no KV block is in
use, no request is open and the journal is empty.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc
from shared.ports import free_port
from tests.e2e.clients import Generated, grpc_channel
from tests.e2e.faults import RedisServer, child, flag, kill9, redis_server
from tests.e2e.metrics import metric_sum, scrape
from tests.e2e.server import RunningServer, spindle_serve
from tests.e2e.test_scheduler_pressure import assert_matches_oracle, jobs_for, scheduler_stats

pytestmark = pytest.mark.e2e


class Progress:
    """Tokens received so far over every stream, so a fault can strike mid-stream."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.num_done = 0


async def _generate(stub: generation_pb2_grpc.GenerationServiceStub, model: str, prompt: list[int],
                    max_tokens: int, progress: Progress) -> Generated:
    request = generation_pb2.GenerateRequest(model=model, sampling=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0))
    request.token_ids.ids.extend(prompt)
    ids: list[int] = []
    finish = ""
    async for response in stub.Generate(request, timeout=240):
        if response.HasField("chunk"):
            ids.extend(response.chunk.token_ids)
            progress.num_tokens += len(response.chunk.token_ids)
        else:
            finish = generation_pb2.FinishReason.Name(response.complete.finish_reason)
    progress.num_done += 1
    return Generated(ids, "", finish, 0)


def run_with_fault(server: RunningServer, jobs: list[tuple[list[int], int]], fault: Callable[[], None],
                   after_tokens: int = 64) -> list[Generated]:
    """Run every job concurrently; strike `fault` once `after_tokens` tokens arrived, before any finished."""

    async def scenario() -> list[Generated]:
        progress = Progress()
        async with grpc_channel(server.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            tasks = [asyncio.ensure_future(_generate(stub, server.model_name, p, n, progress)) for p, n in jobs]
            while progress.num_tokens < after_tokens:
                await asyncio.sleep(0.005)
            assert progress.num_done < len(jobs), "the fault must strike while streams are running"
            await asyncio.to_thread(fault)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(scenario())


def wait_until_idle(server: RunningServer, metrics_port: int, redis: RedisServer | None = None) -> None:
    """No request open, no KV block in use, the journal empty (within a few seconds of the last token)."""
    _, cmdline = child(server.process.pid, "services.scheduler")
    deadline = time.monotonic() + 20
    while True:
        stats = scheduler_stats(flag(cmdline, "--listen"))
        usage = metric_sum(scrape(metrics_port + 1), "spindle:kv_cache_usage_perc")
        journal = redis.journal_size() if redis is not None else 0
        if (stats.num_running, stats.num_waiting, usage, journal) == (0, 0, 0.0, 0):
            return
        assert time.monotonic() < deadline, f"not idle: {stats}, KV usage {usage}, journal {journal}"
        time.sleep(0.1)


def _serve(model: Path, redis: RedisServer, *args: str, env: dict[str, str] | None = None):  # noqa: ANN202
    metrics_port = free_port(count=4)
    server = spindle_serve(model, "--metrics-port", str(metrics_port), *args,
                           extra_env={"SPINDLE_STATE_STORE": redis.url, **(env or {})})
    return server, metrics_port


def test_scheduler_killed_with_32_streams_in_flight(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_models["llama"]
    jobs = jobs_for(31, count=32, max_out=90)
    with redis_server(tmp_path) as redis:
        serve, metrics_port = _serve(model, redis)
        with serve as server:
            old_pid, _ = child(server.process.pid, "services.scheduler")
            results = run_with_fault(server, jobs, lambda: kill9(old_pid))
            new_pid, _ = child(server.process.pid, "services.scheduler")
            assert new_pid != old_pid, "the launcher restarted the scheduler"
            wait_until_idle(server, metrics_port, redis)
    assert all(r.finish_reason for r in results)
    assert_matches_oracle(model, jobs, results)


def test_one_of_two_workers_killed(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_models["qwen2"]
    jobs = jobs_for(32, count=24, max_out=80)
    with redis_server(tmp_path) as redis:
        serve, metrics_port = _serve(model, redis, "--workers", "2")
        with serve as server:
            doomed, _ = child(server.process.pid, "services.worker", 0)
            results = run_with_fault(server, jobs, lambda: kill9(doomed))
            wait_until_idle(server, metrics_port, redis)
            # The launcher restarted it and it rejoined: both workers serve again.
            deadline = time.monotonic() + 60
            while True:
                if scrape(metrics_port + 1).get('spindle:worker_healthy{model_name="tiny-qwen2",worker="0"}') == 1.0:
                    break
                assert time.monotonic() < deadline, "the killed worker never rejoined"
                time.sleep(0.2)
    assert_matches_oracle(model, jobs, results)


def test_a_round_that_raises_inside_the_worker(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_models["mistral"]
    jobs = jobs_for(33, count=16, max_out=60)
    with redis_server(tmp_path) as redis:
        # Fixed 8-step rounds: rounds grown to the step time (multi_step.round_steps) can serve
        # this tiny model's whole workload in fewer than six, and then no round fails.
        env = {"SPINDLE_FAULT_FAIL_ROUND": "6", "SPINDLE_ROUND_TARGET_MS": "0"}
        serve, metrics_port = _serve(model, redis, env=env)
        with serve as server:
            results = run_with_fault(server, jobs, lambda: None, after_tokens=1)
            wait_until_idle(server, metrics_port, redis)
            assert scrape(metrics_port + 2).get("spindle:worker_rounds_failed_total") == 1.0
    assert_matches_oracle(model, jobs, results)


def test_redis_restarted_mid_stream(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_models["llama"]
    jobs = jobs_for(34, count=16, max_out=90)
    with redis_server(tmp_path) as redis:
        serve, metrics_port = _serve(model, redis)
        with serve as server:
            results = run_with_fault(server, jobs, redis.restart)
            wait_until_idle(server, metrics_port, redis)
    assert_matches_oracle(model, jobs, results)
