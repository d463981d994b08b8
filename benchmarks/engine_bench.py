"""The ENGINE: spindle's worker runner (kernels, multi-step rounds) driven in process, no services.

Why: a served stream's tokens/s mixes two costs, the engine's steps and the services around
them (per token, two gRPC hops and an SSE write, on the same cores as the model's threads).
This drives the very `ModelRunner` a worker runs, loaded the way the worker loads it, with the
rounds built here: every request admitted at once with its blocks allocated up front, the
prompts in round 0 (which then decodes `--steps - 1` more tokens, as served), then `--steps`
decode steps a round until every request has `--output-len` tokens. So served / engine is
what serving costs, and engine / a peer's server the engine's own speed, when measured
minutes apart on the same host. Prints decode tokens/s (round 0 excluded), tokens/s with round
0 (the prompts all at once: served, they arrive spread out) and the worker's step phases (ms
per decode step, `spindle:worker_step_phase_seconds` in process).

    python -m benchmarks.engine_bench --model small --concurrency 1,64
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.models import BENCH_MODELS, ensure_model
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.step_output import SampledStep
from services.worker.step_phases import PHASES
from services.worker.worker import Worker
from shared.execute import CachedRequestData, ExecuteRound, NewRequestData
from shared.sampling import SamplingOptions
from shared.startup_heap import freeze_startup_heap


@dataclass(frozen=True, slots=True)
class EngineRun:
    concurrency: int
    decode_tokens_per_s: float
    tokens_per_s: float  # every output token over the whole run, the prompts' round included
    num_decode_steps: int
    phase_ms: dict[str, float]  # per decode step
    prompts: list[list[int]]
    outputs: list[list[int]]  # each prompt's output tokens


def _rounds(prompts: list[list[int]], output_len: int, steps: int,
            per_request: int) -> Iterator[tuple[ExecuteRound, dict[str, list[int]]]]:
    """Yields each round to run, with the outputs so far (updated by the caller's steps);
    request k owns KV blocks [k * per_request, (k + 1) * per_request)."""
    sampling = SamplingOptions(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"engine-{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    new = [NewRequestData(rid, prompt, len(prompt), 0, list(range(k * per_request, (k + 1) * per_request)), sampling)
           for k, (rid, prompt) in enumerate(zip(ids, prompts, strict=True))]
    yield ExecuteRound(round_id=0, num_steps=steps, new_requests=new, cached_requests=CachedRequestData(),
                       num_scheduled_tokens=[len(p) for p in prompts], finished_request_ids=[]), outputs
    running = ids
    for round_id in range(1, output_len + 1):
        finished = [rid for rid in running if len(outputs[rid]) >= output_len]  # the worker forgets them
        running = [rid for rid in running if len(outputs[rid]) < output_len]
        if not running:
            return
        yield ExecuteRound(round_id=round_id, num_steps=steps, new_requests=[],
                           cached_requests=CachedRequestData(running, [[] for _ in running]),
                           num_scheduled_tokens=[1] * len(running), finished_request_ids=finished), outputs


def run_engine(runner: ModelRunner, block_size: int, vocab_size: int, concurrency: int, input_len: int,
               output_len: int, steps: int, seed: int = 0) -> EngineRun:
    """One workload on a fresh runner state: `concurrency` requests of random prompt tokens."""
    if output_len <= steps:
        raise SystemExit(f"--output-len {output_len} must exceed --steps {steps}: round 0 alone would produce it")
    runner.reset()
    per_request = -(-(input_len + output_len + steps) // block_size)  # KV blocks, allocated up front
    needed = concurrency * per_request
    if needed > runner.kv_caches[0].shape[1]:
        raise SystemExit(f"{concurrency} streams need {needed} KV blocks; the cache has {runner.kv_caches[0].shape[1]}")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, vocab_size, input_len).tolist() for _ in range(concurrency)]
    start = time.perf_counter()
    decode_start = 0.0
    num_steps = 0
    phases_before: dict[str, float] = {}
    for round_, outputs in _rounds(prompts, output_len, steps, per_request):
        if round_.round_id == 1:
            decode_start, phases_before = time.perf_counter(), dict(runner.phases.totals)

        def on_step(step: SampledStep, outputs: dict[str, list[int]] = outputs) -> None:
            out = step.to_step_output()
            for rid, token in zip(out.request_ids, out.token_ids, strict=True):
                if len(outputs[rid]) < output_len:
                    outputs[rid].append(token)

        runner.execute_round(round_, on_step)
        num_steps += round_.num_steps if round_.round_id > 0 else 0
    end = time.perf_counter()
    total_tokens = sum(len(o) for o in outputs.values())
    decode_tokens = total_tokens - concurrency * steps  # round 0's excluded
    phase_ms = {p: (runner.phases.totals[p] - phases_before.get(p, 0.0)) * 1000 / max(num_steps, 1) for p in PHASES}
    return EngineRun(concurrency, decode_tokens / (end - decode_start), total_tokens / (end - start), num_steps,
                     phase_ms, prompts, list(outputs.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small",
                   help=f"a benchmark model ({', '.join(BENCH_MODELS)}) or a checkpoint directory")
    p.add_argument("--concurrency", default="1,64", help="comma list of batch sizes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="decode steps per round (--num-scheduler-steps)")
    p.add_argument("--dtype", default="auto", help="activations (--dtype of the worker)")
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--greedy-step", choices=("on", "off", "both"), default="on",
                   help="plain greedy decode steps in one kernel call (models/greedy_step.py); both: each "
                        "repeat runs with it and then without it, on the same loaded model")
    args = p.parse_args()
    model_dir = str(ensure_model(args.model)) if args.model in BENCH_MODELS else args.model
    worker = Worker(WorkerConfig(model=model_dir, dtype=args.dtype, weight_dtype=args.weight_dtype,
                                 kv_cache_dtype=args.kv_cache_dtype, num_threads=args.threads))
    runner = worker.runner
    assert isinstance(runner, ModelRunner), "the engine bench runs decoder models"
    freeze_startup_heap()  # as the worker service does: full GC passes would walk the start-up heap mid-run
    print(f"engine: {model_dir}, {torch.get_num_threads()} threads, {args.input_len} prompt + {args.output_len} "
          f"output tokens, {args.steps} steps a round")
    shown = [p for p in PHASES if p not in ("encode", "pool")]
    print("| streams | run | greedy step | decode tok/s | with the prompts' round | "
          + " | ".join(f"{p} ms" for p in shown) + " |")
    greedy_step = getattr(runner.model, "greedy_step", None)
    variants = {"on": (True,), "off": (False,), "both": (True, False)}[args.greedy_step]
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for repeat in range(args.repeats):
            for on in variants:
                if greedy_step is not None:
                    runner.model.greedy_step = greedy_step if on else None
                run = run_engine(runner, worker.info.block_size, worker.info.vocab_size, concurrency,
                                 args.input_len, args.output_len, args.steps, seed=repeat)
                cells = " | ".join(f"{run.phase_ms[p]:.2f}" for p in shown)
                label = "n/a" if greedy_step is None else "on" if on else "off"
                print(f"| {concurrency} | {repeat + 1} | {label} | {run.decode_tokens_per_s:,.1f} "
                      f"| {run.tokens_per_s:,.1f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
