"""The benchmark report's ratios and table: each row against the limit and generate at the same point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.metrics import RequestResult, summarize
from benchmarks.report import BenchRow, format_table, ratio, write_json


def _row(config: str, concurrency: int, output_tokens: int, model: str = "small") -> BenchRow:
    results = [RequestResult(8, output_tokens, output_tokens=output_tokens, ttft_s=0.01, itls_s=[0.002], e2e_s=0.1)]
    return BenchRow(model, config, concurrency, 1, summarize(results, duration_s=1.0))


def test_ratios_match_model_and_concurrency(tmp_path: Path) -> None:
    rows = [_row("limit", 1, 100), _row("generate", 1, 80), _row("spindle-steps1", 1, 50),
            _row("limit", 4, 400), _row("spindle-steps1", 4, 300), _row("spindle-steps1", 4, 10, model="medium"),
            BenchRow("small", "spindle-steps8", 4, 8, None, "AssertionError: exited")]
    assert ratio(rows[2], rows, "limit") == pytest.approx(0.5)
    assert ratio(rows[2], rows, "generate") == pytest.approx(50 / 80)
    assert ratio(rows[4], rows, "limit") == pytest.approx(0.75)
    assert ratio(rows[4], rows, "generate") is None  # no generate row at concurrency 4
    assert ratio(rows[5], rows, "limit") is None  # no medium limit
    assert ratio(rows[0], rows, "limit") is None
    assert ratio(rows[6], rows, "limit") is None

    table = format_table(rows)
    assert "| small | spindle-steps1 | 1 | 1 | 50.0 | 10.0 ms | 2.0 ms | 2.0 ms | 0.50 | 0.62 |  |" in table
    assert "FAILED: AssertionError: exited" in table

    out = tmp_path / "r.json"
    write_json(out, {"timestamp": "t"}, rows)
    data = json.loads(out.read_text())
    assert data["timestamp"] == "t" and len(data["rows"]) == 7
    assert data["rows"][4]["ratio_vs_limit"] == pytest.approx(0.75)
    assert data["rows"][6]["summary"] is None
