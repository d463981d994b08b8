"""Issue 14's peer table: ratios to the best peer, missing and failed cells, the sweep, JSON round trips."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.metrics import LatencyStats, RequestResult, summarize
from benchmarks.peer_report import (
    SPINDLE,
    SWEEP,
    TABLE,
    PeerRow,
    best_peer,
    decode_step_ms,
    format_peer_table,
    format_report,
    format_sweep_table,
    limit_fractions,
    ratio_to_best_peer,
    read_rows,
    write_json,
    write_outputs,
)
from benchmarks.roofline import MachineLimits

LIMITS = MachineLimits(gemm_flops=100e9, read_bandwidth=20e9)


def _row(server: str, tok_per_s: float | None, *, model: str = "small", dtype: str = "float32",
         concurrency: int = 1, part: str = TABLE, prompt_len: int = 128, error: str | None = None,
         steady_ms: float | None = None) -> PeerRow:
    summary = None
    if tok_per_s is not None:
        results = [RequestResult(prompt_len, 100, output_tokens=100, ttft_s=0.01, itls_s=[0.002, 0.004], e2e_s=1.0)]
        summary = summarize(results, duration_s=100 / tok_per_s)
    steady = LatencyStats(steady_ms, steady_ms, steady_ms, steady_ms) if steady_ms is not None else None
    return PeerRow(part, server, model, dtype, concurrency, prompt_len, 128, LIMITS, summary, steady, error)


def test_ratio_is_against_the_faster_peer_at_the_same_point() -> None:
    rows = [_row(SPINDLE, 120.0), _row("vllm-cpu", 100.0), _row("llama-cpp", 60.0),
            _row("llama-cpp", 500.0, concurrency=64),  # another point: must not count
            _row("llama-cpp", 900.0, dtype="bfloat16")]
    assert best_peer(rows, rows[0]) is rows[1]
    assert ratio_to_best_peer(rows, rows[0]) == pytest.approx(1.2)


def test_no_ratio_without_figures() -> None:
    rows = [_row(SPINDLE, None, error="missing: spindle serve has no --weight-dtype yet"),
            _row("vllm-cpu", None, error="RuntimeError: exited"), _row("llama-cpp", None, error="TimeoutError")]
    assert best_peer(rows, rows[0]) is None
    assert ratio_to_best_peer(rows, rows[0]) is None


def test_table_has_one_line_per_point_with_columns_per_server() -> None:
    rows = [_row(SPINDLE, 1500.0, concurrency=64), _row("vllm-cpu", 1000.0, concurrency=64),
            _row("llama-cpp", 1250.0, concurrency=64),
            _row(SPINDLE, None, dtype="bfloat16", error="missing: spindle serve has no --weight-dtype yet"),
            _row("vllm-cpu", None, dtype="bfloat16", error="RuntimeError: vllm-cpu exited with 1")]
    table = format_peer_table(rows)
    lines = table.splitlines()
    assert lines[0] == ("| weights | model | streams | spindle | vllm-cpu | llama-cpp "
                        "| spindle / best peer (goal ≥ 1.2) |")
    assert lines[2] == "| float32 | small | 64 | 1,500.0 | 1,000.0 | 1,250.0 | 1.20 ✓ (vs llama-cpp) |"
    assert lines[3] == ("| bfloat16 | small | 1 | missing: spindle serve has no --weight-dtype yet | "
                        "failed: RuntimeError: vllm-cpu exited with 1 | not run |  |")
    assert len(lines) == 4


def test_missed_goal_is_marked() -> None:
    rows = [_row(SPINDLE, 100.0), _row("vllm-cpu", 200.0)]
    assert "| 0.50 ✗ (vs vllm-cpu) |" in format_peer_table(rows)


def test_limit_fractions_per_concurrency() -> None:
    one = limit_fractions(_row(SPINDLE, 100.0))
    assert one.bandwidth is not None and one.gemm is None
    assert one.tail == pytest.approx(_row(SPINDLE, 100.0).summary.itl.p99_ms / 3.0)  # type: ignore[union-attr]
    many = limit_fractions(_row(SPINDLE, 1000.0, concurrency=64))
    assert many.bandwidth is None and many.gemm is not None
    assert limit_fractions(_row(SPINDLE, None, error="x")).tail is None


def test_sweep_table_and_step_time() -> None:
    rows = [_row(SPINDLE, 50.0, part=SWEEP, concurrency=64, prompt_len=p, model="small-long", steady_ms=s)
            for p, s in ((128, 10.0), (4096, 40.0))]
    rows += [_row("vllm-cpu", 40.0, part=SWEEP, concurrency=64, prompt_len=128, model="small-long", steady_ms=20.0),
             _row("vllm-cpu", None, part=SWEEP, concurrency=64, prompt_len=4096, model="small-long", error="boom")]
    assert decode_step_ms(rows[0]) == 10.0
    assert decode_step_ms(rows[3]) is None
    lines = format_sweep_table(rows).splitlines()
    assert lines[0] == "| weights | model | streams | context | spindle step | vllm-cpu step | vllm-cpu / spindle |"
    assert lines[2] == "| float32 | small-long | 64 | 128 | 10.0 ms | 20.0 ms | 2.00 |"
    assert lines[3] == "| float32 | small-long | 64 | 4096 | 40.0 ms | failed: boom |  |"


def test_json_round_trip_merges_runs(tmp_path: Path) -> None:
    first = [_row(SPINDLE, 120.0), _row("vllm-cpu", None, error="missing: x")]
    second = [_row(SPINDLE, 30.0, model="medium"),
              _row(SPINDLE, 20.0, part=SWEEP, concurrency=64, prompt_len=512, model="small-long", steady_ms=5.0)]
    write_json(tmp_path / "a.json", {"timestamp": "a"}, first)
    write_json(tmp_path / "b.json", {"timestamp": "b"}, second)
    rows = read_rows([tmp_path / "a.json", tmp_path / "b.json"])
    assert rows == [*first, *second]
    report = format_report(rows)
    assert "| float32 | medium | 1 | 30.0 |" in report and "| 512 | 5.0 ms |" in report
    rerun = [_row("vllm-cpu", 90.0)]
    write_json(tmp_path / "c.json", {"timestamp": "c"}, rerun)
    merged = read_rows([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"])
    assert merged == [first[0], rerun[0], *second]  # the later file's row replaces the failed one in place


def test_spindles_step_phases_get_their_own_table_and_survive_json(tmp_path: Path) -> None:
    phases = {"prepare": 0.61, "forward": 0.74, "logits": 0.27, "sample": 0.05, "deliver": 0.44}
    rows = [replace(_row(SPINDLE, 330.0), step_phases_ms=phases,
                    step_transit={"mean_ms": 1.234, "share_over_5_ms": 0.0412}),
            replace(_row(SPINDLE, 2000.0, concurrency=64), step_phases_ms=phases),  # no transit read
            _row("llama-cpp", 700.0)]
    report = format_report(rows)
    assert "## Where spindle's worker steps spent their time" in report
    header = ("| part | weights | model | streams | context | prepare | forward | logits | sample | deliver | sum "
              "| then to the frontend: mean | over 5 ms |")
    assert header in report
    assert "| table | float32 | small | 1 | 128 | 0.61 | 0.74 | 0.27 | 0.05 | 0.44 | 2.11 | 1.23 | 4.1% |" in report
    assert "| table | float32 | small | 64 | 128 | 0.61 | 0.74 | 0.27 | 0.05 | 0.44 | 2.11 |  |  |" in report
    assert "spent their time" not in format_report(rows[2:])  # no phases, no section
    write_json(tmp_path / "a.json", {"timestamp": "a"}, rows)
    assert read_rows([tmp_path / "a.json"]) == rows


def test_cpu_per_token_by_process_gets_its_own_table_and_survives_json(tmp_path: Path) -> None:
    cpu = {"worker": 1.6, "load client": 0.5, "frontend": 0.45, "scheduler": 0.6, "launcher": 0.001}
    rows = [replace(_row(SPINDLE, 400.0), cpu_ms_per_token=cpu),
            replace(_row("llama-cpp", 700.0), cpu_ms_per_token={"llama-server": 2.6, "load client": 0.3})]
    report = format_report(rows)
    assert "## CPU per output token, by process" in report
    # cores = ms per token x tokens/s; the launcher's 0.0004 cores are left out; the server's total
    # leaves the load client out.
    assert ("| table | float32 | small | 1 | 128 | spindle | worker 1.600 (0.64), load client 0.500 (0.20), "
            "frontend 0.450 (0.18), scheduler 0.600 (0.24) | 2.651 (1.06) |") in report
    assert "| llama-cpp | llama-server 2.600 (1.82), load client 0.300 (0.21) | 2.600 (1.82) |" in report
    assert "CPU per output token" not in format_report([_row(SPINDLE, 400.0)])
    write_json(tmp_path / "a.json", {"timestamp": "a"}, rows)
    assert read_rows([tmp_path / "a.json"]) == rows


def test_plots_are_written(tmp_path: Path) -> None:
    rows = [_row(SPINDLE, 120.0), _row("vllm-cpu", 100.0), _row(SPINDLE, 10.0, dtype="bfloat16"),
            _row(SPINDLE, 20.0, part=SWEEP, concurrency=64, prompt_len=512, model="small-long", steady_ms=5.0)]
    written = write_outputs(rows, tmp_path, "t")
    assert [p.name for p in written] == ["t.md", "t-table.png", "t-sweep.png"]
    assert all(p.stat().st_size > 0 for p in written)


def test_rounds_give_medians_with_ranges_and_the_median_of_each_rounds_ratio(tmp_path: Path) -> None:
    # Round 2 was a slow minute of the host for both servers: its ratio is still taken within it.
    rounds = [(1, 130.0, 100.0, 60.0), (2, 70.0, 50.0, 80.0), (3, 120.0, 100.0, 90.0)]
    rows = [replace(_row(server, tok), round=r) for r, spindle, vllm, llama in rounds
            for server, tok in ((SPINDLE, spindle), ("vllm-cpu", vllm), ("llama-cpp", llama))]
    assert best_peer(rows, rows[3]) is rows[5]  # round 2's best peer is llama.cpp's round 2
    assert ratio_to_best_peer(rows, rows[3]) == pytest.approx(70.0 / 80.0)
    line = format_peer_table(rows).splitlines()[2]
    # Ratios per round: 1.30, 0.875, 1.20 -> median 1.20; vllm-cpu was the best peer in rounds 1 and 3.
    assert line == ("| float32 | small | 1 | 120.0 (70.0-130.0) | 100.0 (50.0-100.0) | 80.0 (60.0-90.0) "
                    "| 1.20 ✓ (rounds 0.88-1.30) (vs vllm-cpu) |")
    report = format_report(rows)
    assert "| float32 | small | 1 | spindle (round 2) | 70.0 |" in report  # every round's own row
    write_json(tmp_path / "a.json", {"timestamp": "a"}, rows)
    assert read_rows([tmp_path / "a.json"]) == rows  # rounds of one cell are not merged away


def test_a_failed_round_is_noted_and_left_out_of_the_median() -> None:
    rows = [replace(_row(SPINDLE, 100.0), round=1), replace(_row(SPINDLE, None, error="TimeoutError"), round=2),
            replace(_row("llama-cpp", 50.0), round=1), replace(_row("llama-cpp", 60.0), round=2)]
    line = format_peer_table(rows).splitlines()[2]
    assert line == "| float32 | small | 1 | 100.0 (1 of 2 rounds failed) | 55.0 (50.0-60.0) | 2.00 ✓ (vs llama-cpp) |"


def test_limits_line_gives_the_range_when_measured_before_every_run() -> None:
    from benchmarks.peer_report import format_limits

    one = [_row(SPINDLE, 100.0), _row("vllm-cpu", 90.0)]
    assert format_limits(one) == "- peak fp32 GEMM 100.0 GFLOP/s, memory reads 20.0 GB/s\n"
    moved = [one[0], replace(one[1], limits=MachineLimits(gemm_flops=100e9, read_bandwidth=45.5e9,
                                                          bf16_gemm_flops=900e9))]
    assert format_limits(moved) == (
        "- peak fp32 GEMM 100.0 GFLOP/s, memory reads 20.0-45.5 GB/s, peak bf16 GEMM 900.0 GFLOP/s "
        "(bf16 cells' FLOP/s fraction); 2 measurements, one before each timed run, whose fractions below "
        "are taken against it\n")
    # each row's bandwidth fraction uses its own measurement
    assert limit_fractions(moved[1]).bandwidth == pytest.approx(limit_fractions(
        replace(moved[1], limits=LIMITS)).bandwidth * 20.0 / 45.5)


def test_table_heading_names_the_runs_prompt_and_output_lengths() -> None:
    assert "## Output tokens/s, 128 prompt + 128 output tokens, greedy" in format_report([_row(SPINDLE, 100.0)])
    long = [replace(_row(SPINDLE, 5.5, prompt_len=1900), output_len=16),
            replace(_row("llama-cpp", 4.0, prompt_len=1900), output_len=16)]
    assert "## Output tokens/s, 1900 prompt + 16 output tokens, greedy" in format_report(long)
