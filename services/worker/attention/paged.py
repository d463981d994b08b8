"""`paged` backend (CPU): a C++ kernel that reads the paged KV cache in place.

The padded backends gather each row's whole history out of the cache per layer, padded to the
longest row, so one long request makes every row of the batch pay for its length. Here each
query walks its own row's block table (services/worker/kernels/csrc/paged_attention.cpp), so a
step costs the sum of the rows' contexts; the same call stores this pass's keys and values, and
with `forward_rotary` applies the rotary embedding to queries and keys on the way (the decoder's
fused path, models/fused.py), so no rotated q or k tensor is ever materialised.

The only host work is once per forward pass, in the metadata builder: the rows are cut into
work items (a row's query tokens in tiles of `QUERY_TILE`, so a long prefill chunk spreads
over threads) ordered largest first, so the kernel's threads, which take items from a shared
counter, finish together. Encoder-only batches (no KV cache) go through the `sdpa` path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.base import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
)
from services.worker.attention.padded import PaddedMetadata, PaddedMetadataBuilder
from services.worker.attention.sdpa import create as create_sdpa
from services.worker.kernels.build import load_kernels

QUERY_TILE = 16  # query tokens of one row per work item: tiles x GQA group x head_dim fp32 fit L1


def work_items(query_lens: np.ndarray, seq_lens: np.ndarray, tile: int = QUERY_TILE) -> np.ndarray:
    """[n, 3] int64 (row, first query offset, end query offset), most keys x queries first."""
    if query_lens.max(initial=0) <= 1:  # decode: one item per row, longest context first
        rows = np.argsort(-seq_lens, kind="stable")
        return np.stack([rows, np.zeros_like(rows), query_lens[rows]], axis=1).astype(np.int64)
    tiles = -(-query_lens // tile)
    rows = np.repeat(np.arange(len(query_lens)), tiles)
    first_tile = np.cumsum(tiles) - tiles
    begin = (np.arange(len(rows)) - first_tile[rows]) * tile
    end = np.minimum(begin + tile, query_lens[rows])
    keys = seq_lens[rows] - query_lens[rows] + end  # keys the item's last query sees
    order = np.argsort(-(end - begin) * keys, kind="stable")
    return np.stack([rows[order], begin[order], end[order]], axis=1).astype(np.int64)


@dataclass(slots=True)
class PagedMetadata:
    common: CommonAttentionMetadata
    work_items: torch.Tensor  # [n, 3] int64 on the CPU


class PagedMetadataBuilder(AttentionMetadataBuilder):
    """Work items for decoder batches; encoder-only batches get the padded layout."""

    def __init__(self, block_size: int) -> None:
        self.padded = PaddedMetadataBuilder(block_size)

    def prepare(
        self, query_lens: np.ndarray, seq_lens: np.ndarray, attn_type: AttentionType
    ) -> list[np.ndarray]:
        if attn_type is AttentionType.ENCODER_ONLY:
            return self.padded.prepare(query_lens, seq_lens, attn_type)
        return []  # work items need only the host copies that `build` receives

    def build(self, common: CommonAttentionMetadata, arrays: list[torch.Tensor]) -> PagedMetadata | PaddedMetadata:
        if common.attn_type is AttentionType.ENCODER_ONLY:
            return self.padded.build(common, arrays)
        items = work_items(np.asarray(common.query_lens_host), np.asarray(common.seq_lens_host))
        return PagedMetadata(common, torch.from_numpy(items))

    def advance(
        self, prev: PagedMetadata | PaddedMetadata, common: CommonAttentionMetadata
    ) -> PagedMetadata | PaddedMetadata:
        """Every row one token longer keeps its place in the longest-first order: the work items stay."""
        if isinstance(prev, PagedMetadata):
            return PagedMetadata(common, prev.work_items)
        return self.build(common, [])


class PagedBackend(AttentionBackend):
    """Decoder attention through `torch.ops.spindle.paged_attention`; needs the kernels loaded."""

    name = "paged"
    supports_logit_softcap = True  # the kernel caps scores (LayerAttentionSpec.logit_softcap)
    fuses_rotary = True  # forward_rotary: the kernel rotates q and k (fp32) as it loads / stores them
    head_major_cache = True  # the kernel walks a row's blocks one KV head at a time (kv_cache.py)

    def __init__(self, block_size: int) -> None:
        load_kernels()  # raises KernelBuildError; the registry only picks this backend when it loads
        self.block_size = block_size
        self.encoder = create_sdpa(block_size)  # encoder-only batches: no cache to read in place
        self._op = torch.ops.spindle.paged_attention

    def metadata_builder(self) -> PagedMetadataBuilder:
        return PagedMetadataBuilder(self.block_size)

    def forward(
        self,
        spec: LayerAttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: PagedMetadata | PaddedMetadata,
    ) -> torch.Tensor:
        if isinstance(metadata, PaddedMetadata):
            return self.encoder.forward(spec, query, key, value, kv_cache, metadata)
        return self._attend(spec, query, key, value, kv_cache, metadata)

    def forward_rotary(
        self,
        spec: LayerAttentionSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32, not yet rotated
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not yet rotated
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PagedMetadata,
        positions: torch.Tensor,  # [num_tokens] int64
        cos: torch.Tensor,  # [max_positions, rotary_dim] float32 (models/rope.py's tables)
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` with the rotary embedding applied inside the kernel (queries as it loads them,
        keys as it writes them to the cache), bit for bit as `RotaryEmbedding` rotates them."""
        return self._attend(spec, query, key, value, kv_cache, metadata, positions, cos, sin)

    def _attend(
        self,
        spec: LayerAttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: PagedMetadata,
        *rotary: torch.Tensor,
    ) -> torch.Tensor:
        common = metadata.common
        assert kv_cache is not None and common.block_tables is not None and common.slot_mapping is not None
        return self._op(
            query,
            key,
            value,
            kv_cache,
            common.slot_mapping,
            common.block_tables,
            common.seq_lens,
            common.query_start_loc,
            metadata.work_items,
            spec.scale,
            spec.sliding_window or 0,
            getattr(spec, "logit_softcap", None) or 0.0,
            *rotary,
        )


def create(block_size: int) -> PagedBackend:
    """The `paged` backend (raises KernelBuildError when the C++ kernels cannot be loaded)."""
    return PagedBackend(block_size)
