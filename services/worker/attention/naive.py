"""`naive` backend: explicit matmul, mask, softmax in float32; the readable reference."""

from __future__ import annotations

import torch

from services.worker.attention.padded import PaddedBackend


def _naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]  # GQA: each key/value head serves `groups` query heads
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ v).to(q.dtype)


def create(block_size: int) -> PaddedBackend:
    """The `naive` backend: padded groups through explicit matmul, mask and softmax in float32."""
    return PaddedBackend("naive", _naive, block_size)
