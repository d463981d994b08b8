"""Decode step time, padded `sdpa` vs the in-place `paged` CPU backend, side by side in one run.

Two batch shapes of 64 rows on the medium benchmark model (hidden 1024, 8 layers, 16 query / 4
KV heads of 64; `--model small`: 4 layers, 8 / 2 heads of 32), fp32 (`--dtype bfloat16`: the
model, queries and cache in bf16, as the worker's `--dtype bfloat16`), one new token per row;
`--kv-cache-dtypes float32,bfloat16` times the paged backend on each of those caches
(`--kv-cache-dtype`; a 16-bit cache under fp32 queries is read widened block by block):

- equal: every row has the same context (`--contexts`, each a shape);
- skewed: one row of `--long` tokens and 63 of `--short` (issue 14: with a gathered, padded
  KV one long request makes the whole batch pay for its length).

For each it times (1) the attention of one step (8 layers: KV write plus attention, metadata
built once) and (2) the model's whole decode forward pass, median of `--repeats` runs after a
warm-up. The cache's blocks are shuffled over the pool, as a busy server leaves them.

    python -m benchmarks.attention_bench
    python -m benchmarks.attention_bench --contexts 128,1024 --long 2048 --short 128 --repeats 20
    python -m benchmarks.attention_bench --model small --contexts 160,1024
    python -m benchmarks.attention_bench --contexts 192,1024,4096 --kv-cache-dtypes float32,bfloat16
    python -m benchmarks.attention_bench --dtype bfloat16 --contexts 256,1024
    python -m benchmarks.attention_bench --model medium-long --contexts 256 --prefill-contexts 512,2048,4096

With `--dtype bfloat16` on a CPU with AVX512-BF16, decode runs on bf16 pairs read in place;
`SPINDLE_DISABLE_ATTENTION_PAIRS=1` widens each block first, as before (side-by-side runs).

`--prefill-contexts` adds a table for chunked prefill: one row whose last chunk of queries
(`--prefill-chunk`, 2048) attends to a cached prompt of that many tokens, all layers, with
GFLOP/s (`SPINDLE_DISABLE_PREFILL_TILES=1` runs the paged kernel's per-query loop instead of its
prefill tiles, for side-by-side runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks.limit import machine_cores
from benchmarks.models import ensure_model
from services.worker.attention import AttentionBackend, AttentionType, CommonAttentionMetadata, create_backend
from services.worker.kv_cache import allocate_kv_caches
from services.worker.models.config import DecoderConfig
from services.worker.models.loader import load_model

BLOCK_SIZE = 16


def decode_metadata(seq_lens: np.ndarray, num_blocks: int, seed: int = 0) -> CommonAttentionMetadata:
    """One decode token per row; blocks drawn at random from the pool."""
    rng = np.random.default_rng(seed)
    blocks_per_row = -(-seq_lens // BLOCK_SIZE)
    pool = rng.permutation(num_blocks)[: blocks_per_row.sum()]
    tables = np.zeros((len(seq_lens), blocks_per_row.max()), np.int64)
    starts = np.cumsum(blocks_per_row) - blocks_per_row
    for r, n in enumerate(blocks_per_row):
        tables[r, :n] = pool[starts[r] : starts[r] + n]
    pos = seq_lens - 1
    slots = tables[np.arange(len(seq_lens)), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    ones = np.ones(len(seq_lens), np.int64)
    return CommonAttentionMetadata(
        attn_type=AttentionType.DECODER,
        num_reqs=len(seq_lens),
        num_tokens=len(seq_lens),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.arange(len(seq_lens) + 1),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int64)),
        query_lens_host=ones,
        seq_lens_host=seq_lens.astype(np.int64),
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.from_numpy(slots),
    )


def prefill_metadata(context: int, chunk: int, num_blocks: int, seed: int = 0) -> CommonAttentionMetadata:
    """One row: the last `chunk` tokens of a `context`-token prompt (the rest cached before), as
    chunked prefill computes a long prompt's later chunks; blocks drawn at random from the pool."""
    rng = np.random.default_rng(seed)
    blocks = -(-context // BLOCK_SIZE)
    table = rng.permutation(num_blocks)[:blocks][None, :].astype(np.int64)
    pos = np.arange(context - chunk, context)
    slots = table[0, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    return CommonAttentionMetadata(
        attn_type=AttentionType.DECODER,
        num_reqs=1,
        num_tokens=chunk,
        max_query_len=chunk,
        max_seq_len=context,
        query_start_loc=torch.tensor([0, chunk]),
        seq_lens=torch.tensor([context]),
        query_lens_host=np.array([chunk]),
        seq_lens_host=np.array([context]),
        block_tables=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots),
    )


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (allocator, first-touch of the cache pages)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def random_kv_caches(config: DecoderConfig, num_blocks: int, head_major: bool,
                     dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """One cache per layer in the worker's layout for a backend (kv_cache.py), filled with N(0, 1)."""
    caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, dtype, torch.device("cpu"), head_major)
    for cache in caches:
        cache.normal_()
    return caches


def time_shape(model: torch.nn.Module, backends: dict[str, tuple[AttentionBackend, torch.dtype]],
               seq_lens: np.ndarray, repeats: int, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """label -> (attention ms per step over all layers, whole forward ms per step), for each
    label's backend on a cache of its dtype."""
    config = model.config
    num_blocks = int((-(-seq_lens // BLOCK_SIZE)).sum()) + 8
    caches_in = {(layout, kv): random_kv_caches(config, num_blocks, layout, kv)  # each backend's layout
                 for layout, kv in {(b.head_major_cache, kv) for b, kv in backends.values()}}
    common = decode_metadata(seq_lens, num_blocks)
    gen = torch.Generator().manual_seed(0)
    t, h, kvh, d = len(seq_lens), config.num_heads, config.num_kv_heads, config.head_dim
    q, k, v = (torch.randn(t, n, d, generator=gen).to(dtype) for n in (h, kvh, kvh))
    ids = torch.randint(0, config.vocab_size, (t,), generator=gen)
    positions = torch.from_numpy(seq_lens - 1)
    spec = model.layers[0].self_attn.spec
    results = {}
    for name, (backend, kv_dtype) in backends.items():
        builder = backend.metadata_builder()
        caches = caches_in[backend.head_major_cache, kv_dtype]

        def attention(backend: AttentionBackend = backend, builder=builder, caches=caches) -> None:
            meta = builder.build(common, [])
            for cache in caches:
                backend.forward(spec, q, k, v, cache, meta)

        def forward(backend: AttentionBackend = backend, builder=builder, caches=caches) -> None:
            for layer in model.layers:
                layer.self_attn.backend = backend
            model(ids, positions, caches, builder.build(common, []))

        with torch.inference_mode():
            results[name] = (median_ms(attention, repeats), median_ms(forward, repeats))
    return results


def time_prefill(model: torch.nn.Module, backends: dict[str, tuple[AttentionBackend, torch.dtype]], context: int,
                 chunk: int, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    """label -> attention ms over all layers for one prefill chunk (`prefill_metadata`)."""
    config = model.config
    num_blocks = -(-context // BLOCK_SIZE) + 8
    common = prefill_metadata(context, chunk, num_blocks)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(chunk, n, config.head_dim, generator=gen).to(dtype)
               for n in (config.num_heads, config.num_kv_heads, config.num_kv_heads))
    spec = model.layers[0].self_attn.spec
    results = {}
    for name, (backend, kv_dtype) in backends.items():
        caches = random_kv_caches(config, num_blocks, backend.head_major_cache, kv_dtype)
        meta = backend.metadata_builder().build(common, [])

        def attention(backend: AttentionBackend = backend, meta=meta, caches=caches) -> None:
            for cache in caches:
                backend.forward(spec, q, k, v, cache, meta)

        with torch.inference_mode():
            results[name] = median_ms(attention, repeats)
    return results


def prefill_gflop(config: DecoderConfig, context: int, chunk: int) -> float:
    """Attention FLOPs of the chunk over all layers: scores and weighted values, 2 x 2 x head_dim
    a (query head, visible key) pair, each query seeing the keys up to its own."""
    pairs = sum(range(context - chunk + 1, context + 1))
    return 4 * config.head_dim * config.num_heads * pairs * config.num_layers / 1e9


def write_prefill_table(model: torch.nn.Module, backends: dict[str, tuple[AttentionBackend, torch.dtype]],
                        contexts: list[int], chunk: int, repeats: int, dtype: torch.dtype) -> None:
    out = sys.stdout
    out.write(f"\nprefill: one row, the last min(context, {chunk}) tokens of the prompt against all of it "
              "(chunked prefill), attention of every layer, median of the repeats\n")
    out.write("| context | chunk | backend, KV cache | attention ms | GFLOP/s |\n")
    out.write("| --- | --- | --- | --- | --- |\n")
    for context in contexts:
        n = min(context, chunk)
        r = time_prefill(model, backends, context, n, repeats, dtype)
        gflop = prefill_gflop(model.config, context, n)
        for name, ms in r.items():
            out.write(f"| {context} | {n} | {name} | {ms:.1f} | {gflop / ms * 1e3:.0f} |\n")
        out.flush()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_bench", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="256,1024", help="comma list: equal-context shapes")
    p.add_argument("--long", type=int, default=2048, help="the long row of the skewed shape")
    p.add_argument("--short", type=int, default=128, help="the 63 short rows of the skewed shape")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=machine_cores())
    p.add_argument("--model", default="medium", help="benchmark model (benchmarks/models.py)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the activations' dtype (queries, new keys and values, the model; --dtype of the worker)")
    p.add_argument("--kv-cache-dtypes", default="",
                   help="comma list: the paged backend's cache dtypes (default --dtype; sdpa reads --dtype's)")
    p.add_argument("--prefill-contexts", default="",
                   help="comma list: also time one long prompt's prefill chunk at these contexts, e.g. 2048,4096")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="query tokens of that chunk (the token budget)")
    a = p.parse_args(argv)
    prefill_contexts = [int(c) for c in a.prefill_contexts.split(",") if c]
    if a.prefill_chunk < 1 or any(c < 1 for c in prefill_contexts):
        p.error(f"--prefill-chunk {a.prefill_chunk} and --prefill-contexts {a.prefill_contexts} must be >= 1")
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    model = load_model(ensure_model(a.model), create_backend("sdpa", BLOCK_SIZE), dtype, torch.device("cpu"))
    backends = {"sdpa": (create_backend("sdpa", BLOCK_SIZE), dtype)}
    for name in (a.kv_cache_dtypes or a.dtype).split(","):
        backends[f"paged {name}"] = (create_backend("paged", BLOCK_SIZE), getattr(torch, name))
    shapes = [(f"equal {a.batch} x {c}", np.full(a.batch, int(c))) for c in a.contexts.split(",") if c]
    shapes.append((f"skewed 1 x {a.long} + {a.batch - 1} x {a.short}",
                   np.array([a.long] + [a.short] * (a.batch - 1))))
    out = sys.stdout
    out.write(f"{a.model} model, {a.dtype}, {a.threads} threads, decode step of {a.batch} rows, "
              f"median of {a.repeats}\n")
    out.write("| shape | backend, KV cache | attention ms | vs sdpa | step ms | vs sdpa |\n")
    out.write("| --- | --- | --- | --- | --- | --- |\n")
    for label, seq_lens in shapes:
        r = time_shape(model, backends, seq_lens, a.repeats, dtype)
        att_s, step_s = r["sdpa"]
        for name, (att, step) in r.items():
            out.write(f"| {label} | {name} | {att:.2f} | {att_s / att:.2f}x | {step:.1f} | {step_s / step:.2f}x |\n")
        out.flush()
    if prefill_contexts:  # the paged backend only: sdpa's padded layout makes a row of every query token
        paged = {name: b for name, b in backends.items() if name != "sdpa"}
        write_prefill_table(model, paged, prefill_contexts, a.prefill_chunk, a.repeats, dtype)


if __name__ == "__main__":
    main()
