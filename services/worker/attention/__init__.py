"""Attention backends behind one interface, looked up by name with lazy imports.

`flash-attn` is imported only when chosen (it needs CUDA); `auto` picks it on CUDA when the
package is installed, else `sdpa`. On the CPU `auto` picks `paged` (C++ kernels that read the
KV cache in place) when its kernels build and load here; when they cannot (no compiler, a
failed build), `auto` and `paged` fall back to `sdpa` with one log line saying why.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from services.worker.attention.base import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
)
from services.worker.kernels.build import kernels_error

logger = logging.getLogger(__name__)

# name -> "module:factory" (a callable taking block_size); modules are imported on first use only.
ATTENTION_BACKENDS: dict[str, str] = {
    "sdpa": "services.worker.attention.sdpa:create",
    "naive": "services.worker.attention.naive:create",
    "paged": "services.worker.attention.paged:create",
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
    if name == "auto" and device_type == "cuda":
        return "flash-attn" if importlib.util.find_spec("flash_attn") is not None else "sdpa"
    if name in ("auto", "paged") and device_type == "cpu":
        error = kernels_error()
        if error is None:
            return "paged"
        logger.warning("paged attention unavailable (%s); using the sdpa backend", error)
        return "sdpa"
    if name == "auto":
        return "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; expected auto or one of {sorted(ATTENTION_BACKENDS)}"
        )
    if name == "flash-attn" and device_type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device_type!r}")
    if name == "paged" and device_type != "cpu":
        raise ValueError(f"attention backend {name!r} runs on the CPU, got {device_type!r}")
    return name


def create_backend(name: str, block_size: int) -> AttentionBackend:
    """Instantiate a backend by (resolved) name."""
    module_name, factory_name = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), factory_name)(block_size)
