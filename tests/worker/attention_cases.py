"""Paged attention test inputs shared by the kernel's tests and the fused RoPE + KV write's: a
paged cache with shuffled block tables, ragged rows, and the dense float64 attention to check
against."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.base import AttentionType, CommonAttentionMetadata

# (sequence length after this pass, query tokens of this pass)
ROWS = [(1, 1), (37, 1), (64, 1), (90, 40), (17, 17), (5, 2), (130, 1), (48, 33)]


def dense_reference(q, k, v, first_pos, window, softcap, scale):
    """q [n, H, D] at positions first_pos.., keys/values [L, Hkv, D] of the row (float64)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    keys = torch.arange(k.shape[0])[None, :]
    allowed = keys <= pos
    if window:
        allowed &= keys > pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def paged_case(seed, heads, kv_heads, head_dim, block_size, dtype, rows=ROWS, head_major=False):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n, _ in rows) + 5
    # Rows no pass has written hold NaN: a kernel that reads one (to pad a block, a pair of keys)
    # must not let it reach an output.
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    if head_major:  # the same values, each block's heads apart in memory (kv_cache.py)
        cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-n // block_size) for n, _ in rows)
    tables = torch.zeros(len(rows), max_blocks + 2, dtype=torch.int64)  # wider than needed, as in a round
    full_k, full_v, slots = [], [], []
    for r, (n, q_len) in enumerate(rows):
        nb = -(-n // block_size)
        tables[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        full_k.append(torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype))
        full_v.append(torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype))
        for pos in range(n):
            slot = int(tables[r, pos // block_size]) * block_size + pos % block_size
            if pos < n - q_len:  # history written by earlier passes
                cache[:, slot // block_size, slot % block_size] = torch.stack([full_k[r][pos], full_v[r][pos]])
            else:
                slots.append(slot)
    q_lens = np.array([q for _, q in rows])
    seq_lens = np.array([n for n, _ in rows])
    query = torch.randn(int(q_lens.sum()), heads, head_dim, generator=gen).to(dtype)
    key = torch.cat([full_k[r][n - q :] for r, (n, q) in enumerate(rows)])
    value = torch.cat([full_v[r][n - q :] for r, (n, q) in enumerate(rows)])
    common = CommonAttentionMetadata(
        attn_type=AttentionType.DECODER,
        num_reqs=len(rows),
        num_tokens=len(query),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(np.concatenate(([0], np.cumsum(q_lens)))),
        seq_lens=torch.from_numpy(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
    )
    return cache, common, query, key, value, full_k, full_v
