"""Rows of the embedding benchmark, their ratio to sentence-transformers, and the printed table.

Pure arithmetic over measured figures (no I/O, no models): sentences/s and tokens/s divide what
succeeded by the wall time, and each row's ratio is its sentences/s over the sentence-transformers
rows' mean from the same run (DESIGN.md: compare only figures measured side by side; the run times
sentence-transformers first and again last, because the shared host's speed drifts over minutes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.embed_client import EmbedBatch
from benchmarks.load_client import LoadRun
from benchmarks.metrics import LatencyStats
from benchmarks.report import format_ms

ST = "sentence-transformers"


@dataclass(frozen=True, slots=True)
class EmbedRow:
    """One measured configuration.

    Attributes:
        config: "sentence-transformers", "spindle" or "spindle-batched".
        concurrency: requests in flight (sentence-transformers: its batch size).
        sentences_per_request: sentences in one request (sentence-transformers: one encode batch).
        num_sentences: sentences in the timed workload.
        num_embedded: sentences answered correctly.
        duration_s: wall time from the first send to the last answer.
        total_tokens: tokens of the sentences answered correctly.
        latency: per-request latency; None for sentence-transformers (one call).
        num_failed_requests: requests that failed or were answered wrongly.
        errors: the first few distinct failure texts.
        min_cosine: lowest cosine between a vector and sentence-transformers' for the same sentence.
        error: why the whole configuration could not run (then the figures are zeros).
        worker_busy: spindle only: the share of the timed run's wall time the worker spent in each
            step phase (services/worker/step_phases.py); what is left, it waited for rounds.
        cpu_ms_per_request: spindle only: CPU milliseconds per request of each of the server's
            processes by role, and of the load client (benchmarks/process_cpu.py): where the
            host work around the model goes.
    """

    config: str
    concurrency: int
    sentences_per_request: int
    num_sentences: int
    num_embedded: int
    duration_s: float
    total_tokens: int
    latency: LatencyStats | None = None
    num_failed_requests: int = 0
    errors: tuple[str, ...] = field(default=())
    min_cosine: float | None = None
    error: str | None = None
    worker_busy: dict[str, float] | None = None
    cpu_ms_per_request: dict[str, float] | None = None

    @property
    def sentences_per_s(self) -> float:
        return self.num_embedded / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.duration_s if self.duration_s > 0 else 0.0


def failed_row(config: str, concurrency: int, sentences_per_request: int, num_sentences: int,
               error: str) -> EmbedRow:
    return EmbedRow(config, concurrency, sentences_per_request, num_sentences, 0, 0.0, 0, error=error)


def row_from_load(config: str, concurrency: int, sentences_per_request: int, batches: Sequence[EmbedBatch],
                  run: LoadRun, min_cosine: float | None) -> EmbedRow:
    """A spindle row: run.results are in `batches` order, so sentences are counted per successful batch."""
    ok = [b for b, r in zip(batches, run.results, strict=True) if r.is_success]
    s = run.summary
    return EmbedRow(config, concurrency, sentences_per_request, sum(len(b.texts) for b in batches),
                    sum(len(b.texts) for b in ok), s.duration_s, sum(b.num_tokens for b in ok), s.e2e,
                    s.num_failed, s.errors, min_cosine)


def st_reference(rows: Sequence[EmbedRow]) -> float:
    """sentence-transformers' sentences/s in this run: the mean of its rows (0 without one)."""
    speeds = [r.sentences_per_s for r in rows if r.config == ST and r.error is None]
    return sum(speeds) / len(speeds) if speeds else 0.0


def ratio_to_st(row: EmbedRow, rows: Sequence[EmbedRow]) -> float | None:
    """row's sentences/s over sentence-transformers' (`st_reference`) in the same run; None for its
    own rows or without one."""
    reference = st_reference(rows)
    if row.config == ST or row.error is not None or reference <= 0:
        return None
    return row.sentences_per_s / reference


TABLE_HEADER = ("config", "conc", "sent/req", "sentences/s", "tokens/s", "p50", "p99", "/ST", "min cos", "notes")


