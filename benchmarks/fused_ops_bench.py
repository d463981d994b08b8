"""The decoder's fused CPU kernels against the torch ops they replace, side by side in one run.

Medium benchmark model shapes by default (hidden 1024, intermediate 2816, 16 query / 4 KV heads
of 64, 8 layers; `--model small`: hidden 256, 4 layers), fp32, decode steps of 1, 16 and 64 rows
(one token per row, 192-token contexts):

- add + RMSNorm: `residual + x` and RMSNorm's torch ops vs `torch.ops.spindle.add_rms_norm`;
- SiLU * mul: split, `F.silu(gate) * up` vs `act_and_mul` over the gate_up output;
- rotary + KV write + paged attention: `RotaryEmbedding` then the paged kernel vs the kernel
  rotating q and k itself (`forward_rotary`); the rotary ops alone are timed too;
- the model's whole decode forward pass with the fused path off vs on;
- the whole forward pass through the fused Python layer loop vs the one-call layer stack
  (models/native_stack.py), at the row counts the stack takes.

Each figure is the median over `--repeats` samples, the two variants of a pair alternating
sample by sample so that load from other processes hits both alike.

    python -m benchmarks.fused_ops_bench
    python -m benchmarks.fused_ops_bench --rows 1,16,64 --repeats 30
    python -m benchmarks.fused_ops_bench --model small --rows 1,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.attention_bench import BLOCK_SIZE, decode_metadata, random_kv_caches
from benchmarks.limit import machine_cores
from benchmarks.models import ensure_model
from services.worker.attention import create_backend
from services.worker.models.loader import load_model

CONTEXT = 192  # tokens per row: the middle of a 128-prompt, 128-output request


def paired_us(a: Callable[[], object], b: Callable[[], object], repeats: int, calls: int) -> tuple[float, float]:
    """Median microseconds per call of a and of b, their samples interleaved."""
    times: tuple[list[float], list[float]] = ([], [])
    for fn in (a, b):
        fn()  # warm-up
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def bench_rows(model: torch.nn.Module, rows: int, repeats: int) -> list[tuple[str, float, float]]:
    """(op, torch us, fused us) per op at `rows` decode rows."""
    config = model.config
    gen = torch.Generator().manual_seed(rows)
    hidden, inter = config.hidden_size, config.intermediate_size
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    norm = model.layers[0].post_attention_layernorm
    gate_up = torch.randn(rows, 2 * inter, generator=gen)

    def norm_torch() -> object:
        s = residual + x
        return norm._torch_forward(s)

    def act_torch() -> object:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    out = [("add + RMSNorm", *paired_us(norm_torch, lambda: torch.ops.spindle.add_rms_norm(
        x, residual, norm.weight, norm.eps, False), repeats, 50)),
        ("SiLU(gate) * up", *paired_us(act_torch, lambda: torch.ops.spindle.act_and_mul(gate_up, 0), repeats, 50))]

    seq_lens = np.full(rows, CONTEXT)
    num_blocks = int((-(-seq_lens // BLOCK_SIZE)).sum()) + 8
    attn = model.layers[0].self_attn
    caches = random_kv_caches(config, num_blocks, attn.backend.head_major_cache)
    cache = caches[0]
    meta = attn.backend.metadata_builder().build(decode_metadata(seq_lens, num_blocks), [])
    h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = torch.randn(rows, (h + 2 * kvh) * d, generator=gen)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)
    positions = torch.from_numpy(seq_lens - 1)
    backend, spec, rope = attn.backend, attn.spec, attn.rope

    def attention_torch_rope() -> object:
        qr, kr = rope(positions, q, k)
        return backend.forward(spec, qr, kr, v, cache, meta)

    def attention_fused_rope() -> object:
        return backend.forward_rotary(spec, q, k, v, cache, meta, positions, rope.cos, rope.sin)

    out.append(("rotary + KV write + attention", *paired_us(attention_torch_rope, attention_fused_rope, repeats, 20)))
    rope_alone = paired_us(lambda: rope(positions, q, k), lambda: None, repeats, 50)[0]
    out.append(("  of which torch's rotary ops", rope_alone, 0.0))

    common = decode_metadata(seq_lens, num_blocks)
    ids = torch.randint(0, config.vocab_size, (rows,), generator=gen)
    builder = backend.metadata_builder()
    stack = model.native_stack
    layers = f"{config.num_layers} layers"

    def step(fused: bool) -> object:
        model.use_fused_kernels(fused)
        return model(ids, positions, caches, builder.build(common, []))

    def step_through(native: bool) -> object:
        model.native_stack = stack if native else None
        return model(ids, positions, caches, builder.build(common, []))

    if stack is not None and rows <= stack.max_rows:
        out.append((f"decode forward pass ({layers}), Python loop -> one-call stack",
                    *paired_us(lambda: step_through(False), lambda: step_through(True), repeats, 3)))
    out.append((f"decode forward pass ({layers}), torch ops -> fused, Python loop",
                *paired_us(lambda: step(False), lambda: step(True), repeats, 3)))
    model.use_fused_kernels(True)
    model.native_stack = stack
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_ops_bench", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64", help="comma list of decode batch sizes")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=machine_cores())
    p.add_argument("--model", default="medium", help="benchmark model (benchmarks/models.py)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_model(ensure_model(a.model), create_backend("paged", BLOCK_SIZE), torch.float32,
                       torch.device("cpu"))
    out = sys.stdout
    out.write(f"{a.model} model, fp32, {a.threads} threads, {CONTEXT}-token contexts, median of {a.repeats} "
              "interleaved samples (us per call; the forward pass per step)\n")
    out.write("| rows | op | before us | after us | speed-up |\n| --- | --- | --- | --- | --- |\n")
    with torch.inference_mode():
        for rows in (int(r) for r in a.rows.split(",") if r):
            for op, before, after in bench_rows(model, rows, a.repeats):
                ratio = f"{before / after:.2f}x" if after else ""
                fused = f"{after:.1f}" if after else ""
                out.write(f"| {rows} | {op} | {before:.1f} | {fused} | {ratio} |\n")
                out.flush()


if __name__ == "__main__":
    main()
