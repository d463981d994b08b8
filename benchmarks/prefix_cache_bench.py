"""`python -m benchmarks.prefix_cache_bench`: what the prefix cache buys on a shared-system-prompt workload.

N requests (default 64), each one shared system prompt (default 512 token ids) plus a unique
32-token suffix, 32 greedy output tokens, sent at concurrency 16 through the real services
(`spindle serve` on a benchmark decoder model). The same workload runs twice, each on a fresh
server: prefix caching on (the default) and off (SPINDLE_ENABLE_PREFIX_CACHING=false, which the
scheduler reads; `spindle serve` has no flag for it). Each run first sends one untimed request
with the same prefix and another suffix, so with caching on every timed request can hit. Prints
TTFT p50/p90, req/s and output tok/s for both, the cached prompt tokens the server reported,
and the speedups (off / on for TTFT, on / off for throughput); writes JSON to benchmarks/results/.

    python -m benchmarks.prefix_cache_bench                      # 64 requests, 512 + 32 -> 32, conc 16
    python -m benchmarks.prefix_cache_bench --num-requests 8 --prefix-len 128 --concurrency 4
    python -m benchmarks.prefix_cache_bench --model medium --spindle-arg=--num-scheduler-steps=8
    python -m benchmarks.prefix_cache_bench --modes prefix-cache-on,prefix-cache-on-2-workers   # 1 vs 2 workers

With --workers 2 (mode prefix-cache-on-2-workers, the cores split between the workers) the
scheduler's placement must spread the shared prefix over both workers instead of sending every
request to the one that cached it first; the last line compares it with one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from benchmarks.limit import machine_cores
from benchmarks.load_client import LoadConfig, format_summary, run_with_warmup
from benchmarks.metrics import LoadSummary
from benchmarks.models import BENCH_MODELS, REPO, ensure_model
from benchmarks.report import format_ms, machine_info
from benchmarks.workload import BenchRequest, WorkloadSpec, build_workload

logger = logging.getLogger("benchmarks.prefix_cache_bench")

RESULTS_DIR = REPO / "benchmarks" / "results"
CACHE_ON = "prefix-cache-on"
CACHE_OFF = "prefix-cache-off"
TWO_WORKERS = "prefix-cache-on-2-workers"
# Environment each mode's services get; the scheduler's --enable-prefix-caching defaults from it.
MODES: dict[str, dict[str, str]] = {
    CACHE_ON: {"SPINDLE_ENABLE_PREFIX_CACHING": "true"},
    CACHE_OFF: {"SPINDLE_ENABLE_PREFIX_CACHING": "false"},
    TWO_WORKERS: {"SPINDLE_ENABLE_PREFIX_CACHING": "true"},
}
# Workers per mode: two splits the cores between them (placement must spread the shared prefix).
MODE_WORKERS: dict[str, int] = {TWO_WORKERS: 2}


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """Everything one run measures; recorded verbatim in the results JSON."""

    model: str = "small"
    num_requests: int = 64
    prefix_len: int = 512
    suffix_len: int = 32
    output_len: int = 32
    concurrency: int = 16
    modes: tuple[str, ...] = (CACHE_ON, CACHE_OFF)
    spindle_args: tuple[str, ...] = ()
    num_threads: int = 1
    seed: int = 0
    server_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.model not in BENCH_MODELS:
            raise ValueError(f"model={self.model!r} is not one of {sorted(BENCH_MODELS)}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"modes={unknown} are not among {sorted(MODES)}")
        total = self.prefix_len + self.suffix_len + self.output_len
        if total > BENCH_MODELS[self.model].max_position_embeddings:
            raise ValueError(f"prefix_len + suffix_len + output_len = {total} exceeds the model's context")
        if min(self.num_requests, self.suffix_len, self.concurrency, self.num_threads) < 1:
            raise ValueError("num_requests, suffix_len, concurrency and num_threads must be at least 1")

    def requests(self) -> tuple[BenchRequest, list[BenchRequest]]:
        """(the warmup request, the timed ones): all share one prefix, every suffix is different."""
        spec = WorkloadSpec(kind="shared-prefix", num_requests=self.num_requests + 1, input_len=self.suffix_len,
                            output_len=self.output_len, prefix_len=self.prefix_len,
                            vocab_high=BENCH_MODELS[self.model].vocab_size, seed=self.seed)
        requests = build_workload(spec)
        return requests[0], requests[1:]


@dataclass(frozen=True, slots=True)
class ModeRow:
    """One mode's figures, or why it could not run."""

    mode: str
    summary: LoadSummary | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Speedups:
    """Cache on against cache off: >1 means the cache helped.

    TTFT figures are off / on (lower is better); throughputs are on / off (higher is better).
    """

    ttft_p50: float | None = None
    ttft_p90: float | None = None
    request_throughput: float | None = None
    output_throughput: float | None = None
    notes: tuple[str, ...] = ()


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def speedups(rows: Sequence[ModeRow]) -> Speedups:
    """The four ratios between the cache-on and cache-off rows; None where either is missing."""
    by_mode = {r.mode: r.summary for r in rows if r.summary is not None}
    on, off = by_mode.get(CACHE_ON), by_mode.get(CACHE_OFF)
    if on is None or off is None:
        return Speedups(notes=("needs both a cache-on and a cache-off row",))
    return Speedups(ttft_p50=_div(off.ttft.p50_ms, on.ttft.p50_ms), ttft_p90=_div(off.ttft.p90_ms, on.ttft.p90_ms),
                    request_throughput=_div(on.request_throughput, off.request_throughput),
                    output_throughput=_div(on.output_throughput, off.output_throughput))


TABLE_HEADER = ("mode", "reqs", "TTFT p50", "TTFT p90", "req/s", "out tok/s", "cached tok/req", "notes")