def format_table(rows: Sequence[EmbedRow]) -> str:
    """A Markdown table, one line per row."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    for row in rows:
        if row.error is not None:
            cells = [row.config, str(row.concurrency), str(row.sentences_per_request), "", "", "", "", "", "",
                     f"FAILED: {row.error}"]
        else:
            ratio = ratio_to_st(row, rows)
            notes = [f"{row.num_failed_requests} requests failed: {row.errors[0]}"] if row.num_failed_requests else []
            cells = [row.config, str(row.concurrency), str(row.sentences_per_request), f"{row.sentences_per_s:,.1f}",
                     f"{row.tokens_per_s:,.0f}", format_ms(row.latency.p50_ms) if row.latency else "",
                     format_ms(row.latency.p99_ms) if row.latency else "", "" if ratio is None else f"{ratio:.2f}",
                     "" if row.min_cosine is None else f"{row.min_cosine:.5f}", "; ".join(notes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + format_worker_busy(rows) + format_cpu_per_request(rows)


def format_worker_busy(rows: Sequence[EmbedRow]) -> str:
    """Where the worker's time went in each spindle row, as shares of the run's wall time ("" if unmeasured).

    The idle share is the time the worker waited for its next round: what the frontend, the
    scheduler and the transport between them cost the model.
    """
    measured = [r for r in rows if r.worker_busy]
    if not measured:
        return ""
    phases = [p for p in dict.fromkeys(p for r in measured for p in r.worker_busy or {})
              if any((r.worker_busy or {}).get(p, 0.0) > 0 for r in measured)]
    lines = ["", "Worker time by step phase, share of the run's wall time:", "",
             "| config | conc | " + " | ".join(phases) + " | idle |", "|---|---|" + "---|" * (len(phases) + 1)]
    for r in measured:
        busy = r.worker_busy or {}
        idle = max(0.0, 1.0 - sum(busy.values()))
        lines.append(f"| {r.config} | {r.concurrency} | " + " | ".join(f"{busy.get(p, 0.0):.1%}" for p in phases)
                     + f" | {idle:.1%} |")
    return "\n".join(lines) + "\n"


def format_cpu_per_request(rows: Sequence[EmbedRow]) -> str:
    """CPU ms per request by process in each spindle row ("" if unmeasured): at one request in
    flight everything but the worker's forward pass is latency the model waits through."""
    measured = [r for r in rows if r.cpu_ms_per_request]
    if not measured:
        return ""
    roles = list(dict.fromkeys(role for r in measured for role in r.cpu_ms_per_request or {}))
    lines = ["", "CPU ms per request, by process:", "",
             "| config | conc | " + " | ".join(roles) + " |", "|---|---|" + "---|" * len(roles)]
    for r in measured:
        cpu = r.cpu_ms_per_request or {}
        lines.append(f"| {r.config} | {r.concurrency} | " + " | ".join(f"{cpu.get(role, 0.0):.2f}" for role in roles)
                     + " |")
    return "\n".join(lines) + "\n"


def rows_to_json(rows: Sequence[EmbedRow]) -> list[dict[str, object]]:
    """Every row with its derived figures, for the results JSON."""
    out = []
    for row in rows:
        out.append({
            "config": row.config, "concurrency": row.concurrency, "sentences_per_request": row.sentences_per_request,
            "num_sentences": row.num_sentences, "num_embedded": row.num_embedded, "duration_s": row.duration_s,
            "total_tokens": row.total_tokens, "sentences_per_s": row.sentences_per_s,
            "tokens_per_s": row.tokens_per_s, "latency_ms": None if row.latency is None else {
                "mean": row.latency.mean_ms, "p50": row.latency.p50_ms, "p90": row.latency.p90_ms,
                "p99": row.latency.p99_ms},
            "num_failed_requests": row.num_failed_requests, "errors": list(row.errors),
            "min_cosine_vs_st": row.min_cosine, "ratio_vs_st": ratio_to_st(row, rows), "error": row.error,
            "worker_busy": row.worker_busy, "cpu_ms_per_request": row.cpu_ms_per_request,
        })
    return out
