"""One decode step of the engine, captured and replayed: where a one-stream step's kernel time goes.

Why: at one stream the worker's compute thread is the critical path, and most of its step is
the layer stack (models/native_stack.py) and the LM head. Timed alone, each reads its weights
hot from the cache; in a served step they come one after the other with the host's work
between steps. This runs a short one-stream workload through the engine (benchmarks/engine_bench.py),
keeps the last decode step's layer-stack call, and times, median microseconds over `--repeats`:

- the stack alone, and the LM head alone (each call's weights hot);
- stack then LM head back to back (the step's whole weight set: does it stay in the last-level
  cache?);
- the same with `--gap-us` of host work between steps (a busy Python loop, as prepare, sampling
  and delivery are): what the gap costs the next step's kernels.

Replaying rewrites the captured step's K/V slot with the same values, so every replay computes
the captured step again (the stack's output is checked against the captured one).

    python -m benchmarks.step_replay --model small --weight-dtype float32,bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.attention_bench import median_ms
from benchmarks.engine_bench import run_engine
from benchmarks.models import BENCH_MODELS, ensure_model
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.models.native_stack import NativeStack, work_pool_scope
from services.worker.worker import Worker


class _Recorder:
    """Stands in for the model's native stack and keeps the last call's arguments and output."""

    def __init__(self, stack: NativeStack) -> None:
        self.stack = stack
        self.args: tuple[Any, ...] | None = None
        self.output: torch.Tensor | None = None

    def __getattr__(self, name: str) -> Any:  # accepts(), max_rows, ... as the stack has them
        return getattr(self.stack, name)

    def __call__(self, *args: Any) -> torch.Tensor:
        self.output = self.stack(*args)
        self.args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return self.output


@dataclass(frozen=True, slots=True)
class CapturedStep:
    stack: NativeStack
    args: tuple[Any, ...]  # the stack call's: hidden, positions, kv_caches, metadata, cos, sin
    output: torch.Tensor  # the stack's output then (final hidden states)
    head: torch.nn.Module  # the LM head (a FastLinear)


def capture_step(runner: ModelRunner, block_size: int, vocab_size: int, input_len: int = 128,
                 output_len: int = 24, steps: int = 8) -> CapturedStep:
    """Run one stream through the engine and keep its last decode step's layer-stack call (with
    the one-call greedy step off, models/greedy_step.py: it runs the same stack from C++)."""
    model = runner.model
    stack = getattr(model, "native_stack", None)
    if stack is None:
        raise SystemExit("this model's layers do not run in one native call here (see the worker's log)")
    recorder = _Recorder(stack)
    greedy_step = getattr(model, "greedy_step", None)
    model.native_stack, model.greedy_step = recorder, None
    try:
        run_engine(runner, block_size, vocab_size, 1, input_len, output_len, steps)
    finally:
        model.native_stack, model.greedy_step = stack, greedy_step
    assert recorder.args is not None and recorder.output is not None
    return CapturedStep(stack, recorder.args, recorder.output.clone(), model.lm_head)


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    return median_ms(fn, repeats) * 1e3


def replay(step: CapturedStep, repeats: int, gap_us: float) -> dict[str, float]:
    """Median microseconds of each replay (the gap's own time subtracted); raises AssertionError
    if the replayed stack does not compute the captured output."""
    hidden = step.output

    def stack() -> torch.Tensor:
        return step.stack(*step.args)

    def head() -> torch.Tensor:
        return torch.ops.spindle.linear_small_m(hidden, step.head.weight, step.head.bias, True)

    def both() -> None:
        stack()
        head()

    def both_then_gap() -> None:
        both()
        end = time.perf_counter() + gap_us * 1e-6
        while time.perf_counter() < end:
            pass

    with torch.inference_mode(), work_pool_scope():  # as a round on the native stack runs
        if not torch.equal(stack(), step.output):
            raise AssertionError("the replayed step does not compute what the captured one did")
        return {
            "stack alone": _median_us(stack, repeats),
            "LM head alone": _median_us(head, repeats),
            "stack + LM head": _median_us(both, repeats),
            f"stack + LM head, {gap_us:g} us gap": _median_us(both_then_gap, repeats) - gap_us,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", help=f"one of {sorted(BENCH_MODELS)} or a model directory")
    p.add_argument("--weight-dtype", default="float32", help="comma list, e.g. float32,bfloat16")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--gap-us", type=float, default=300.0, help="host work between replayed steps")
    p.add_argument("--rounds", type=int, default=3, help="replays of each, interleaved across dtypes")
    args = p.parse_args()
    model_dir = str(ensure_model(args.model)) if args.model in BENCH_MODELS else args.model
    steps = {}
    for dtype in args.weight_dtype.split(","):
        worker = Worker(WorkerConfig(model=model_dir, dtype="float32", weight_dtype=dtype))
        assert isinstance(worker.runner, ModelRunner), "the step replay runs decoder models"
        steps[dtype] = capture_step(worker.runner, worker.info.block_size, worker.info.vocab_size)
    print(f"{model_dir}, {torch.get_num_threads()} threads, median us of {args.repeats} replays of one captured "
          "one-stream decode step")
    for round_ in range(args.rounds):
        for dtype, step in steps.items():
            times = replay(step, args.repeats, args.gap_us)
            if round_ == 0 and dtype == next(iter(steps)):
                print("| weights | round | " + " | ".join(times) + " |")
                print("|---" * (len(times) + 2) + "|")
            print(f"| {dtype} | {round_ + 1} | " + " | ".join(f"{us:,.0f}" for us in times.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
