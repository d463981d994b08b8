"""Encoder attention on packed sentences: spindle's batch kernel against torch's sdpa loop, in one run.

What an embedding model's layers call (attention/packed_encoder.py): bidirectional attention
within each sentence of a packed batch, no padding. The kernel (kernels/csrc/encoder_attention.cpp)
does the whole batch in one call; the fallback, where the kernels are not built, runs torch's
sdpa once per sentence. Shapes are all-MiniLM-L6-v2's (12 heads of 32), the query, key and value
views of one fused projection as the model passes them; batches of one sentence (a request at
concurrency 1) and of many of mixed lengths (a busy round). Median of `--repeats` calls of each,
interleaved, after a warm-up; GFLOP/s counts the two matmuls (4 L^2 head_dim per head).

    python -m benchmarks.encoder_attention_bench
    python -m benchmarks.encoder_attention_bench --threads 1 --repeats 200
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from benchmarks.limit import machine_cores
from services.worker.attention import AttentionType, CommonAttentionMetadata, LayerAttentionSpec, create_backend
from services.worker.attention.packed_encoder import EncoderAttention, PackedEncoderMetadataBuilder
from services.worker.kernels.build import load_kernels

HEADS, HEAD_DIM = 12, 32  # all-MiniLM-L6-v2
SPEC = LayerAttentionSpec(HEADS, HEADS, HEAD_DIM, HEAD_DIM**-0.5)


def batches(seed: int = 0) -> dict[str, list[int]]:
    """Sentence lengths in tokens per batch: one sentence, and mixed rounds."""
    rng = np.random.default_rng(seed)
    return {"1 x 116 tokens": [116], "1 x 250 tokens": [250], "8 x 12-40 tokens": rng.integers(12, 41, 8).tolist(),
            "32 x 12-250 tokens": rng.integers(12, 251, 32).tolist()}


def _inputs(lens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    host = np.asarray(lens, np.int64)
    starts = np.concatenate(([0], np.cumsum(host)))
    common = CommonAttentionMetadata(
        attn_type=AttentionType.ENCODER_ONLY, num_reqs=len(lens), num_tokens=int(host.sum()),
        max_query_len=int(host.max()), max_seq_len=int(host.max()), query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(host), query_lens_host=host, seq_lens_host=host)
    qkv = torch.randn(int(host.sum()), 3 * HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    q, k, v = (t.view(-1, HEADS, HEAD_DIM) for t in qkv.split(HEADS * HEAD_DIM, -1))
    return q, k, v, PackedEncoderMetadataBuilder().build(common, [])


def _median_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] * 1e6 for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=machine_cores())
    args = p.parse_args(argv)
    load_kernels()
    torch.set_num_threads(args.threads)
    kernel, loop = EncoderAttention(create_backend("sdpa", 16)), EncoderAttention(create_backend("sdpa", 16))
    loop.batch_kernel = False
    if not kernel.runs_kernel(_inputs([2])[3]):
        raise SystemExit("the batch kernel is off here (kernels not built, or SPINDLE_DISABLE_FUSED_KERNELS=1)")
    out = sys.stdout
    out.write(f"encoder attention, {HEADS} heads of {HEAD_DIM}, {args.threads} threads, median us of {args.repeats}\n")
    out.write("| batch | kernel us | GFLOP/s | sdpa loop us | GFLOP/s | loop / kernel |\n|---|---|---|---|---|---|\n")
    with torch.inference_mode():
        for label, lens in batches().items():
            inputs = _inputs(lens)  # the same tensors for both
            calls = {"kernel": partial(kernel.forward, SPEC, *inputs), "loop": partial(loop.forward, SPEC, *inputs)}
            torch.testing.assert_close(calls["kernel"](), calls["loop"](), atol=1e-5, rtol=1e-5)
            us = _median_us(calls, args.repeats)
            flop = 4.0 * HEAD_DIM * HEADS * sum(n * n for n in lens)
            out.write(f"| {label} | {us['kernel']:,.0f} | {flop / us['kernel'] / 1e3:.0f} | {us['loop']:,.0f} | "
                      f"{flop / us['loop'] / 1e3:.0f} | {us['loop'] / us['kernel']:.2f} |\n")


if __name__ == "__main__":
    main()
