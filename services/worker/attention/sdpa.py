"""`sdpa` backend: torch's scaled_dot_product_attention over padded groups (CPU and GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.padded import PaddedBackend


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def create(block_size: int) -> PaddedBackend:
    """The `sdpa` backend: padded groups through torch's fused scaled_dot_product_attention."""
    return PaddedBackend("sdpa", _sdpa, block_size)
