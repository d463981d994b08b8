"""The attention backend interface: one small ABC, a metadata builder per backend.

The input builder produces `CommonAttentionMetadata` (device tensors plus host copies of the
small per-request arrays); each backend's `AttentionMetadataBuilder` turns it into what its
kernel needs. Backends never see requests, sampling or the scheduler.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class AttentionType(enum.Enum):
    """Which tokens a query may see."""

    DECODER = "decoder"  # causal, keys and values live in the paged KV cache
    ENCODER_ONLY = "encoder_only"  # bidirectional within a sequence, no KV cache (BERT)


@dataclass(slots=True, frozen=True)
class LayerAttentionSpec:
    """Per-layer constants an attention call needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # a query at position p sees keys at positions > p - window
    # Gemma 2: scores become cap * tanh(scores / cap) after scaling, before the mask and softmax.
    logit_softcap: float | None = None


@dataclass(slots=True)
class CommonAttentionMetadata:
    """Batch layout shared by every backend (one forward pass).

    Requests are rows; their tokens are packed back to back (`query_start_loc`). Decoder rows
    attend to `seq_lens[i]` cached tokens: the `seq_lens[i] - query_lens[i]` computed before
    this pass plus this pass's own, which the backend writes to `slot_mapping` first.
    """

    attn_type: AttentionType
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64, device
    seq_lens: torch.Tensor  # [num_reqs] int64, device
    query_lens_host: np.ndarray  # [num_reqs] int64
    seq_lens_host: np.ndarray  # [num_reqs] int64
    block_tables: torch.Tensor | None = None  # [num_reqs, max_blocks] int64, device (decoder only)
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, device (decoder only)

    @property
    def causal(self) -> bool:
        return self.attn_type is AttentionType.DECODER

    @property
    def is_all_decode(self) -> bool:
        """Every row computes exactly one token (no host index arrays are needed)."""
        return self.max_query_len == 1


class AttentionMetadataBuilder(ABC):
    """Turns the common layout into one backend's metadata.

    `prepare` runs on the host while the input builder packs its arrays, so that the
    backend's index arrays travel to the device in the same single copy; `build` runs after
    the copy with those arrays as device tensors, in the order `prepare` returned them.
    """

    @abstractmethod
    def prepare(
        self, query_lens: np.ndarray, seq_lens: np.ndarray, attn_type: AttentionType
    ) -> list[np.ndarray]:
        """Host-side int64 index arrays this backend needs (may be empty)."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata, arrays: list[torch.Tensor]) -> Any:
        """Backend metadata for one forward pass; `arrays` are `prepare`'s, on the device."""

    def advance(self, prev: Any, common: CommonAttentionMetadata) -> Any:
        """Metadata for the next decode step of a decode-only batch, every row one token further
        on (`common`); `prev` is this builder's metadata of the step before. Backends whose
        metadata survives that move reuse it; the rest build it anew."""
        return self.build(common, [])


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache."""

    name: str
    # Backends that apply `LayerAttentionSpec.logit_softcap` say so; the others refuse it at start-up.
    supports_logit_softcap: bool = False
    # Backends that can rotate q and k themselves (at the KV write) say so and offer `forward_rotary`.
    fuses_rotary: bool = False
    # The KV cache's order in memory this backend reads fastest and handles (kv_cache.py): head-major
    # or, by default, token-major (contiguous).
    head_major_cache: bool = False

    def check_spec(self, spec: LayerAttentionSpec) -> None:
        """Raise ValueError, naming the option, for a layer this backend cannot compute exactly.

        Models call it while they are built, so an unsupported option stops the worker at start-up.
        """
        if spec.logit_softcap is not None and not self.supports_logit_softcap:
            raise ValueError(
                f"attention backend {self.name!r} does not support attention logit soft-capping "
                "(attn_logit_softcapping); choose --attention-backend sdpa or naive"
            )

    @abstractmethod
    def metadata_builder(self) -> AttentionMetadataBuilder:
        """A fresh builder for this backend's metadata."""

    @abstractmethod
    def forward(
        self,
        spec: LayerAttentionSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: Any,
    ) -> torch.Tensor:
        """Write this pass's keys/values to the cache (decoder) and return [num_tokens, num_heads, head_dim]."""


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values at their slots (slot = block_id * block_size + offset)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
