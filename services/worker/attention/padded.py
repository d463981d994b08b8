"""Padded attention groups over the paged KV cache, shared by the `sdpa` and `naive` backends.

A mixed batch is split into at most two groups, each handled by one kernel call per layer:
decode rows (one query each) and prefill rows (queries padded to the longest chunk). Keys and
values are gathered from the cache by block table into [rows, max_len] with a mask; nothing
loops over sequences. Encoder-only batches form one group attending to their own tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.attention.base import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    write_kv,
)

# kernel(query [N, H, Lq, D], key [N, Hkv, K, D], value, mask [N, 1, Lq, K] bool, scale, logit softcap)
#   -> [N, H, Lq, D]
Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float | None], torch.Tensor
]


@dataclass(slots=True)
class PaddedGroup:
    """Rows computed by one kernel call; `None` index fields mean "all rows, one token each"."""

    query_pos: torch.Tensor  # [N, Lq] position of each (padded) query in its sequence
    key_len: int  # keys per row after padding
    token_index: torch.Tensor | None = None  # [N, Lq] flat token of each padded query
    out_select: torch.Tensor | None = None  # [n_valid] entries of the flattened [N * Lq] that are real
    out_tokens: torch.Tensor | None = None  # [n_valid] flat token each real entry belongs to
    block_tables: torch.Tensor | None = None  # [N, blocks] (decoder)
    key_count: torch.Tensor | None = None  # [N] valid keys per row (encoder-only)
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, causal: bool) -> torch.Tensor:
        """[N, 1, Lq, key_len] bool: which keys each query may see (cached per window)."""
        if window not in self._masks:
            keys = torch.arange(self.key_len, device=self.query_pos.device)[None, None, :]
            if causal:
                pos = self.query_pos[:, :, None]
                allowed = keys <= pos
                if window is not None:
                    allowed = allowed & (keys > pos - window)
            else:
                assert self.key_count is not None
                allowed = (keys < self.key_count[:, None, None]).expand(-1, self.query_pos.shape[1], -1)
            self._masks[window] = allowed[:, None]
        return self._masks[window]


@dataclass(slots=True)
class PaddedMetadata:
    common: CommonAttentionMetadata
    groups: list[PaddedGroup]


class PaddedMetadataBuilder(AttentionMetadataBuilder):
    """Splits rows into a decode group and a padded prefill group (host index arrays)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(
        self, query_lens: np.ndarray, seq_lens: np.ndarray, attn_type: AttentionType
    ) -> list[np.ndarray]:
        if attn_type is AttentionType.DECODER and query_lens.max(initial=0) <= 1:
            return []  # all decode: the device tensors alone describe the batch
        starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
        if attn_type is AttentionType.ENCODER_ONLY:
            decode_rows = np.zeros(0, np.int64)
            prefill_rows = np.arange(len(query_lens))
        else:
            decode_rows = np.flatnonzero(query_lens == 1)
            prefill_rows = np.flatnonzero(query_lens > 1)
        q = query_lens[prefill_rows]
        offsets = np.minimum(np.arange(q.max(initial=1))[None, :], q[:, None] - 1)  # [P, Lq]
        token_index = starts[prefill_rows][:, None] + offsets
        query_pos = (seq_lens[prefill_rows] - q)[:, None] + offsets
        real = np.arange(offsets.shape[1])[None, :] < q[:, None]
        return [
            decode_rows,
            starts[decode_rows],
            seq_lens[decode_rows] - 1,
            prefill_rows,
            token_index,
            query_pos,
            np.flatnonzero(real),
            token_index[real],
        ]

    def build(self, common: CommonAttentionMetadata, arrays: list[torch.Tensor]) -> PaddedMetadata:
        if not arrays:
            group = PaddedGroup(
                query_pos=(common.seq_lens - 1)[:, None],
                key_len=common.max_seq_len,
                block_tables=self._blocks(common.block_tables, common.max_seq_len),
            )
            return PaddedMetadata(common, [group])
        decode_rows, decode_tokens, decode_pos, prefill_rows, token_index, query_pos, select, tokens = arrays
        decoder = common.attn_type is AttentionType.DECODER
        groups: list[PaddedGroup] = []
        query_lens, seq_lens = common.query_lens_host, common.seq_lens_host
        if decode_rows.numel():
            key_len = int(seq_lens[query_lens == 1].max())
            groups.append(
                PaddedGroup(
                    query_pos=decode_pos[:, None],
                    key_len=key_len,
                    token_index=decode_tokens[:, None],
                    out_tokens=decode_tokens,
                    block_tables=self._blocks(common.block_tables[decode_rows], key_len),
                )
            )
        if prefill_rows.numel():
            prefill = query_lens > 1 if decoder else np.ones(len(query_lens), bool)
            key_len = int(seq_lens[prefill].max())
            groups.append(
                PaddedGroup(
                    query_pos=query_pos,
                    key_len=key_len,
                    token_index=token_index,
                    out_select=select,
                    out_tokens=tokens,
                    block_tables=self._blocks(common.block_tables[prefill_rows], key_len)
                    if decoder
                    else None,
                    key_count=None if decoder else common.seq_lens[prefill_rows],
                )
            )
        return PaddedMetadata(common, groups)

    def _blocks(self, block_tables: torch.Tensor | None, key_len: int) -> torch.Tensor | None:
        if block_tables is None:
            return None
        return block_tables[:, : -(-key_len // self.block_size)]


class PaddedBackend(AttentionBackend):
    """A backend over padded groups; backends of this kind differ only in their kernel."""

    supports_logit_softcap = True  # every kernel here applies LayerAttentionSpec.logit_softcap

    def __init__(self, name: str, kernel: Kernel, block_size: int) -> None:
        self.name = name
        self.kernel = kernel
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
        """Run the kernel once per group and scatter the rows back into token order."""
        common = metadata.common
        if kv_cache is not None and common.slot_mapping is not None:
            write_kv(kv_cache, key, value, common.slot_mapping)
        if len(metadata.groups) == 1 and metadata.groups[0].token_index is None:
            group = metadata.groups[0]  # all decode: row i is token i
            k, v = _gather_cache(kv_cache, group)
            return _run(self.kernel, spec, query[:, None], k, v, group, common.causal)[:, 0]
        out = query.new_empty(query.shape)
        for group in metadata.groups:
            assert group.token_index is not None and group.out_tokens is not None
            q = query[group.token_index]
            if group.block_tables is not None:
                k, v = _gather_cache(kv_cache, group)
            else:
                k, v = key[group.token_index], value[group.token_index]
            result = _run(self.kernel, spec, q, k, v, group, common.causal)  # [N, Lq, H, D]
            flat = result.reshape(-1, *result.shape[2:])
            out[group.out_tokens] = flat if group.out_select is None else flat[group.out_select]
        return out


def _gather_cache(kv_cache: torch.Tensor | None, group: PaddedGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values of each row, [N, key_len, Hkv, D], read through its block table."""
    assert kv_cache is not None and group.block_tables is not None
    n = group.block_tables.shape[0]
    # One index_select for keys and values together: [2, N * blocks, block_size, Hkv, D].
    kv = kv_cache.index_select(1, group.block_tables.flatten()).view(2, n, -1, *kv_cache.shape[-2:])
    return kv[0, :, : group.key_len], kv[1, :, : group.key_len]


def _run(
    kernel: Kernel,
    spec: LayerAttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: PaddedGroup,
    causal: bool,
) -> torch.Tensor:
    mask = group.mask(spec.sliding_window, causal)
    out = kernel(
        q.transpose(1, 2), k.transpose(1, 2), v.to(q.dtype).transpose(1, 2), mask, spec.scale, spec.logit_softcap
    )
    return out.transpose(1, 2)
