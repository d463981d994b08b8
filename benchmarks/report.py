"""Turn benchmark rows into the printed table, the results JSON and throughput plots.

Ratios are the point (DESIGN.md: compare only figures measured side by side in one run): each
row's output throughput is divided by the limit's and by `generate`'s for the same model and
concurrency. Nothing here measures anything.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.metrics import LoadSummary

LIMIT = "limit"
GENERATE = "generate"


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One measured configuration: a server (or in-process loop) at one concurrency on one model.

    Attributes:
        model: benchmark model name ("small", "medium").
        config: "limit", "generate", "spindle-steps<N>" or a peer's name.
        concurrency: requests in flight (the batch size for the in-process loops).
        num_requests: requests in the timed workload.
        summary: the figures; None if the configuration could not run.
        error: why it could not run.
    """

    model: str
    config: str
    concurrency: int
    num_requests: int
    summary: LoadSummary | None
    error: str | None = None


def _throughput(rows: Sequence[BenchRow], model: str, config: str, concurrency: int) -> float | None:
    for row in rows:
        if (row.model, row.config, row.concurrency) == (model, config, concurrency) and row.summary is not None:
            return row.summary.output_throughput or None
    return None


def ratio(row: BenchRow, rows: Sequence[BenchRow], reference: str) -> float | None:
    """row's output tok/s over the `reference` config's on the same model and concurrency."""
    ref = _throughput(rows, row.model, reference, row.concurrency)
    if row.summary is None or ref is None or row.config == reference:
        return None
    return row.summary.output_throughput / ref


def format_ms(value: float) -> str:
    """Milliseconds for a table cell: seconds above 1 s, two decimals below 1 ms."""
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.1f} ms" if value >= 1 else f"{value:.2f} ms"


def _ratio_cell(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


TABLE_HEADER = ("model", "config", "conc", "reqs", "out tok/s", "TTFT p50", "ITL p50", "ITL p99",
                "/limit", "/generate", "notes")


def format_table(rows: Sequence[BenchRow]) -> str:
    """A Markdown table, one line per row, with the two ratios."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    for row in rows:
        s = row.summary
        if s is None:
            cells = [row.model, row.config, str(row.concurrency), str(row.num_requests), "", "", "", "", "", "",
                     f"FAILED: {row.error}"]
        else:
            notes = []
            if s.num_failed:
                notes.append(f"{s.num_failed} failed")
            if s.num_length_mismatches:
                notes.append(f"{s.num_length_mismatches} wrong length")
            cells = [row.model, row.config, str(row.concurrency), str(row.num_requests),
                     f"{s.output_throughput:,.1f}", format_ms(s.ttft.p50_ms), format_ms(s.itl.p50_ms),
                     format_ms(s.itl.p99_ms),
                     _ratio_cell(ratio(row, rows, LIMIT)), _ratio_cell(ratio(row, rows, GENERATE)),
                     "; ".join(notes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def machine_info(num_threads: int) -> dict[str, object]:
    """What the figures were measured on."""
    import torch
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "torch_threads": num_threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def write_json(path: Path, meta: dict[str, object], rows: Sequence[BenchRow]) -> None:
    """The whole run: metadata plus every row with its full summary and ratios."""
    out_rows = []
    for row in rows:
        out_rows.append({
            "model": row.model, "config": row.config, "concurrency": row.concurrency,
            "num_requests": row.num_requests, "error": row.error,
            "summary": row.summary.to_dict() if row.summary is not None else None,
            "ratio_vs_limit": ratio(row, rows, LIMIT), "ratio_vs_generate": ratio(row, rows, GENERATE),
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "rows": out_rows}, indent=1))


def plot_throughput(rows: Sequence[BenchRow], out_dir: Path, stem: str) -> list[Path]:
    """One PNG per model: output tok/s against concurrency per config, the limit as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    for model in dict.fromkeys(r.model for r in rows if r.summary is not None):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for config in dict.fromkeys(r.config for r in rows if r.model == model):
            points = sorted((r.concurrency, r.summary.output_throughput) for r in rows
                            if r.model == model and r.config == config and r.summary is not None)
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            style = {"color": "black", "linestyle": "--", "linewidth": 2.5} if config == LIMIT else {"marker": "o"}
            ax.plot(xs, ys, label=config, **style)
        ax.set_xscale("log", base=2)
        ticks = sorted({r.concurrency for r in rows if r.model == model})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency (requests in flight; batch size for limit/generate)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{model}: output throughput")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out_dir / f"{stem}-{model}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
