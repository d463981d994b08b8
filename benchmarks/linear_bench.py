"""The linear kernel (`torch.ops.spindle.linear_small_m`) against oneDNN's GEMM on a packed copy,
side by side in one run, at a benchmark model's layer shapes and decode row counts.

What the worker's start-up calibration decides from (models/fast_linear.py), shown whole: for
each shape (fused qkv, o, fused gate_up, down, LM head) and row count, the median microseconds a
call of each, their samples interleaved, weights hot in cache (a decode step's layers share the
last-level cache on the small model; the medium model's stream from memory and the calibration
times them so). `--dtype bfloat16`: bf16 activations and weights, as a `--dtype bfloat16` model
runs them (on AVX512-BF16 the kernel takes k in pairs).

    python -m benchmarks.linear_bench --model small --rows 16,64
    python -m benchmarks.linear_bench --model medium --dtype bfloat16 --rows 1,8,64 --threads 1

`--stack`: instead, a whole decode step's weights (every layer's linears, then the LM head, each
layer its own copy, as a model holds them, on 2 MB pages as the worker's: services/worker/
__init__.py) through the kernel one after another on spindle's work pool, as the worker's layer
stack calls it, against the read bandwidth measured in the same process before each row count
(`benchmarks.machine_limits`): the kernel's own fraction of the single-stream limit, without
the rest of the step (norms, attention, sampling, the services). Medium model, bf16, 2-core AMD
EPYC Zen 4 (2026-11-30, three rounds): 1 row 0.92-0.98 of the bandwidth, 4 rows 0.67-0.69.

    python -m benchmarks.linear_bench --model medium --dtype bfloat16 --rows 1 --stack
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.fused_ops_bench import paired_us
from benchmarks.limit import machine_cores
from benchmarks.machine_limits import read_bandwidth
from benchmarks.models import BENCH_MODELS
from services.worker.kernels.build import load_kernels
from services.worker.models.fast_linear import set_one_row_pairs
from services.worker.models.native_stack import work_pool_scope
from services.worker.models.prepacked_linear import OneDnnWeight


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one decoder layer's linears and the LM head."""
    spec = BENCH_MODELS[model]
    head_dim = spec.hidden_size // spec.num_heads
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * head_dim
    return [("qkv", qkv, spec.hidden_size), ("o", spec.hidden_size, spec.num_heads * head_dim),
            ("gate_up", 2 * spec.intermediate_size, spec.hidden_size),
            ("down", spec.hidden_size, spec.intermediate_size), ("lm_head", spec.vocab_size, spec.hidden_size)]


def bench(shapes: Sequence[tuple[str, int, int]], rows: Sequence[int], dtype: torch.dtype,
          repeats: int) -> list[tuple[str, int, float, float]]:
    """(shape label, rows, kernel us, oneDNN us) for every shape and row count."""
    load_kernels()
    out = []
    for name, n, k in shapes:
        gen = torch.Generator().manual_seed(n * 31 + k)
        weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
        packed = OneDnnWeight()
        packed.get(weight, None, dtype)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            kernel_us, onednn_us = paired_us(
                lambda x=x, w=weight: torch.ops.spindle.linear_small_m(x, w, None),
                lambda x=x, w=weight, p=packed: p.linear(x, w, None), repeats, 20)
            out.append((f"{name} {n} x {k}", m, kernel_us, onednn_us))
    return out


@dataclass(frozen=True, slots=True)
class StackPass:
    rows: int
    weight_bytes: int
    seconds: float  # the fastest pass of the whole stack
    read_bytes_per_s: float  # the machine's read bandwidth, measured just before

    @property
    def fraction(self) -> float:
        return self.weight_bytes / self.seconds / self.read_bytes_per_s


def stack_weights(model: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """A decode step's linear weights in the order the step reads them: each layer's, then the LM head."""
    spec = BENCH_MODELS[model]
    shapes = layer_shapes(model)
    layers = [(n, k) for name, n, k in shapes if name != "lm_head"] * spec.num_layers
    head = [(n, k) for name, n, k in shapes if name == "lm_head"]
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype) for n, k in layers + head]


def stack_passes(weights: Sequence[torch.Tensor], rows: Sequence[int], rounds: int, repeats: int,
                 bandwidth: Callable[[], float] = read_bandwidth) -> list[StackPass]:
    """Per round and row count, the fastest of `repeats` passes over `weights` and the bandwidth
    measured just before (rounds interleave the two, so a drifting host moves both). One row of
    bf16 takes the path the worker's loader picks for this many weight bytes (k pairs only where
    they fit in half the last-level cache: then they are read from the cache, and the fraction
    of the memory bandwidth can pass 1)."""
    load_kernels()
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    set_one_row_pairs(weight_bytes)
    out = []
    for _ in range(rounds):
        for m in rows:
            xs = {k: torch.randn(m, k).to(weights[0].dtype) for k in {w.shape[1] for w in weights}}
            limit = bandwidth()
            best = float("inf")
            with torch.inference_mode(), work_pool_scope():  # (torch's own sum outside it: all threads)
                for _ in range(repeats):
                    start = time.perf_counter()
                    for w in weights:
                        torch.ops.spindle.linear_small_m(xs[w.shape[1]], w, None)
                    best = min(best, time.perf_counter() - start)
            out.append(StackPass(m, weight_bytes, best, limit))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(BENCH_MODELS))
    p.add_argument("--rows", default="1,8,16,64,128", help="comma list of decode row counts")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=machine_cores())
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--stack", action="store_true",
                   help="a whole decode step's weights from memory against the read bandwidth (see above)")
    p.add_argument("--rounds", type=int, default=3, help="--stack: rounds, each measuring the bandwidth again")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    if args.stack:
        weights = stack_weights(args.model, getattr(torch, args.dtype))
        print(f"{args.model} model, {args.dtype}, {args.threads} threads, {len(weights)} weight matrices, "
              f"fastest of {args.repeats} passes a round")
        print("| rows | weights MB | pass ms | GB/s | read bandwidth GB/s | fraction |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in stack_passes(weights, rows, args.rounds, args.repeats):
            gb_per_s = r.weight_bytes / r.seconds / 1e9
            print(f"| {r.rows} | {r.weight_bytes / 1e6:.1f} | {r.seconds * 1e3:.2f} | {gb_per_s:.1f} "
                  f"| {r.read_bytes_per_s / 1e9:.1f} | {r.fraction:.2f} |", flush=True)
        return
    results = bench(layer_shapes(args.model), rows, getattr(torch, args.dtype), args.repeats)
    print(f"{args.model} model, {args.dtype}, {args.threads} threads, median us a call (hot weights)")
    print("| shape | rows | kernel us | oneDNN us | kernel / oneDNN |")
    print("| --- | --- | --- | --- | --- |")
    for shape, m, kernel_us, onednn_us in results:
        print(f"| {shape} | {m} | {kernel_us:.1f} | {onednn_us:.1f} | {kernel_us / onednn_us:.2f}x |")


if __name__ == "__main__":
    main()
