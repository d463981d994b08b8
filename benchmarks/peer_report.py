"""The peer benchmark's report: issue 14's table, the machine-limit fractions, the context sweep, plots.

Nothing here measures. Rows come from benchmarks/peer_bench.py, directly or from the JSON files
its runs write, so a benchmark split into several runs (by model, to keep each run short on a
shared machine) is reported as one:

    python -m benchmarks.peer_report benchmarks/results/peers-A.json benchmarks/results/peers-B.json

Each row keeps the machine limits measured in its own run; its fractions use those.

A run of several rounds (`peer_bench --rounds N`) times every table cell's servers N times,
interleaved, so a slow minute of the shared host hits one round, not one server. The table then
gives each server's median tok/s with the range over rounds, and the median of the rounds'
ratios (each round's spindle over the best peer of that round) with their range; the other
sections list every round's row.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.metrics import LatencyStats, LoadSummary
from benchmarks.models import BENCH_MODELS
from benchmarks.peer_servers import PEERS
from benchmarks.process_cpu import LOAD_CLIENT
from benchmarks.report import format_ms
from benchmarks.roofline import MachineLimits, bandwidth_fraction, gemm_fraction, tail_ratio

logger = logging.getLogger(__name__)

SPINDLE = "spindle"
TABLE = "table"
SWEEP = "sweep"
# Issue 14's goals, as ratios measured in one run.
GOAL_VS_PEERS = 1.2
GOAL_BANDWIDTH = 0.8
GOAL_GEMM = 0.7
GOAL_TAIL = 3.0


@dataclass(frozen=True, slots=True)
class PeerRow:
    """One timed run of one fresh server.

    Attributes:
        part: TABLE (the 128 + 128 workload) or SWEEP (decode at growing contexts).
        server: SPINDLE or a peer's name.
        model: a key of BENCH_MODELS.
        dtype: the weights' dtype, "float32" or "bfloat16".
        concurrency: streams in flight.
        prompt_len: prompt tokens per request (the sweep's context).
        output_len: output tokens per request.
        limits: the machine limits measured in the same run.
        summary: the load client's figures; None when the run failed or was not possible.
        steady_itl: SWEEP only: output gaps while the batch decoded (metrics.steady_state_itls).
        error: why there are no figures ("missing: ..." when the configuration does not exist yet).
        step_phases_ms: spindle only: ms per worker step in each phase, from the worker's
            spindle:worker_step_phase_seconds_total scraped after the run (services/worker/step_phases.py).
        step_transit: spindle only: how long worker steps' tokens took to reach the frontend over the
            run (its spindle:step_transit_seconds{hop="worker_to_frontend"}): "mean_ms" and
            "share_over_5_ms" (benchmarks/soak_probe.py).
        cpu_ms_per_token: ms of CPU (user + system) per output token of each process of the server,
            and of the load client, over the timed requests, by role (benchmarks/process_cpu.py).
        round: which of the run's rounds timed it (1 in a run of one round; module docstring).
    """

    part: str
    server: str
    model: str
    dtype: str
    concurrency: int
    prompt_len: int
    output_len: int
    limits: MachineLimits
    summary: LoadSummary | None = None
    steady_itl: LatencyStats | None = None
    error: str | None = None
    step_phases_ms: dict[str, float] | None = None
    cpu_ms_per_token: dict[str, float] | None = None
    step_transit: dict[str, float] | None = None
    round: int = 1

    @property
    def throughput(self) -> float | None:
        if self.summary is None or self.summary.num_completed == 0:
            return None
        return self.summary.output_throughput


def _cell_key(row: PeerRow) -> tuple[str, str, int, int]:
    return row.dtype, row.model, row.concurrency, row.prompt_len


def best_peer(rows: Sequence[PeerRow], row: PeerRow) -> PeerRow | None:
    """The peer with the highest output tok/s at `row`'s point of the same part and round; None if no
    peer has figures there."""
    peers = [r for r in rows if r.part == row.part and r.server != SPINDLE and _cell_key(r) == _cell_key(row)
             and r.round == row.round and r.throughput is not None]
    return max(peers, key=lambda r: r.throughput or 0.0, default=None)


def ratio_to_best_peer(rows: Sequence[PeerRow], row: PeerRow) -> float | None:
    """`row`'s tok/s over the best peer's at the same point; None where either has no figures."""
    best = best_peer(rows, row)
    if best is None or row.throughput is None or best.throughput is None:
        return None
    return row.throughput / best.throughput


def _servers(rows: Sequence[PeerRow]) -> list[str]:
    present = {r.server for r in rows}
    return [s for s in (SPINDLE, *PEERS) if s in present]


def _find_all(rows: Sequence[PeerRow], part: str, server: str, key: tuple[str, str, int, int]) -> list[PeerRow]:
    """Every round's row of `server` at `key`, in round order."""
    found = [r for r in rows if r.part == part and r.server == server and _cell_key(r) == key]
    return sorted(found, key=lambda r: r.round)


def _find(rows: Sequence[PeerRow], part: str, server: str, key: tuple[str, str, int, int]) -> PeerRow | None:
    return next(iter(_find_all(rows, part, server, key)), None)


def median_throughput(rows: Sequence[PeerRow]) -> float | None:
    """The median output tok/s over the rounds that have figures; None where none has."""
    values = [r.throughput for r in rows if r.throughput is not None]
    return statistics.median(values) if values else None


def _with_range(median: float, values: Sequence[float], fmt: str) -> str:
    """`median`, and the range of `values` in brackets where there are several."""
    if len(values) < 2:
        return format(median, fmt)
    return f"{median:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def throughput_cell(rows: Sequence[PeerRow]) -> str:
    """tok/s of a server's rows at one point (over rounds: the median and the range), or why there is
    none: "missing: ..." kept verbatim, other errors as "failed"; failed and short requests of any
    round noted."""
    if not rows:
        return "not run"
    median = median_throughput(rows)
    if median is not None:
        measured = [r for r in rows if r.throughput is not None]
        failed = sum(r.summary.num_failed for r in measured if r.summary is not None)
        short = sum(r.summary.num_length_mismatches for r in measured if r.summary is not None)
        notes = [*([f"{failed} failed"] if failed else []), *([f"{short} short"] if short else []),
                 *([f"{len(rows) - len(measured)} of {len(rows)} rounds failed"] if len(measured) < len(rows) else [])]
        text = _with_range(median, [r.throughput or 0.0 for r in measured], ",.1f")
        return text + (f" ({'; '.join(notes)})" if notes else "")
    row = rows[0]
    if row.error and row.error.startswith("missing"):
        return row.error
    return f"failed: {(row.error or 'no output')[:80]}"


def ratio_cell(value: float | None, goal: float, at_most: bool = False) -> str:
    """A ratio with a mark for its goal: ✓ met, ✗ missed; empty when there is none."""
    if value is None:
        return ""
    met = value <= goal if at_most else value >= goal
    return f"{value:.2f} {'✓' if met else '✗'}"


def _points(rows: Sequence[PeerRow], part: str) -> list[tuple[str, str, int, int]]:
    return list(dict.fromkeys(_cell_key(r) for r in rows if r.part == part))


def format_peer_table(rows: Sequence[PeerRow]) -> str:
    """Issue 14's table: output tok/s per server at each dtype, model and concurrency, and spindle / best peer."""
    servers = _servers([r for r in rows if r.part == TABLE])
    header = ["weights", "model", "streams", *servers, f"spindle / best peer (goal ≥ {GOAL_VS_PEERS})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in _points(rows, TABLE):
        dtype, model, concurrency, _ = key
        cells = [throughput_cell(_find_all(rows, TABLE, s, key)) for s in servers]
        lines.append("| " + " | ".join([dtype, model, str(concurrency), *cells, _vs_cell(rows, key)]) + " |")
    return "\n".join(lines) + "\n"


def _vs_cell(rows: Sequence[PeerRow], key: tuple[str, str, int, int]) -> str:
    """The median over rounds of spindle / best peer at `key`, its goal mark, the range over rounds
    where there are several, and the peer that was best most often."""
    pairs = [(ratio, best.server) for own in _find_all(rows, TABLE, SPINDLE, key)
             if (ratio := ratio_to_best_peer(rows, own)) is not None and (best := best_peer(rows, own)) is not None]
    if not pairs:
        return ""
    ratios = [ratio for ratio, _ in pairs]
    median = statistics.median(ratios)
    peers = [server for _, server in pairs]
    spread = f" (rounds {min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{ratio_cell(median, GOAL_VS_PEERS)}{spread} (vs {max(set(peers), key=peers.count)})"


def _with_round(text: str, row: PeerRow, rows: Sequence[PeerRow]) -> str:
    """`text`, with `row`'s round where the rows hold several."""
    return f"{text} (round {row.round})" if any(r.round > 1 for r in rows) else text


@dataclass(frozen=True, slots=True)
class LimitFractions:
    """One server's figures against the machine at one (dtype, model, concurrency) of the table."""

    bandwidth: float | None  # single stream: tok/s x weight bytes / read bandwidth
    gemm: float | None  # batched: 2 x weights x tok/s / peak GEMM FLOP/s
    tail: float | None  # ITL p99 / p50
    gemm_all_tokens: float | None = None  # batched: as `gemm` with the prompt tokens' FLOPs counted too


def limit_fractions(row: PeerRow) -> LimitFractions:
    """The fractions of `row`: bandwidth for one stream, GEMM for more, the ITL tail for both."""
    if row.throughput is None or row.summary is None:
        return LimitFractions(None, None, None)
    spec = BENCH_MODELS[row.model]
    if row.concurrency == 1:
        return LimitFractions(bandwidth_fraction(row.throughput, spec, row.dtype, row.limits), None,
                              tail_ratio(row.summary.itl.p99_ms, row.summary.itl.p50_ms))
    return LimitFractions(None, gemm_fraction(row.throughput, spec, row.limits, dtype=row.dtype),
                          tail_ratio(row.summary.itl.p99_ms, row.summary.itl.p50_ms),
                          gemm_fraction(row.throughput, spec, row.limits, row.prompt_len / row.output_len, row.dtype))


def format_limit_table(rows: Sequence[PeerRow]) -> str:
    """Every table row against the machine limits measured in its run, with the goals marked."""
    header = ["weights", "model", "streams", "server", "out tok/s",
              f"x weight bytes / bandwidth (goal ≥ {GOAL_BANDWIDTH})", f"FLOP/s / peak GEMM (goal ≥ {GOAL_GEMM})",
              "same, prompt FLOPs counted", "ITL p50", "ITL p99", f"p99 / p50 (goal ≤ {GOAL_TAIL:g})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if row.part != TABLE or row.throughput is None or row.summary is None:
            continue
        f = limit_fractions(row)
        lines.append("| " + " | ".join([
            row.dtype, row.model, str(row.concurrency), _with_round(row.server, row, rows), f"{row.throughput:,.1f}",
            ratio_cell(f.bandwidth, GOAL_BANDWIDTH), ratio_cell(f.gemm, GOAL_GEMM),
            ratio_cell(f.gemm_all_tokens, GOAL_GEMM),
            format_ms(row.summary.itl.p50_ms), format_ms(row.summary.itl.p99_ms),
            ratio_cell(f.tail, GOAL_TAIL, at_most=True)]) + " |")
    return "\n".join(lines) + "\n"


def decode_step_ms(row: PeerRow | None) -> float | None:
    """The sweep's figure: median output gap while the batch decoded (steady state); None without one."""
    if row is None or row.steady_itl is None or row.steady_itl.p50_ms <= 0:
        return None
    return row.steady_itl.p50_ms


def _step_cell(row: PeerRow | None) -> str:
    if row is None:
        return "not run"
    step = decode_step_ms(row)
    if step is not None:
        return format_ms(step)
    if row.error:
        return row.error if row.error.startswith("missing") else f"failed: {row.error[:80]}"
    return "no steady state"


def format_sweep_table(rows: Sequence[PeerRow]) -> str:
    """Decode step time (steady-state ITL p50) at each context, per server, and each peer's time over spindle's."""
    servers = _servers([r for r in rows if r.part == SWEEP])
    peers = [s for s in servers if s != SPINDLE]
    header = ["weights", "model", "streams", "context", *(f"{s} step" for s in servers),
              *(f"{p} / spindle" for p in peers)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in _points(rows, SWEEP):
        dtype, model, concurrency, context = key
        found = {s: _find(rows, SWEEP, s, key) for s in servers}
        own = decode_step_ms(found.get(SPINDLE))
        ratios = []
        for p in peers:
            theirs = decode_step_ms(found[p])
            ratios.append(f"{theirs / own:.2f}" if theirs is not None and own is not None else "")
        lines.append("| " + " | ".join([dtype, model, str(concurrency), str(context),
                                        *(_step_cell(found[s]) for s in servers), *ratios]) + " |")
    return "\n".join(lines) + "\n"


def format_phase_table(rows: Sequence[PeerRow]) -> str:
    """spindle's worker step, ms per phase, for every run that reported them; "" when none did."""
    measured = [r for r in rows if r.step_phases_ms]
    if not measured:
        return ""
    phases = list(dict.fromkeys(p for r in measured for p in r.step_phases_ms or {}))
    header = ["part", "weights", "model", "streams", "context", *phases, "sum",
              "then to the frontend: mean", "over 5 ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in measured:
        ms = r.step_phases_ms or {}
        transit = ([f"{r.step_transit['mean_ms']:.2f}", f"{r.step_transit['share_over_5_ms']:.1%}"]
                   if r.step_transit else ["", ""])
        lines.append("| " + " | ".join([_with_round(r.part, r, measured), r.dtype, r.model,
                                        str(r.concurrency), str(r.prompt_len),
                                        *(f"{ms.get(p, 0.0):.2f}" for p in phases), f"{sum(ms.values()):.2f}",
                                        *transit]) + " |")
    return "\n".join(lines) + "\n"


def format_cpu_table(rows: Sequence[PeerRow]) -> str:
    """CPU per output token of each server's processes and of the load client, with the cores each
    kept busy in brackets, for every run that read them; "" when none did."""
    measured = [r for r in rows if r.cpu_ms_per_token and r.throughput]
    if not measured:
        return ""
    header = ["part", "weights", "model", "streams", "context", "server", "ms of CPU per output token (cores)",
              "server's total"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in measured:
        ms, per_s = r.cpu_ms_per_token or {}, (r.throughput or 0.0) / 1e3
        shown = [f"{role} {value:.3f} ({value * per_s:.2f})" for role, value in ms.items() if value * per_s >= 0.005]
        own = sum(value for role, value in ms.items() if role != LOAD_CLIENT)
        lines.append("| " + " | ".join([r.part, r.dtype, r.model, str(r.concurrency), str(r.prompt_len),
                                        _with_round(r.server, r, rows), ", ".join(shown),
                                        f"{own:.3f} ({own * per_s:.2f})"]) + " |")
    return "\n".join(lines) + "\n"


def format_limits(rows: Sequence[PeerRow]) -> str:
    """The machine limits measured before the timed runs: the value, or the range over the
    measurements (peer_bench measures again before every run; each row's fractions use its own)."""
    seen = list(dict.fromkeys(r.limits for r in rows))
    if not seen:
        return ""

    def span(values: list[float], unit: str) -> str:
        low, high = min(values) / 1e9, max(values) / 1e9
        return f"{low:.1f} {unit}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f} {unit}"

    bf16 = [lim.bf16_gemm_flops for lim in seen if lim.bf16_gemm_flops]
    line = (f"- peak fp32 GEMM {span([lim.gemm_flops for lim in seen], 'GFLOP/s')}, memory reads "
            f"{span([lim.read_bandwidth for lim in seen], 'GB/s')}"
            + (f", peak bf16 GEMM {span(bf16, 'GFLOP/s')} (bf16 cells' FLOP/s fraction)" if bf16 else ""))
    if len(seen) > 1:
        line += (f"; {len(seen)} measurements, one before each timed run, whose fractions below are taken "
                 "against it")
    return line + "\n"


def format_report(rows: Sequence[PeerRow]) -> str:
    """The whole Markdown report: limits, the table, the fractions, the sweep."""
    parts = ["## Machine limits (measured in the same run)\n", format_limits(rows)]
    table = [r for r in rows if r.part == TABLE]
    if table:
        lengths = sorted({(r.prompt_len, r.output_len) for r in table})
        shape = "; ".join(f"{p} prompt + {o} output tokens" for p, o in lengths)
        parts += [f"\n## Output tokens/s, {shape}, greedy, a fresh server per cell\n\n",
                  format_peer_table(rows), "\n## Against the machine's limits\n\n", format_limit_table(rows)]
    if any(r.part == SWEEP for r in rows):
        parts += ["\n## Decode step time as contexts grow (steady-state ITL p50: at least 90 % of the streams "
                  "decoding, no prefill in the step)\n\n", format_sweep_table(rows)]
    phase_table = format_phase_table(rows)
    if phase_table:
        parts += ["\n## Where spindle's worker steps spent their time (ms per step, prefill steps included), "
                  "and how long their tokens then took to reach the frontend\n\n",
                  phase_table]
    cpu_table = format_cpu_table(rows)
    if cpu_table:
        parts += ["\n## CPU per output token, by process (the timed requests; the load client shares the "
                  "machine)\n\n", cpu_table]
    return "".join(parts)


def row_to_dict(row: PeerRow) -> dict[str, object]:
    return asdict(row)


def row_from_dict(data: dict[str, object]) -> PeerRow:
    """The inverse of row_to_dict, for reports merged from several runs' JSON."""
    d = dict(data)
    d["limits"] = MachineLimits(**d["limits"])  # type: ignore[arg-type]
    if d.get("steady_itl") is not None:
        d["steady_itl"] = LatencyStats(**d["steady_itl"])  # type: ignore[arg-type]
    if d.get("summary") is not None:
        s = dict(d["summary"])  # type: ignore[arg-type]
        for name in ("ttft", "itl", "e2e"):
            s[name] = LatencyStats(**s[name])
        s["errors"] = tuple(s.get("errors", ()))
        d["summary"] = LoadSummary(**s)
    return PeerRow(**d)  # type: ignore[arg-type]


def write_json(path: Path, meta: dict[str, object], rows: Sequence[PeerRow]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "rows": [row_to_dict(r) for r in rows]}, indent=1))


def read_rows(paths: Sequence[Path]) -> list[PeerRow]:
    """Every run's rows in file order; a point measured again in a later file replaces the earlier row.

    So a rerun of some cells (after a fix, or a failure on a busy machine) is merged by naming its
    file last, without editing the first run's results.
    """
    rows: dict[tuple[str, str, tuple[str, str, int, int], int], PeerRow] = {}
    for path in paths:
        for data in json.loads(path.read_text())["rows"]:
            row = row_from_dict(data)
            rows[(row.part, row.server, _cell_key(row), row.round)] = row
    return list(rows.values())


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_peer_table(rows: Sequence[PeerRow], path: Path) -> Path | None:
    """One panel per table cell (rows: dtype; columns: model and streams), a linear bar per server.

    Separate panels because the cells differ by 100x in tok/s: on one shared axis the small
    differences that decide the goal would not show. Each bar is labelled with its tok/s.
    """
    table = [r for r in rows if r.part == TABLE]
    if not table:
        return None
    plt = _pyplot()
    dtypes = list(dict.fromkeys(r.dtype for r in table))
    columns = list(dict.fromkeys((r.model, r.concurrency) for r in table))
    servers = _servers(table)
    colors = {s: f"C{i}" for i, s in enumerate(servers)}
    fig, axes = plt.subplots(len(dtypes), len(columns), figsize=(max(3.2 * len(columns), 7.0), 3.0 * len(dtypes)),
                             squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, (model, concurrency) in enumerate(columns):
            ax = axes[i][j]
            key = (dtype, model, concurrency, next(r.prompt_len for r in table if (r.model, r.concurrency) ==
                                                   (model, concurrency)))
            values = [median_throughput(_find_all(table, TABLE, s, key)) or 0.0 for s in servers]
            bars = ax.bar(range(len(servers)), values, color=[colors[s] for s in servers])
            labels = [f"{v:,.0f}" if v else "n/a" for v in values]
            ax.bar_label(bars, labels, fontsize=8)
            ax.set_xticks(range(len(servers)), servers, fontsize=8)
            ax.set_title(f"{model}, {concurrency} stream{'s' if concurrency > 1 else ''}, {dtype}", fontsize=9)
            ax.margins(y=0.15)
            if j == 0:
                ax.set_ylabel("output tokens/s")
    fig.suptitle("output tok/s, a fresh server per run, the median where there were several rounds "
                 "(n/a: missing or failed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(rows: Sequence[PeerRow], path: Path) -> Path | None:
    """Decode step time against context, one line per server (and dtype/model if several)."""
    sweep = [r for r in rows if r.part == SWEEP]
    if not sweep:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server in _servers(sweep):
        for dtype, model in dict.fromkeys((r.dtype, r.model) for r in sweep):
            points = sorted((r.prompt_len, step) for r in sweep
                            if (r.server, r.dtype, r.model) == (server, dtype, model)
                            and (step := decode_step_ms(r)) is not None)
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=f"{server} ({model}, {dtype})")
    streams = sorted({r.concurrency for r in sweep})
    ax.set_xscale("log", base=2)
    ticks = sorted({r.prompt_len for r in sweep})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("context (prompt tokens per stream)")
    ax.set_ylabel("decode step time, ms (steady-state ITL p50)")
    ax.set_title(f"decode step at {', '.join(map(str, streams))} streams as contexts grow")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(rows: Sequence[PeerRow], out_dir: Path, stem: str) -> list[Path]:
    """The Markdown report and both plots under `out_dir`, named after `stem`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{stem}.md"
    md.write_text(format_report(rows))
    plots = [plot_peer_table(rows, out_dir / f"{stem}-table.png"), plot_sweep(rows, out_dir / f"{stem}-sweep.png")]
    return [md, *(p for p in plots if p is not None)]


def main(argv: Sequence[str] | None = None) -> None:
    from benchmarks.run import RESULTS_DIR

    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_report", description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", type=Path, help="results of `python -m benchmarks.run --peers ...`")
    p.add_argument("--stem", default=None, help="output name (default: peers-merged-<time>)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = read_rows(args.json)
    sys.stdout.write(format_report(rows))
    written = write_outputs(rows, RESULTS_DIR, args.stem or time.strftime("peers-merged-%Y%m%d-%H%M%S"))
    logger.info("wrote %s", ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