def format_table(rows: Sequence[ModeRow]) -> str:
    """A Markdown table per mode, then the speedup line."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    for row in rows:
        s = row.summary
        if s is None:
            cells = [row.mode, "", "", "", "", "", "", f"FAILED: {row.error}"]
        else:
            notes = [f"{s.num_failed} failed: {s.errors[0]}"] if s.num_failed else []
            if s.num_length_mismatches:
                notes.append(f"{s.num_length_mismatches} wrong length")
            cached = s.total_cached_prompt_tokens / s.num_completed if s.num_completed else 0.0
            cells = [row.mode, str(s.num_requests), format_ms(s.ttft.p50_ms), format_ms(s.ttft.p90_ms),
                     f"{s.request_throughput:.2f}", f"{s.output_throughput:,.1f}", f"{cached:.0f}", "; ".join(notes)]
        lines.append("| " + " | ".join(cells) + " |")
    sp = speedups(rows)
    cells = [f"{name} x{value:.2f}" for name, value in (("TTFT p50", sp.ttft_p50), ("TTFT p90", sp.ttft_p90),
                                                       ("req/s", sp.request_throughput),
                                                       ("out tok/s", sp.output_throughput)) if value is not None]
    lines.append("\nspeedup with the prefix cache: " + (", ".join(cells) if cells else "; ".join(sp.notes)))
    by_mode = {r.mode: r.summary for r in rows if r.summary is not None}
    one, two = by_mode.get(CACHE_ON), by_mode.get(TWO_WORKERS)
    if one is not None and two is not None and one.output_throughput > 0:
        ratio = two.output_throughput / one.output_throughput
        lines.append(f"2 workers / 1 worker (cores split, cache on): out tok/s x{ratio:.2f}")
    return "\n".join(lines) + "\n"


def run_mode(settings: PrefixSettings, mode: str, stem: str) -> ModeRow:
    """A fresh `spindle serve` with the mode's environment: one warmup request, then the timed ones."""
    from benchmarks.spindle_server import spindle_server

    warmup, timed = settings.requests()
    model_dir = ensure_model(settings.model)
    log_path = RESULTS_DIR / f"prefix-{stem}-{mode}.log"
    num_workers = MODE_WORKERS.get(mode, 1)
    worker_args = ("--workers", str(num_workers)) if num_workers > 1 else ()
    num_threads = max(1, settings.num_threads // num_workers)
    with spindle_server(model_dir, *worker_args, *settings.spindle_args, num_threads=num_threads, log_path=log_path,
                        timeout_s=settings.server_timeout_s, extra_env=MODES[mode]) as server:
        config = LoadConfig(base_url=server.http_url, model=server.model_name, concurrency=settings.concurrency,
                            seed=settings.seed, timeout_s=settings.request_timeout_s)
        run = asyncio.run(run_with_warmup(config, timed, [warmup]))
    return ModeRow(mode, run.summary)


def run_all(settings: PrefixSettings, stem: str) -> list[ModeRow]:
    """Each mode in turn; a failing mode becomes a row with its error."""
    rows = []
    for i, mode in enumerate(settings.modes, 1):
        logger.info("[%d/%d] %s: %d requests of %d + %d tokens -> %d, concurrency %d", i, len(settings.modes), mode,
                    settings.num_requests, settings.prefix_len, settings.suffix_len, settings.output_len,
                    settings.concurrency)
        try:
            row = run_mode(settings, mode, stem)
        except Exception as exc:  # keep the other mode's figures
            logger.exception("%s failed", mode)
            row = ModeRow(mode, None, f"{type(exc).__name__}: {exc}")
        if row.summary is not None:
            sys.stderr.write(format_summary(row.summary))
        rows.append(row)
    return rows


def parse_settings(argv: Sequence[str] | None) -> PrefixSettings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cache_bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=sorted(BENCH_MODELS), help="benchmark model (benchmarks/models)")
    p.add_argument("--num-requests", type=int, default=64, help="timed requests (one more is sent as warmup)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared system prompt tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="each request's own tokens after the prefix")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--modes", type=lambda t: tuple(x for x in t.split(",") if x), default=(CACHE_ON, CACHE_OFF),
                   help=f"comma list of {','.join(MODES)}")
    p.add_argument("--spindle-arg", action="append", default=[], help="extra flag for spindle serve (repeatable)")
    p.add_argument("--threads", type=int, default=machine_cores(), help="torch threads (default: every core)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    return PrefixSettings(model=a.model, num_requests=a.num_requests, prefix_len=a.prefix_len,
                          suffix_len=a.suffix_len, output_len=a.output_len, concurrency=a.concurrency,
                          modes=a.modes, spindle_args=tuple(a.spindle_arg), num_threads=a.threads, seed=a.seed)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    stem = time.strftime("%Y%m%d-%H%M%S")
    logger.info("prefix-cache benchmark %s: %s", stem, settings)
    rows = run_all(settings, stem)
    table = format_table(rows)
    sys.stdout.write("\n" + table)
    out = RESULTS_DIR / f"prefix-{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"timestamp": stem, "machine": machine_info(settings.num_threads), "settings": asdict(settings),
               "rows": [{"mode": r.mode, "error": r.error, "summary": r.summary.to_dict() if r.summary else None}
                        for r in rows],
               "speedups": asdict(speedups(rows)),
               "note": "compare ratios measured in this run only; absolute figures depend on a shared machine"}
    out.write_text(json.dumps(payload, indent=1))
    (RESULTS_DIR / f"prefix-{stem}.md").write_text(table)
    logger.info("wrote %s", out)
    if all(r.summary is None or r.summary.num_completed == 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
