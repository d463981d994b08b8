"""Rotary position embedding, bit-compatible with Hugging Face's RoPE variants.

The inverse frequencies come from `rope_scaling` (the same float32 arithmetic as transformers);
the angle table is the same float32 product position * frequency, cos and sin are multiplied by
the variant's attention factor, and heads rotate with the `rotate_half` convention (first half /
second half). With a partial rotary factor only the leading `rotary_dim` dimensions of each head
rotate; the rest pass through. A float32 forward therefore matches transformers exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.models.rope_scaling import RopeConfig, rope_frequencies


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(rope: RopeConfig, num_positions: int, device: torch.device | None = None) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """float32 cos and sin [num_positions, rotary_dim] for positions 0..num_positions-1.

    Each position uses the frequency set whose range it falls in (longrope: short, then long).
    """
    sets, attention = rope_frequencies(rope, device)
    positions = torch.arange(num_positions, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * sets[0][1][None, :]
    for start, inv_freq in sets[1:]:
        freqs[start:] = positions[start:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every served position, looked up by position.

    The paged attention kernel reads these tables itself when the decoder fuses the rotation
    into its KV write (models/fused.py), so they stay contiguous float32 [positions, rotary_dim]
    and the kernel rounds exactly as `forward` does.
    """

    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        self.rope = rope
        rows, dim = rope.max_positions, rope.rotary_dim
        self.register_buffer("cos", torch.empty(rows, dim), persistent=False)
        self.register_buffer("sin", torch.empty(rows, dim), persistent=False)
        self.init_tables()

    def init_tables(self) -> None:
        """(Re)compute the float32 tables on the buffers' device (after meta-device construction)."""
        if self.cos.device.type == "meta":
            return
        self.cos, self.sin = rope_tables(self.rope, self.rope.max_positions, self.cos.device)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H, D] and key [T, Hkv, D] by their token positions [T]."""
        cos = self.cos[positions].to(query.dtype)[:, None, :]
        sin = self.sin[positions].to(query.dtype)[:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :dim], x[..., dim:]
    return torch.cat((head * cos + rotate_half(head) * sin, rest), dim=-1)
