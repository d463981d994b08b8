"""Rotary position embedding, bit-compatible with Hugging Face's default RoPE.

Same inverse frequencies (int64 arange cast to float32), the same float32 angle product, and
the `rotate_half` convention (first half / second half of each head), so a float32 forward
matches transformers exactly.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, looked up by position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.init_tables()

    def init_tables(self) -> None:
        """(Re)compute the float32 tables on the buffers' device (after meta-device construction)."""
        device = self.cos.device
        if device.type == "meta":
            return
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H, D] and key [T, Hkv, D] by their token positions [T]."""
        cos = self.cos[positions].to(query.dtype)[:, None, :]
        sin = self.sin[positions].to(query.dtype)[:, None, :]
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
