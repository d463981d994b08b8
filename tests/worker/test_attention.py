"""Attention backends: sdpa, naive and paged vs a dense per-sequence reference (GQA, sliding window, mixed batch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from services.worker.attention import (
    ATTENTION_BACKENDS,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    create_backend,
    resolve_backend_name,
)
from services.worker.input_builder import ModelInputBuilder
from services.worker.kv_cache import allocate_kv_caches
from services.worker.request_states import RequestStates
from shared.execute import NewRequestData
from shared.sampling import SamplingOptions

BS, H, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 40
# (tokens known, tokens computed before this pass): two decodes, a chunk after a prefix, a fresh prompt.
REQUESTS = [(21, 20), (15, 8), (12, 0), (5, 4)]


@dataclass(frozen=True)
class _CacheShape:
    """What allocate_kv_caches reads of a DecoderConfig."""

    num_kv_heads: int = HKV
    head_dim: int = D
    num_layers: int = 1


def _dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    causal: bool = True,
) -> torch.Tensor:
    """q [n, H, D] at positions q_pos, over all keys k/v [L, HKV, D] of one sequence (float64)."""
    k = k.double().repeat_interleave(H // HKV, dim=1)
    v = v.double().repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    keys = torch.arange(k.shape[0])[None, :]
    allowed = torch.ones(len(q_pos), k.shape[0], dtype=torch.bool)
    if causal:
        allowed = keys <= q_pos[:, None]
        if window is not None:
            allowed &= keys > q_pos[:, None] - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _setup(seed: int, head_major: bool = False):
    gen = torch.Generator().manual_seed(seed)
    states = RequestStates(max_model_len=64, block_size=BS)
    blocks = iter(torch.randperm(NUM_BLOCKS, generator=gen).tolist())
    for i, (n, computed) in enumerate(REQUESTS):
        ids = [next(blocks) for _ in range(-(-(n + 2) // BS))]
        states.add(NewRequestData(f"r{i}", [1] * n, n, computed, ids, SamplingOptions(temperature=0.0)))
    rows = np.arange(len(REQUESTS))
    num_scheduled = np.array([n - c for n, c in REQUESTS])
    full_k = [torch.randn(n + 2, HKV, D, generator=gen) for n, _ in REQUESTS]  # every position's key
    full_v = [torch.randn(n + 2, HKV, D, generator=gen) for n, _ in REQUESTS]
    queries = [torch.randn(n + 2, H, D, generator=gen) for n, _ in REQUESTS]
    cache = allocate_kv_caches(_CacheShape(), NUM_BLOCKS, BS, torch.float32, torch.device("cpu"), head_major)[0]
    for row, (_, computed) in enumerate(REQUESTS):  # history: KV computed in earlier passes
        for pos in range(computed):
            block = states.block_table[row, pos // BS]
            cache[0, block, pos % BS], cache[1, block, pos % BS] = full_k[row][pos], full_v[row][pos]
    return states, rows, num_scheduled, full_k, full_v, queries, cache


def _batch_tensors(positions: list[list[int]], full: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([full[row][pos] for row, pos in enumerate(positions) if pos])


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend_name", ["sdpa", "naive", "paged"])
def test_mixed_batch_and_decode_steps_match_dense_reference(backend_name: str, window: int | None) -> None:
    backend = create_backend(backend_name, BS)
    states, rows, num_scheduled, full_k, full_v, queries, cache = _setup(seed=0, head_major=backend.head_major_cache)
    builder = ModelInputBuilder(states, backend.metadata_builder(), torch.device("cpu"))
    spec = LayerAttentionSpec(H, HKV, D, D**-0.5, window)
    inp = builder.build(rows, num_scheduled)
    positions = [list(range(c, n)) for n, c in REQUESTS]
    for step in range(3):  # step 0: mixed batch; steps 1, 2: decode-only batch advanced on the device
        q = _batch_tensors(positions, queries)
        out = backend.forward(
            spec,
            q,
            _batch_tensors(positions, full_k),
            _batch_tensors(positions, full_v),
            cache,
            inp.attn_metadata,
        )
        expected = torch.cat(
            [
                _dense_reference(
                    queries[row][pos],
                    full_k[row][: pos[-1] + 1],
                    full_v[row][: pos[-1] + 1],
                    torch.tensor(pos),
                    window,
                )
                for row, pos in enumerate(positions)
                if pos
            ]
        )
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        inp = builder.advance(inp, torch.zeros(len(inp.sample_rows), dtype=torch.int64))
        positions = [[n + step] for n, _ in REQUESTS]  # every request samples, then decodes


def test_sdpa_and_naive_agree_on_the_same_mixed_batch() -> None:
    outs = []
    for name in ("sdpa", "naive", "paged"):
        states, rows, num_scheduled, full_k, full_v, queries, cache = _setup(seed=1)
        backend = create_backend(name, BS)
        inp = ModelInputBuilder(states, backend.metadata_builder(), torch.device("cpu")).build(
            rows, num_scheduled
        )
        positions = [list(range(c, n)) for n, c in REQUESTS]
        spec = LayerAttentionSpec(H, HKV, D, D**-0.5, 3)
        outs.append(
            backend.forward(
                spec,
                _batch_tensors(positions, queries),
                _batch_tensors(positions, full_k),
                _batch_tensors(positions, full_v),
                cache,
                inp.attn_metadata,
            )
        )
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0], outs[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", ["sdpa", "naive", "paged"])
def test_encoder_only_packed_batch_is_bidirectional_per_sequence(backend_name: str) -> None:
    gen = torch.Generator().manual_seed(2)
    lens = np.array([5, 1, 9])
    backend = create_backend(backend_name, BS)
    builder = backend.metadata_builder()
    extra = [torch.from_numpy(a) for a in builder.prepare(lens, lens, AttentionType.ENCODER_ONLY)]
    common = CommonAttentionMetadata(
        attn_type=AttentionType.ENCODER_ONLY,
        num_reqs=3,
        num_tokens=int(lens.sum()),
        max_query_len=9,
        max_seq_len=9,
        query_start_loc=torch.tensor([0, 5, 6, 15]),
        seq_lens=torch.from_numpy(lens),
        query_lens_host=lens,
        seq_lens_host=lens,
    )
    q, k, v = (torch.randn(15, h, D, generator=gen) for h in (H, HKV, HKV))
    out = backend.forward(LayerAttentionSpec(H, HKV, D, D**-0.5), q, k, v, None, builder.build(common, extra))
    starts = [0, 5, 6, 15]
    expected = torch.cat(
        [
            _dense_reference(q[a:b], k[a:b], v[a:b], torch.arange(b - a), None, causal=False)
            for a, b in zip(starts[:-1], starts[1:], strict=True)
        ]
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_backend_registry_resolves_auto_and_rejects_unknown_names() -> None:
    assert resolve_backend_name("auto", "cpu") == "paged"  # the C++ kernels build on every CI machine
    assert set(ATTENTION_BACKENDS) == {"sdpa", "naive", "paged", "flash-attn"}
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend_name("flash-attn", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        resolve_backend_name("xformers", "cpu")


def test_the_paged_backend_gets_a_head_major_cache_of_the_same_shape() -> None:
    """Head-major: each block's keys of one KV head lie in one run (kv_cache.py); the shape, and so
    every index into it, is the token-major one."""
    token, head = (allocate_kv_caches(_CacheShape(num_layers=2), NUM_BLOCKS, BS, torch.float32, torch.device("cpu"),
                                      head_major)
                   for head_major in (False, True))
    assert len(head) == 2 and head[0].shape == token[0].shape == (2, NUM_BLOCKS, BS, HKV, D)
    assert token[0].is_contiguous() and not torch.count_nonzero(head[0])
    assert head[0].stride() == (NUM_BLOCKS * HKV * BS * D, HKV * BS * D, D, BS * D, 1)
    assert create_backend("paged", BS).head_major_cache and not create_backend("sdpa", BS).head_major_cache
