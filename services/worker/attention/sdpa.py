"""`sdpa` backend: torch's scaled_dot_product_attention over padded groups (CPU and GPU).

SDPA has no logit soft-capping, so soft-capped layers (Gemma 2) run the explicit float32
kernel of the `naive` backend instead; every other layer keeps the fused kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.naive import explicit_attention
from services.worker.attention.padded import PaddedBackend


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    if softcap is not None:
        return explicit_attention(q, k, v, mask, scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def create(block_size: int) -> PaddedBackend:
    """The `sdpa` backend: padded groups through torch's fused scaled_dot_product_attention."""
    return PaddedBackend("sdpa", _sdpa, block_size)
