"""`naive` backend: explicit matmul, mask, softmax in float32; the readable reference."""

from __future__ import annotations

import torch

from services.worker.attention.base import AttentionBackend, LayerAttentionSpec
from services.worker.attention.padded import PaddedMetadata, PaddedMetadataBuilder, padded_forward


def _naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]  # GQA: each key/value head serves `groups` query heads
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ v).to(q.dtype)


class NaiveBackend(AttentionBackend):
    name = "naive"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def metadata_builder(self) -> PaddedMetadataBuilder:
        return PaddedMetadataBuilder(self.block_size)

    def forward(
        self,
        spec: LayerAttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: PaddedMetadata,
    ) -> torch.Tensor:
        return padded_forward(_naive, spec, query, key, value, kv_cache, metadata)
