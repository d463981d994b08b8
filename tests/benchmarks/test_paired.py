"""The paired benchmark's variants, its alternation between two servers and its statistics.

The alternation runs against two mock /v1/embeddings servers, one slower by a known delay, so the
order of the requests and the measured difference can both be checked; the statistics are
checked on latencies with a known shift.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from benchmarks import paired
from benchmarks.embed_client import EmbeddingSender, make_batches
from benchmarks.load_client import LoadConfig
from benchmarks.metrics import RequestResult
from benchmarks.models import REPO
from benchmarks.paired import Side, Variant, parse_variant, summarize
from tests.benchmarks.mock_http import serve_app


def test_variant_names_a_label_a_tree_and_an_environment(tmp_path: Path) -> None:
    assert parse_variant("new") == Variant("new", REPO, ())
    assert parse_variant(f"old@{REPO}:A=1,B=x,y") == Variant("old", REPO, (("A", "1"), ("B", "x,y")))
    with pytest.raises(argparse.ArgumentTypeError, match="not a spindle source tree"):
        parse_variant(f"old@{tmp_path}")
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "cli.py").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="make -C .* protos"):
        parse_variant(f"old@{tmp_path}")
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL"):
        parse_variant(":A=1")


def test_the_two_variants_need_their_own_labels() -> None:
    with pytest.raises(SystemExit):
        paired.parse_args(["--a", "x", "--b", "x"])
    assert paired.parse_args(["--b", "old"]).a == Variant("a")


def test_a_peer_takes_variant_bs_place_for_completions() -> None:
    args = paired.parse_args(["--peer", "llama-cpp", "--workload", "completion", "--dtype", "bfloat16"])
    assert args.b == Variant("llama-cpp", peer="llama-cpp") and args.dtype == "bfloat16"
    for bad in (["--peer", "llama-cpp"], ["--peer", "llama-cpp", "--b", "x", "--workload", "completion"], []):
        with pytest.raises(SystemExit):
            paired.parse_args(bad)  # embeddings have no peer here; B is --b or --peer, exactly one


def _side(label: str, latencies_s: list[float], tokens: int = 0) -> Side:
    side = Side(Variant(label))
    for latency in latencies_s:
        side.add([RequestResult(prompt_len=1, expected_output_tokens=tokens, output_tokens=tokens, e2e_s=latency,
                                error=None if not math.isnan(latency) else "HTTP 500")], latency)
    return side


def test_summary_finds_a_shift_smaller_than_the_drift_between_pairs() -> None:
    rng = np.random.default_rng(0)
    drift = np.linspace(0.015, 0.025, 300)  # the host slows by two thirds over the run
    b = drift + rng.normal(0, 0.0005, 300)
    a = b - 0.0004 + rng.normal(0, 0.0005, 300)  # A 0.4 ms faster, 20x less than the drift
    summary = summarize(_side("a", list(a)), _side("b", list(b)))
    assert summary.num_pairs == 300
    low, high = summary.diff_ci95_ms
    assert low < -0.4 < high < 0, summary
    assert summary.a_faster_share > 0.6 and summary.b_over_a > 1
    assert summary.a_tokens_per_s is None


def test_summary_leaves_out_pairs_with_a_failure_and_rates_completions() -> None:
    a = _side("a", [0.1, float("nan"), 0.1], tokens=10)
    b = _side("b", [0.2, 0.2, 0.2], tokens=10)
    summary = summarize(a, b)
    assert summary.num_pairs == 2 and a.errors == ["HTTP 500"]
    assert summary.a_tokens_per_s == pytest.approx(100.0) and summary.b_tokens_per_s == pytest.approx(50.0)
    assert summary.diff_mean_ms == pytest.approx(-100.0) and summary.a_faster_share == 1.0
    with pytest.raises(ValueError, match="both"):
        summarize(_side("a", [float("nan")]), _side("b", [0.1]))


def _mock(label: str, delay_s: float, log: list[tuple[str, str]]) -> web.Application:
    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        log.append((label, body["input"]))
        await asyncio.sleep(delay_s)
        return web.json_response({"object": "list", "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3},
                                  "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0]}]})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    return app


def _alternate_six(delays_s: tuple[float, float],
                   concurrency: int) -> tuple[list[tuple[str, str]], list[str], list[Side]]:
    """Six one-sentence requests through `_alternate` against mock servers "a" and "b" (each answering
    after its delay): (what each server got, in order; the texts; the two sides)."""
    log: list[tuple[str, str]] = []
    texts = [f"s{i}" for i in range(6)]
    batches = make_batches(texts, [3] * len(texts), 1)
    sides = [Side(Variant("a")), Side(Variant("b"))]

    async def main() -> None:
        async with serve_app(_mock("a", delays_s[0], log)) as url_a, serve_app(_mock("b", delays_s[1], log)) as url_b:
            configs = [LoadConfig(base_url=url, model="m", concurrency=concurrency, timeout_s=10)
                       for url in (url_a, url_b)]
            await paired._alternate(configs, batches, EmbeddingSender("float"), sides, concurrency=concurrency)

    asyncio.run(main())
    return log, texts, sides


def test_each_request_goes_to_both_servers_one_at_a_time_in_swapped_order() -> None:
    log, texts, sides = _alternate_six((0.0, 0.02), concurrency=1)
    assert log == [(label, t) for i, t in enumerate(texts) for label in (("a", "b") if i % 2 == 0 else ("b", "a"))]
    summary = summarize(*sides)
    assert summary.num_pairs == 6 and summary.a_faster_share == 1.0 and summary.diff_median_ms < -15


def test_a_group_of_concurrent_requests_goes_whole_to_one_server_before_the_other() -> None:
    log, texts, sides = _alternate_six((0.05, 0.05), concurrency=3)
    servers = [label for label, _ in log]
    assert servers == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    assert sorted(t for label, t in log[:3]) == texts[:3] and sorted(t for label, t in log[9:]) == texts[3:]
    assert len(sides[0].latencies_s) == 2
    assert all(0.05 <= t < 0.15 for t in sides[0].latencies_s + sides[1].latencies_s)  # three at once, not 0.15 s
