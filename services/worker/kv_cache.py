"""The paged KV cache: per layer one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(keys, values). Written through `slot_mapping`, read through block tables by the attention
backends. This module only sizes and allocates it.

The shape is the same for every backend; the order in memory is the backend's
(`AttentionBackend.head_major_cache`). Token-major (contiguous) keeps a token's heads side by
side, which the padded backends' flat `view(-1, heads, dim)` writes and gathers and flash-attn's
paged layout need. Head-major stores each block as [num_kv_heads, block_size, head_dim] behind
the same shape (a transposed view), so one head's keys of a block lie in one run: the CPU paged
kernel, which walks a row's blocks one head at a time, reads them sequentially
(kernels/csrc/paged_attention.cpp has the figures).
"""

from __future__ import annotations

import torch

from services.worker.models.config import DecoderConfig


def bytes_per_block(config: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def num_blocks_for_budget(
    config: DecoderConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many blocks fit in `budget_bytes`; at least one is required."""
    num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of "
            f"{bytes_per_block(config, block_size, dtype)} bytes"
        )
    return int(num_blocks)


def allocate_kv_caches(
    config: DecoderConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    head_major: bool = False,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim];
    `head_major`: each block's heads apart in memory (module docstring)."""
    if head_major:
        shape = (2, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3) for _ in range(config.num_layers)]
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
