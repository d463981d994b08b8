"""The C++ paged attention kernel against a dense float64 reference, and its fallback.

Random block tables (blocks shuffled over the pool), ragged query and sequence lengths (decode
rows, chunks after a cached prefix, fresh prompts, rows longer than a tile), GQA, sliding
windows, soft-capping, fp32 and bf16 KV; the keys and values of the pass are written by the
kernel itself, so the test also checks they land at their slots.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.attention import resolve_backend_name
from services.worker.attention.base import LayerAttentionSpec
from services.worker.attention.paged import create, work_items
from services.worker.kernels import build
from tests.worker.attention_cases import ROWS, dense_reference, paged_case


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window", "softcap"),
    [(8, 2, 64, 16, None, None), (4, 4, 32, 4, 7, None), (6, 1, 16, 8, 20, 5.0), (16, 4, 128, 16, 1, None),
     (6, 2, 40, 16, None, None),  # 3 heads a KV head; 40 = a pass of 32 values + one of 8
     (12, 4, 64, 16, None, 30.0), (16, 2, 32, 16, 9, None)],  # 3 and 8 heads a KV head on bf16 pairs
)
def test_kernel_matches_dense_reference(dtype, heads, kv_heads, head_dim, block_size, window, softcap,
                                        head_major) -> None:
    _check_against_reference(dtype, heads, kv_heads, head_dim, block_size, window, softcap, ROWS, head_major)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "threads", "block_size"),
                         [(ROWS, 1, 8), (ROWS[5:7], 2, 16), ([(300, 40), (64, 1)], 2, 16)])
def test_items_over_all_kv_heads_and_one_kv_head_each(rows, threads, block_size, dtype) -> None:
    """With 4+ items per thread an item spans every KV head (blocks read front to back); with fewer,
    each KV head is a piece of work of its own, so one long row still spreads over the threads
    (the last case: prefill tiles of one KV head each)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_against_reference(dtype, 8, 4, 32, block_size, None, None, rows, head_major=True)
    finally:
        torch.set_num_threads(previous)


