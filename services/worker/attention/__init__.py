"""Attention backends behind one interface, looked up by name with lazy imports.

`flash-attn` is imported only when chosen (it needs CUDA); `auto` picks it on CUDA when the
package is installed, else `sdpa`.
"""

from __future__ import annotations

import importlib
import importlib.util

from services.worker.attention.base import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
)

# name -> "module:factory" (a callable taking block_size); modules are imported on first use only.
ATTENTION_BACKENDS: dict[str, str] = {
    "sdpa": "services.worker.attention.sdpa:create",
    "naive": "services.worker.attention.naive:create",
    "flash-attn": "services.worker.attention.flash_attn:FlashAttnBackend",
}

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
    "LayerAttentionSpec",
    "create_backend",
    "resolve_backend_name",
]


def resolve_backend_name(name: str, device_type: str) -> str:
    """Map `auto` to a concrete backend and reject names that cannot run on this device."""
    if name == "auto":
        has_flash = importlib.util.find_spec("flash_attn") is not None
        return "flash-attn" if device_type == "cuda" and has_flash else "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; expected auto or one of {sorted(ATTENTION_BACKENDS)}"
        )
    if name == "flash-attn" and device_type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device_type!r}")
    return name


def create_backend(name: str, block_size: int) -> AttentionBackend:
    """Instantiate a backend by (resolved) name."""
    module_name, factory_name = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), factory_name)(block_size)
