"""Encoder-only attention on packed sequences with no padding: what BERT-family layers call.

Why: the padded backends lay an encoder batch out as [num_seqs, longest, heads, head_dim]
(gathered from the packed tokens, masked, scattered back), so every sequence of a round pays
for the longest one. With one sentence per request a round mixes 10- and 220-token sentences,
and that padding made attention 21 % of the worker's time (all-MiniLM-L6-v2, 2 AMD cores).

Here each sequence's rows of the packed [num_tokens, heads, head_dim] query/key/value are
viewed, without a copy, as [1, heads, len, head_dim] and attend among themselves with no mask,
so the work is the sum of the squared lengths and nothing is gathered, padded or masked.
Measured per round of 14 mixed-length sequences (6 layers): padded sdpa 205 ms, a loop of
torch's sdpa per sequence 82-88 ms; grouping by equal length finds no groups in such rounds,
and torch's jagged nested tensors unbind into a slower per-sequence loop on the CPU (1,100 ms).
Where spindle's CPU kernels are built, one call of `spindle::encoder_attention`
(kernels/csrc/encoder_attention.cpp) does the whole batch: threads take (sequence, head) items,
each a slab of 8 or 16 queries at a time with the query vectors in the lanes (an earlier C++
attempt with scalar exponentials lost to sdpa): all-MiniLM-L6-v2, 64 sentences of 8-200 words in
2,048-token rounds, attention 290 -> 206 ms of a 1.4 s pass with its first form (2-core AMD
EPYC; the sdpa loop ran at ~38 GFLOP/s), and 1.4-1.9x faster again with the lanes
(`python -m benchmarks.encoder_attention_bench`: 2.3-5x the sdpa loop). It takes float32 or
bf16 query/key/value and computes in float32 either way (`runs_kernel`). Else (or
`SPINDLE_DISABLE_FUSED_KERNELS=1`) the sdpa loop, in the activations' dtype.

The boundaries are host ints (`query_lens_host`), so the loop never waits on a device. Only
CPU batches take this path: on CUDA one kernel launch per layer matters more than padding, and
flash-attn is varlen already, so the backend's own layout is kept there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.attention.base import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
)
from services.worker.attention.naive import explicit_attention
from services.worker.models.fused import fused_kernels_error

# (query, key, value [1, heads, len, head_dim], scale) -> [1, heads, len, head_dim]; no mask.
SequenceKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

_SEE_ALL = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # broadcast mask: every key is visible


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The `naive` backend's float32 reference, per sequence."""
    return explicit_attention(q, k, v, _SEE_ALL.to(q.device), scale, None)


# Backend name -> per-sequence kernel; every other backend (sdpa, paged) uses torch's sdpa.
SEQUENCE_KERNELS: dict[str, SequenceKernel] = {"naive": _explicit}


@dataclass(slots=True, frozen=True)
class PackedEncoderMetadata:
    """Token range [start, end) of each sequence in the packed batch (host ints), and the same
    boundaries as the int64 [num_seqs + 1] tensor the batch kernel reads."""

    bounds: tuple[tuple[int, int], ...]
    query_start_loc: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0


class PackedEncoderMetadataBuilder(AttentionMetadataBuilder):
    """Sequence boundaries from the host copy of the lengths; no device arrays."""

    def prepare(
        self, query_lens: np.ndarray, seq_lens: np.ndarray, attn_type: AttentionType
    ) -> list[np.ndarray]:
        if attn_type is not AttentionType.ENCODER_ONLY:
            raise ValueError(f"packed encoder attention serves encoder-only batches, not {attn_type.name}")
        return []

    def build(self, common: CommonAttentionMetadata, arrays: list[torch.Tensor]) -> PackedEncoderMetadata:
        starts = list(accumulate((int(n) for n in common.query_lens_host), initial=0))
        return PackedEncoderMetadata(tuple(pairwise(starts)), torch.tensor(starts, dtype=torch.int64))


class EncoderAttention:
    """Bidirectional attention within each sequence, for encoder layers.

    CPU batches (`PackedEncoderMetadata`) run spindle's batch kernel where it is built, except
    under the `naive` backend (the float32 reference, per sequence); otherwise the packed loop
    with torch's sdpa. Any other metadata goes to the backend itself.
    """

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.kernel = SEQUENCE_KERNELS.get(backend.name, _sdpa)
        # The batch kernel (CPU): None until the first packed batch asks whether the kernels are built.
        self.batch_kernel: bool | None = False if backend.name in SEQUENCE_KERNELS else None

    def runs_kernel(self, metadata: Any) -> bool:
        """Whether a batch with this metadata runs the batch kernel: packed (CPU) batches, where the
        kernels are built. The kernel also takes bf16 query, key and value, computes in float32 and
        rounds only its output, so an encoder layer under bf16 GEMM inputs may hand over its qkv
        projection's bf16 result (bert.py); anywhere else that would change the arithmetic."""
        if not isinstance(metadata, PackedEncoderMetadata):
            return False
        if self.batch_kernel is None:
            self.batch_kernel = fused_kernels_error(torch.device("cpu")) is None
        return self.batch_kernel

    def metadata_builder(self, device: torch.device) -> AttentionMetadataBuilder:
        """Packed metadata on the CPU; the backend's own elsewhere."""
        return PackedEncoderMetadataBuilder() if device.type == "cpu" else self.backend.metadata_builder()

    def forward(
        self,
        spec: LayerAttentionSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        metadata: Any,
    ) -> torch.Tensor:
        """[num_tokens, num_heads, head_dim]: each token attends to every token of its sequence.
        On the CPU, rows past the last sequence are padding (EncoderModel.forward) and come out zero."""
        if not isinstance(metadata, PackedEncoderMetadata):
            return self.backend.forward(spec, query, key, value, None, metadata)
        if spec.num_kv_heads != spec.num_heads or spec.sliding_window or spec.logit_softcap:
            raise ValueError("packed encoder attention supports plain multi-head attention only")
        if self.runs_kernel(metadata) and query.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.spindle.encoder_attention(query, key, value, metadata.query_start_loc, spec.scale)
        out = torch.empty_like(query)
        out[metadata.num_tokens:].zero_()  # padding rows (EncoderModel.forward), as the kernel leaves them
        for start, end in metadata.bounds:
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
            out[start:end] = self.kernel(q, k, v, spec.scale)[0].transpose(0, 1)
        return out