# Long prefill chunks over many blocks (the prefill tiles' path on AVX-512: 16-key blocks, 8+
# query vectors an item): a chunk after a long cached prefix, a whole prompt, a chunk whose
# tile ends mid-block, and decode rows beside them.
LONG_ROWS = [(300, 150), (257, 257), (1000, 20), (40, 1), (77, 9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window"),
    [(8, 2, 64, None), (16, 4, 64, 50), (4, 4, 32, None), (6, 2, 40, 33), (2, 1, 128, None), (4, 2, 96, 21)],
)
def test_long_prefill_chunks_match_dense_reference(dtype, heads, kv_heads, head_dim, window) -> None:
    _check_against_reference(dtype, heads, kv_heads, head_dim, 16, window, None, LONG_ROWS, head_major=True)


@pytest.mark.parametrize(
    "switch", ["SPINDLE_DISABLE_L2_PREFETCH", "SPINDLE_DISABLE_PREFILL_TILES", "SPINDLE_PREFILL_TILES_AVX2",
               "SPINDLE_DISABLE_ATTENTION_PAIRS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_switches_keep_the_outputs(dtype, switch) -> None:
    """SPINDLE_DISABLE_L2_PREFETCH=1 (prefetcht0), SPINDLE_DISABLE_PREFILL_TILES=1 (prefill tiles
    through the per-query loop), SPINDLE_PREFILL_TILES_AVX2=1 (the tiles' 8-lane form, what an
    AVX2-only CPU runs, on a CPU with AVX-512 too) and SPINDLE_DISABLE_ATTENTION_PAIRS=1 (bf16
    blocks widened before they are scored, what a CPU without AVX512-BF16 runs) run the same kernel
    otherwise: the outputs still match the reference, decode and prefill rows (read once per
    process, so in a fresh interpreter)."""
    probe = f"""
import torch
from tests.worker.test_paged_attention import LONG_ROWS, ROWS, _check_against_reference
for rows in (ROWS, LONG_ROWS):
    _check_against_reference(torch.{str(dtype).split('.')[1]}, 8, 2, 64, 16, None, None, rows, head_major=True)
    _check_against_reference(torch.{str(dtype).split('.')[1]}, 6, 2, 40, 16, 33, None, rows, head_major=True)
print("ok")
"""
    env = {**os.environ, switch: "1"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "ok"


def test_bf16_attention_runs_on_pairs_where_the_cpu_has_them(tmp_path) -> None:
    """With AVX512-BF16 in the build, bf16 decode rows and prefill tiles score on vdpbf16ps pairs
    (decode_pairs.h): their outputs differ from the widening path's
    (SPINDLE_DISABLE_ATTENTION_PAIRS=1) in the last bf16 place here and there (the scale after the
    dot product; in decode the weights meet the values rounded to bf16), and both match the
    reference. Elsewhere the two are one path, and this has nothing to compare."""
    if "avx512_bf16" not in build.kernel_instruction_sets():
        pytest.skip("the kernels were built without AVX512-BF16")
    args = "torch.bfloat16, 8, 2, 64, 16, None, None, ROWS, head_major=True"
    probe = f"""
import torch
from tests.worker.test_paged_attention import ROWS, _check_against_reference
torch.save(_check_against_reference({args}), {str(tmp_path / "widened.pt")!r})
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "SPINDLE_DISABLE_ATTENTION_PAIRS": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    widened = torch.load(tmp_path / "widened.pt")
    pairs = _check_against_reference(torch.bfloat16, 8, 2, 64, 16, None, None, ROWS, head_major=True)
    starts = np.concatenate(([0], np.cumsum([q for _, q in ROWS])))
    decode = [int(starts[r]) for r, (_, q) in enumerate(ROWS) if q == 1]
    assert not torch.equal(pairs[decode], widened[decode])
    tile = slice(int(starts[3]), int(starts[4]))  # the 40-token chunk: prefill tiles
    assert not torch.equal(pairs[tile], widened[tile])


def _check_against_reference(dtype, heads, kv_heads, head_dim, block_size, window, softcap, rows,
                             head_major=False) -> torch.Tensor:
    """The kernel's output on `paged_case`'s inputs, checked row by row against the dense reference."""
    cache, common, query, key, value, full_k, full_v = paged_case(0, heads, kv_heads, head_dim, block_size, dtype, rows,
                                                             head_major)
    layout = cache.stride()
    backend = create(block_size)
    spec = LayerAttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
    if softcap:
        spec = _with_softcap(spec, softcap)
    out = backend.forward(spec, query, key, value, cache, backend.metadata_builder().build(common, []))
    assert out.dtype == dtype and out.shape == query.shape
    starts = common.query_start_loc.tolist()
    for r, (n, q_len) in enumerate(rows):
        expected = dense_reference(query[starts[r] : starts[r + 1]], full_k[r], full_v[r], n - q_len, window, softcap,
                              spec.scale)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        torch.testing.assert_close(out[starts[r] : starts[r + 1]].double(), expected, atol=tol, rtol=tol)
    slots = common.slot_mapping
    written = cache[:, slots // block_size, slots % block_size]  # [2, tokens, kv_heads, head_dim]
    assert torch.equal(written[0], key) and torch.equal(written[1], value)
    assert cache.stride() == layout  # written in place, in its own layout
    return out


def _with_softcap(spec: LayerAttentionSpec, softcap: float):
    """The spec with a logit soft-cap; a stand-in while LayerAttentionSpec has no such field."""
    if "logit_softcap" in LayerAttentionSpec.__dataclass_fields__:
        return LayerAttentionSpec(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale, spec.sliding_window,
                                  logit_softcap=softcap)

    class Capped:
        num_heads, num_kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        scale, sliding_window, logit_softcap = spec.scale, spec.sliding_window, softcap

    return Capped()


def test_bf16_query_over_fp32_cache_and_strided_value_view() -> None:
    """Mixed dtypes convert in the kernel; a value view of a fused qkv output is read as is."""
    cache, common, query, key, value, full_k, full_v = paged_case(3, 4, 2, 32, 16, torch.float32)
    fused = torch.cat([key, value], dim=-1)  # [T, Hkv, 2D]: value as a non-contiguous view
    value_view = fused[..., 32:]
    backend = create(16)
    spec = LayerAttentionSpec(4, 2, 32, 32**-0.5)
    meta = backend.metadata_builder().build(common, [])
    out = backend.forward(spec, query, key, value_view, cache.clone(), meta)
    expected = backend.forward(spec, query, key, value.contiguous(), cache.clone(), meta)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    bf16 = backend.forward(spec, query.bfloat16(), key.bfloat16(), value.bfloat16(), cache.clone(), meta)
    torch.testing.assert_close(bf16.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window"), [(8, 2, 64, None), (6, 3, 20, 9)])
def test_fp32_queries_over_a_16_bit_cache(cache_dtype, heads, kv_heads, head_dim, window, head_major) -> None:
    """--kv-cache-dtype: float32 queries, keys and values; the cache stores them rounded, and the
    output is float32 attention over the rounded keys and values (head_dim 20: a row that is not
    a whole number of 8-wide vectors, for the F16C widening's tail)."""
    cache, common, query, key, value, full_k, full_v = paged_case(4, heads, kv_heads, head_dim, 8, cache_dtype,
                                                             head_major=head_major)
    query, key, value = query.float(), key.float(), value.float()  # rounded values: the cache holds them exactly
    backend = create(8)
    spec = LayerAttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
    out = backend.forward(spec, query, key, value, cache, backend.metadata_builder().build(common, []))
    assert out.dtype == torch.float32 and cache.dtype == cache_dtype
    starts = common.query_start_loc.tolist()
    for r, (n, q_len) in enumerate(ROWS):
        expected = dense_reference(query[starts[r] : starts[r + 1]], full_k[r], full_v[r], n - q_len, window, None,
                              spec.scale)
        torch.testing.assert_close(out[starts[r] : starts[r + 1]].double(), expected, atol=1e-5, rtol=1e-5)
    slots = common.slot_mapping
    written = cache[:, slots // 8, slots % 8]
    assert torch.equal(written[0], key.to(cache_dtype)) and torch.equal(written[1], value.to(cache_dtype))


def test_work_items_cover_every_query_once_largest_first() -> None:
    q_lens, seq_lens = np.array([1, 40, 17, 3]), np.array([9, 90, 17, 300])
    items = work_items(q_lens, seq_lens, tile=16)
    covered = sorted((r, t) for r, b, e in items for t in range(b, e))
    assert covered == [(r, t) for r in range(4) for t in range(q_lens[r])]
    cost = (items[:, 2] - items[:, 1]) * (seq_lens[items[:, 0]] - q_lens[items[:, 0]] + items[:, 2])
    assert (np.diff(cost) <= 0).all()
    assert work_items(np.ones(3, np.int64), np.array([5, 50, 7]))[:, 0].tolist() == [1, 2, 0]


def test_auto_falls_back_to_sdpa_when_kernels_cannot_load(monkeypatch, caplog) -> None:
    assert resolve_backend_name("auto", "cpu") == "paged"
    monkeypatch.setattr("services.worker.attention.kernels_error", lambda: "no C++ compiler (g++) on PATH")
    with caplog.at_level("WARNING"):
        assert resolve_backend_name("auto", "cpu") == "sdpa"
        assert resolve_backend_name("paged", "cpu") == "sdpa"
    assert "paged attention unavailable (no C++ compiler (g++) on PATH); using the sdpa backend" in caplog.text
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_backend_name("paged", "cuda")


def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path) -> None:
    """A broken compiler gives a reason string (and `make install` exits 0 without --strict)."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    build.forget_load_outcome()
    try:
        assert build.kernels_error() is not None and "compiler exited 1" in build.kernels_error()
        assert build.main([]) == 0 and build.main(["--strict"]) == 1
        assert not list(tmp_path.rglob("*.so"))
    finally:
        build.forget_load_outcome()
