"""`naive` backend: explicit matmul, mask, softmax in float32; the readable reference."""

from __future__ import annotations

import torch

from services.worker.attention.padded import PaddedBackend


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """Attention spelled out in float32; also the path of any kernel that cannot soft-cap scores."""
    groups = q.shape[1] // k.shape[1]  # GQA: each key/value head serves `groups` query heads
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # Gemma 2, in transformers' order
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ v).to(q.dtype)


def create(block_size: int) -> PaddedBackend:
    """The `naive` backend: padded groups through explicit matmul, mask and softmax in float32."""
    return PaddedBackend("naive", explicit_attention, block_size)
