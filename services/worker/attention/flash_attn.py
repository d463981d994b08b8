"""`flash-attn` backend: flash_attn_varlen_func on packed sequences (CUDA only).

Imported lazily through the registry, and only when the device is CUDA. flash-attn 2 reads a
paged cache directly only for block sizes that are multiples of 256, so keys and values are
first gathered from the cache into packed [sum(seq_lens), Hkv, D] with one index computed on
the device; the kernel then handles GQA, causality (bottom-right aligned, so chunked prefill
and decode rows are correct) and the sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flash_attn import flash_attn_varlen_func

from services.worker.attention.base import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    write_kv,
)


@dataclass(slots=True)
class FlashMetadata:
    common: CommonAttentionMetadata
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32
    kv_slots: torch.Tensor | None  # [sum(seq_lens)] cache slot of every key (decoder)


class FlashMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(
        self, query_lens: np.ndarray, seq_lens: np.ndarray, attn_type: AttentionType
    ) -> list[np.ndarray]:
        return []

    def build(self, common: CommonAttentionMetadata, arrays: list[torch.Tensor]) -> FlashMetadata:
        device = common.seq_lens.device
        cu_k = torch.zeros(common.num_reqs + 1, dtype=torch.int64, device=device)
        torch.cumsum(common.seq_lens, 0, out=cu_k[1:])
        kv_slots = None
        if common.block_tables is not None:
            total = int(common.seq_lens_host.sum())  # host copy: no device sync
            rows = torch.repeat_interleave(
                torch.arange(common.num_reqs, device=device), common.seq_lens, output_size=total
            )
            j = torch.arange(total, device=device) - cu_k[rows]
            kv_slots = common.block_tables[rows, j // self.block_size] * self.block_size + j % self.block_size
        return FlashMetadata(common, common.query_start_loc.int(), cu_k.int(), kv_slots)


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"
    supports_logit_softcap = True  # flash-attn >= 2.6 `softcap`

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def metadata_builder(self) -> FlashMetadataBuilder:
        return FlashMetadataBuilder(self.block_size)

    def forward(
        self,
        spec: LayerAttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: FlashMetadata,
    ) -> torch.Tensor:
        common = metadata.common
        if kv_cache is not None and metadata.kv_slots is not None and common.slot_mapping is not None:
            write_kv(kv_cache, key, value, common.slot_mapping)
            key = kv_cache[0].view(-1, *kv_cache.shape[-2:])[metadata.kv_slots]
            value = kv_cache[1].view(-1, *kv_cache.shape[-2:])[metadata.kv_slots]
        window = (-1, -1) if spec.sliding_window is None else (spec.sliding_window - 1, 0)
        softcap = {} if spec.logit_softcap is None else {"softcap": spec.logit_softcap}
        return flash_attn_varlen_func(
            query,
            key,
            value,
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            common.max_query_len,
            common.max_seq_len,
            softmax_scale=spec.scale,
            causal=common.causal,
            window_size=window,
            **softcap,
        )
