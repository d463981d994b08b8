"""The paged KV cache: per layer one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(keys, values). Written through `slot_mapping`, read through block tables by the attention
backends. This module only sizes and allocates it.
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
    config: DecoderConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer."""
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
