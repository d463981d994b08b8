"""`sdpa` backend: torch's scaled_dot_product_attention over padded groups (CPU and GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.base import AttentionBackend, LayerAttentionSpec
from services.worker.attention.padded import PaddedMetadata, PaddedMetadataBuilder, padded_forward


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class SdpaBackend(AttentionBackend):
    name = "sdpa"

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
        return padded_forward(_sdpa, spec, query, key, value, kv_cache, metadata)
