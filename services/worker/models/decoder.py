"""One decoder implementation for Llama, Mistral and Qwen2, switched by `DecoderConfig` flags.

Tokens arrive packed ([num_tokens], no padding); attention goes through the chosen backend and
the paged KV cache. q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionBackend, LayerAttentionSpec
from services.worker.models.base import SpindleModel, WeightTarget
from services.worker.models.config import DecoderConfig
from services.worker.models.rope import RotaryEmbedding
from shared.types import RequestKind

# HF module inside model.layers.N -> (spindle fused module, index of the shard inside it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(
        self, config: DecoderConfig, layer: int, rope: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        h, d, kvh = config.num_heads, config.head_dim, config.num_kv_heads
        self.q_size, self.kv_size = h * d, kvh * d
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.spec = LayerAttentionSpec(h, kvh, d, d**-0.5, config.sliding_windows[layer])
        self.rope = rope
        self.backend = backend

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor | None, meta: Any
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        s = self.spec
        q, k = self.rope(
            positions, q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim)
        )
        out = self.backend.forward(s, q, k, v.view(-1, s.num_kv_heads, s.head_dim), kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: DecoderConfig, layer: int, rope: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, rope, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor | None, meta: Any
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderForCausalLM(SpindleModel):
    """Llama-style decoder: embed, N pre-norm layers, final norm, LM head on sampled rows only."""

    task = RequestKind.GENERATE

    def __init__(self, config: DecoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rope, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = rope  # registered once so .to(device) moves its tables
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint ties them (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def post_init(self) -> None:
        self.rope.init_tables()  # float32, as HF computes them
        self.tie_weights()  # to_empty gives every module its own new parameters

    def map_weight(self, hf_name: str) -> WeightTarget | None:
        """HF names -> spindle names; q/k/v and gate/up land in row ranges of fused parameters."""
        if "rotary_emb" in hf_name:
            return None
        match = _LAYER.match(hf_name)
        if match is None:
            return hf_name.removeprefix("model."), None
        layer, module, kind = match.groups()
        if module not in _FUSED:
            return f"layers.{layer}.{module}.{kind}", None
        fused, shard = _FUSED[module]
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        starts = (0, q, q + kv) if fused.endswith("qkv_proj") else (0, c.intermediate_size)
        return f"layers.{layer}.{fused}.{kind}", starts[shard]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor] | None,
        meta: Any,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size]."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, None if kv_caches is None else kv_caches[i], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for the rows that sample."""
        return self.lm_head(hidden).float()
