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
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from benchmarks.fused_ops_bench import paired_us
from benchmarks.limit import machine_cores
from benchmarks.models import BENCH_MODELS
from services.worker.kernels.build import load_kernels
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


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(BENCH_MODELS))
    p.add_argument("--rows", default="1,8,16,64,128", help="comma list of decode row counts")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=machine_cores())
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = bench(layer_shapes(args.model), rows, getattr(torch, args.dtype), args.repeats)
    print(f"{args.model} model, {args.dtype}, {args.threads} threads, median us a call (hot weights)")
    print("| shape | rows | kernel us | oneDNN us | kernel / oneDNN |")
    print("| --- | --- | --- | --- | --- |")
    for shape, m, kernel_us, onednn_us in results:
        print(f"| {shape} | {m} | {kernel_us:.1f} | {onednn_us:.1f} | {kernel_us / onednn_us:.2f}x |")


if __name__ == "__main__":
    main()
