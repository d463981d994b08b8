"""The load client against an in-process mock OpenAI SSE server: counts, throughput and percentiles.

No model and no spindle: the mock streams one chunk per token with known sleeps, so every
figure the client reports can be checked against what the server actually did.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from aiohttp import web

from benchmarks.load_client import LoadConfig, run_load, run_with_warmup
from benchmarks.metrics import LatencyStats, RequestResult, summarize
from benchmarks.workload import BenchRequest, WorkloadSpec, build_workload
from tests.benchmarks.mock_http import serve_app

FIRST_TOKEN_DELAY_S = 0.03
TOKEN_GAP_S = 0.01


@dataclass
class MockState:
    send_usage: bool = True
    bodies: list[dict[str, object]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


STATE = web.AppKey("state", MockState)


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _completions(request: web.Request) -> web.StreamResponse:
    state: MockState = request.app[STATE]
    body = await request.json()
    if body["model"] == "stream-error":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [{"index": 0, "text": " t0", "finish_reason": None}]}))
        await resp.write(_sse({"error": {"message": "worker died", "code": 500}}))
        return resp
    if body["model"] != "mock":
        return web.json_response({"error": {"message": "no such model"}}, status=404)
    state.bodies.append(body)
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(TOKEN_GAP_S)
            await resp.write(_sse({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}))
        # A finish chunk without text must not count as an output chunk.
        await resp.write(_sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
        if state.send_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            await resp.write(_sse({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
    finally:
        state.in_flight -= 1
    return resp


@pytest.fixture
async def mock_server() -> AsyncIterator[tuple[str, MockState]]:
    state = MockState()
    app = web.Application()
    app[STATE] = state
    app.router.add_post("/v1/completions", _completions)
    async with serve_app(app) as url:
        yield url, state


def _requests(n: int, max_tokens: int) -> list[BenchRequest]:
    return build_workload(WorkloadSpec(num_requests=n, input_len=8, output_len=max_tokens, vocab_high=100, seed=3))


async def test_concurrency_counts_and_throughput(mock_server: tuple[str, MockState]) -> None:
    url, state = mock_server
    requests = _requests(6, 5)
    run = await run_load(LoadConfig(url, "mock", concurrency=2, show_progress=False), requests)
    s = run.summary

    assert state.max_in_flight == 2
    assert s.num_completed == 6 and s.num_failed == 0 and s.num_length_mismatches == 0
    assert [r.output_tokens for r in run.results] == [5] * 6
    assert all(len(r.itls_s) == 4 for r in run.results)
    assert all(r.ttft_s >= FIRST_TOKEN_DELAY_S * 0.9 for r in run.results)
    assert all(r.e2e_s >= r.ttft_s + sum(r.itls_s) - 1e-6 for r in run.results)
    assert s.total_output_tokens == 30 and s.total_input_tokens == 48
    assert s.output_throughput == pytest.approx(30 / s.duration_s)
    assert s.request_throughput == pytest.approx(6 / s.duration_s)
    # Three waves of two, each at least first delay + 4 gaps.
    assert s.duration_s >= 3 * (FIRST_TOKEN_DELAY_S + 4 * TOKEN_GAP_S) * 0.9
    assert s.itl.p50_ms >= TOKEN_GAP_S * 1000 * 0.8

    body = state.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True}
    assert sorted(tuple(b["prompt"]) for b in state.bodies) == sorted(r.prompt_token_ids for r in requests)


async def test_counts_chunks_when_no_usage(mock_server: tuple[str, MockState]) -> None:
    url, state = mock_server
    state.send_usage = False
    run = await run_load(LoadConfig(url + "/v1", "mock", show_progress=False), _requests(3, 4))
    assert [r.output_tokens for r in run.results] == [4, 4, 4]
    assert state.max_in_flight == 3  # no concurrency limit: all at once
    assert run.summary.total_output_tokens == 12


async def test_server_errors_are_recorded_not_raised(mock_server: tuple[str, MockState]) -> None:
    url, _ = mock_server
    run = await run_load(LoadConfig(url, "missing", show_progress=False), _requests(2, 3))
    assert run.summary.num_failed == 2 and run.summary.num_completed == 0
    assert run.summary.output_throughput == 0.0
    assert run.summary.errors and "HTTP 404" in run.summary.errors[0]

    run = await run_load(LoadConfig(url, "stream-error", show_progress=False), _requests(1, 3))
    assert run.summary.num_failed == 1 and "worker died" in run.summary.errors[0]


async def test_poisson_rate_and_warmup(mock_server: tuple[str, MockState]) -> None:
    url, state = mock_server
    config = LoadConfig(url, "mock", request_rate=200.0, seed=1, show_progress=False)
    sent_before_timed: list[int] = []
    run = await run_with_warmup(config, _requests(4, 2), warmup=_requests(2, 1),
                                on_timed_start=lambda: sent_before_timed.append(len(state.bodies)))
    assert sent_before_timed == [2]  # called once, after the warmup and before any timed request
    assert len(state.bodies) == 6
    assert run.summary.num_completed == 4 and run.summary.total_output_tokens == 8


def test_percentile_math() -> None:
    values_ms = list(range(1, 101))  # 1..100 ms
    stats = LatencyStats.of([v / 1000 for v in values_ms])
    # numpy linear interpolation: rank = p/100 * (n-1)
    assert stats.p50_ms == pytest.approx(50.5)
    assert stats.p90_ms == pytest.approx(90.1)
    assert stats.p99_ms == pytest.approx(99.01)
    assert stats.mean_ms == pytest.approx(50.5)
    assert LatencyStats.of([]) == LatencyStats(0.0, 0.0, 0.0, 0.0)


def test_summarize_pools_itls_and_skips_failures() -> None:
    results = [
        RequestResult(10, 3, output_tokens=3, ttft_s=0.1, itls_s=[0.01, 0.03], e2e_s=0.2),
        RequestResult(10, 3, output_tokens=2, ttft_s=0.3, itls_s=[0.02], e2e_s=0.4),
        RequestResult(10, 3, error="boom"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.num_completed, s.num_failed, s.num_length_mismatches) == (2, 1, 1)
    assert s.output_throughput == pytest.approx(5 / 2.0)
    assert s.total_token_throughput == pytest.approx(25 / 2.0)
    assert s.itl.p50_ms == pytest.approx(20.0)
    assert s.ttft.p50_ms == pytest.approx(200.0)
    assert s.e2e.p99_ms == pytest.approx(float(np.percentile([200.0, 400.0], 99)))
    assert s.errors == ("boom",)
    with pytest.raises(ValueError):
        summarize(results, duration_s=0.0)


def test_workloads_are_seeded_and_bounded() -> None:
    spec = WorkloadSpec(num_requests=5, input_len=16, output_len=7, vocab_low=4, vocab_high=50, seed=9)
    a, b = build_workload(spec), build_workload(spec)
    assert a == b
    assert all(r.prompt_len == 16 and r.max_tokens == 7 for r in a)
    assert all(4 <= t < 50 for r in a for t in r.prompt_token_ids)
    assert build_workload(WorkloadSpec(num_requests=5, input_len=16, output_len=7, vocab_high=50, seed=10)) != a

    ranged = build_workload(WorkloadSpec(num_requests=50, input_len=100, output_len=100, range_ratio=0.5, seed=1))
    assert all(50 <= r.prompt_len <= 150 and 50 <= r.max_tokens <= 150 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 1

    share = build_workload(WorkloadSpec(kind="sharegpt-like", num_requests=500, input_len=200, output_len=150,
                                        max_model_len=512, seed=2))
    assert all(r.prompt_len >= 1 and r.max_tokens >= 1 and r.prompt_len + r.max_tokens <= 512 for r in share)
    median_in = float(np.median([r.prompt_len for r in share]))
    assert 120 < median_in < 300 and not math.isclose(min(r.prompt_len for r in share), median_in)
