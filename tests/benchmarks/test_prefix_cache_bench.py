"""The prefix-cache benchmark's workload split, speedups and table, and the load client's cached-token count."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from benchmarks.load_client import LoadConfig, run_load
from benchmarks.metrics import LoadSummary, RequestResult, summarize
from benchmarks.prefix_cache_bench import CACHE_OFF, CACHE_ON, MODES, ModeRow, PrefixSettings, format_table, speedups
from benchmarks.workload import BenchRequest


def test_requests_share_the_prefix_with_the_warmup() -> None:
    settings = PrefixSettings(num_requests=5, prefix_len=64, suffix_len=8, output_len=4)
    warmup, timed = settings.requests()
    assert len(timed) == 5
    prompts = [warmup.prompt_token_ids, *(r.prompt_token_ids for r in timed)]
    assert len({p[:64] for p in prompts}) == 1
    assert len({p[64:] for p in prompts}) == 6  # the warmup's suffix is not any timed one's
    assert all(r.prompt_len == 72 and r.max_tokens == 4 for r in timed)
    assert settings.requests() == (warmup, timed)


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="context"):
        PrefixSettings(prefix_len=2040, suffix_len=8, output_len=8)
    with pytest.raises(ValueError, match="modes"):
        PrefixSettings(modes=("lru",))
    assert MODES[CACHE_OFF] == {"SPINDLE_ENABLE_PREFIX_CACHING": "false"}


def _summary(ttfts_s: list[float], duration_s: float, cached: int) -> LoadSummary:
    results = [RequestResult(544, 32, output_tokens=32, ttft_s=t, e2e_s=t + 0.1, cached_prompt_tokens=cached)
               for t in ttfts_s]
    return summarize(results, duration_s)


def test_speedups_and_table() -> None:
    on = ModeRow(CACHE_ON, _summary([0.01, 0.02, 0.03], 1.0, 512))
    off = ModeRow(CACHE_OFF, _summary([0.04, 0.08, 0.12], 2.0, 0))
    sp = speedups([on, off])
    assert sp.ttft_p50 == pytest.approx(4.0)
    assert sp.ttft_p90 == pytest.approx(0.112 / 0.028)
    assert sp.request_throughput == pytest.approx(2.0) and sp.output_throughput == pytest.approx(2.0)
    table = format_table([on, off])
    assert "| prefix-cache-on | 3 | 20.0 ms | 28.0 ms | 3.00 | 96.0 | 512 |  |" in table
    assert "| prefix-cache-off | 3 | 80.0 ms | 112.0 ms | 1.50 | 48.0 | 0 |  |" in table
    assert "TTFT p50 x4.00" in table and "out tok/s x2.00" in table

    broken = ModeRow(CACHE_OFF, None, "AssertionError: exited")
    assert speedups([on, broken]).ttft_p50 is None
    table = format_table([on, broken])
    assert "FAILED: AssertionError: exited" in table and "needs both" in table


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': ' a'}]})}\n\n".encode())
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
             "prompt_tokens_details": {"cached_tokens": 16}}
    await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
    return resp


@pytest.fixture
async def server_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


async def test_load_client_counts_cached_prompt_tokens(server_url: str) -> None:
    requests = [BenchRequest(tuple(range(4, 24)), 1) for _ in range(3)]
    run = await run_load(LoadConfig(server_url, "m", show_progress=False), requests)
    assert [r.cached_prompt_tokens for r in run.results] == [16, 16, 16]
    assert run.summary.total_cached_prompt_tokens == 48
