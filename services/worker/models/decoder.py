"""One decoder implementation for Llama, Mistral, Qwen2/2.5/3, Phi-3 and Gemma 2, switched by flags.

Tokens arrive packed ([num_tokens], no padding); attention goes through the chosen backend and
the paged KV cache. q/k/v and gate/up projections are fused into one matmul each (Phi-3 ships
them fused already; the others are fused at load). `DecoderConfig` flags add what a family
needs: per-head q/k norms (Qwen3), Gemma's (1 + w) sandwich norms, embedding scale, attention
scale and logit soft-capping.

Layers pass on (delta, residual) rather than the summed stream, so each residual add happens in
the norm that follows it (`RMSNorm.add_forward`): on the CPU with float32 activations that is
one fused kernel, as are act(gate) * up and rotary + KV write (models/fused.py says which and
why); elsewhere the same torch ops as transformers run, in its order.
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
from services.worker.models.fast_linear import FastLinear
from services.worker.models.fused import ACTIVATION_CODES, KERNEL_DTYPES, fused_kernels_enabled
from services.worker.models.greedy_step import GreedyStep, build_greedy_step
from services.worker.models.native_stack import NativeStack, build_native_stack
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
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale.

    `unit_offset` is Gemma's variant: the weight is stored as w - 1 and the scale (1 + w) is
    applied in float32 before the cast back, in that order, as transformers does.
    """

    fused = False  # float32 / bfloat16 inputs go through torch.ops.spindle's kernels (set by DecoderForCausalLM)

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def _fusable(self, x: torch.Tensor) -> bool:
        """float32 inputs, or bf16 ones with bf16 weights (a bf16 input times a float32 weight is
        float32 in torch: the kernel would round it)."""
        return self.fused and (x.dtype == torch.float32 or x.dtype == torch.bfloat16 == self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusable(x):
            return torch.ops.spindle.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return self._torch_forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, this norm of it): a residual add and the norm after it; residual None: (x, norm(x))."""
        if residual is None:
            return x, self(x)
        if self._fusable(x):
            return torch.ops.spindle.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        residual = residual + x
        return residual, self._torch_forward(residual)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def _norm(config: DecoderConfig, size: int | None = None) -> RMSNorm:
    return RMSNorm(size or config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(
        self, config: DecoderConfig, layer: int, rope: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        h, d, kvh = config.num_heads, config.head_dim, config.num_kv_heads
        self.q_size, self.kv_size = h * d, kvh * d
        self.qkv_proj = FastLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = FastLinear(self.q_size, config.hidden_size, bias=config.o_bias)
        scale = d**-0.5 if config.attention_scale is None else config.attention_scale
        self.spec = LayerAttentionSpec(
            h, kvh, d, scale, config.sliding_windows[layer], logit_softcap=config.attn_logit_softcap
        )
        backend.check_spec(self.spec)  # at start-up: a backend names the option it cannot run
        # Qwen3: RMSNorm over each head of q and k, before RoPE.
        self.q_norm = _norm(config, d) if config.qk_norm else None
        self.k_norm = _norm(config, d) if config.qk_norm else None
        self.rope = rope
        self.backend = backend
        self.fused_rotary = False  # float32 / bf16 q/k rotate inside the backend kernel (set by DecoderForCausalLM)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor | None, meta: Any
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        s = self.spec
        q, k = q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_rotary and kv_cache is not None and q.dtype in KERNEL_DTYPES:
            out = self.backend.forward_rotary(  # type: ignore[attr-defined]
                s, q, k, v, kv_cache, meta, positions.contiguous(), self.rope.cos, self.rope.sin
            )
        else:
            q, k = self.rope(positions, q, k)
            out = self.backend.forward(s, q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = FastLinear(config.hidden_size, 2 * self.intermediate, bias=config.mlp_bias)
        self.down_proj = FastLinear(self.intermediate, config.hidden_size, bias=config.mlp_bias)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.act_code = ACTIVATION_CODES[config.hidden_act]
        self.fused = False  # float32 / bfloat16 act(gate) * up in one kernel pass (set by DecoderForCausalLM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused and gate_up.dtype in KERNEL_DTYPES:
            return self.down_proj(torch.ops.spindle.act_and_mul(gate_up, self.act_code))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: DecoderConfig, layer: int, rope: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = Attention(config, layer, rope, backend)
        # Pre-norm layers: this norm feeds the MLP. Sandwich layers (Gemma 2): it closes attention.
        self.post_attention_layernorm = _norm(config)
        self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(config)
            self.post_feedforward_layernorm = _norm(config)

    def forward(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's delta, the residual stream before it): the stream is `residual + delta`
        (the embeddings alone on the first layer, residual None). Handing the last add on lets
        the next norm do it in the same pass."""
        residual, h = self.input_layernorm.add_forward(delta, residual)
        attn = self.self_attn(h, positions, kv_cache, meta)
        if not self.sandwich:
            residual, h = self.post_attention_layernorm.add_forward(attn, residual)
            return self.mlp(h), residual
        residual, h = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderForCausalLM(SpindleModel):
    """Llama-style decoder: embed, N layers, final norm, LM head on sampled rows only."""

    task = RequestKind.GENERATE
    native_stack: NativeStack | None = None  # few-row steps in one kernel call (build_native_stack)
    greedy_step: GreedyStep | None = None  # plain greedy decode steps in one kernel call (greedy_step.py)

    def __init__(self, config: DecoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        rope = RotaryEmbedding(config.rope)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rope, backend) for i in range(config.num_layers))
        self.norm = _norm(config)
        self.lm_head = FastLinear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = rope  # registered once so .to(device) moves its tables
        self.embed_scale: torch.Tensor | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint ties them (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def post_init(self) -> None:
        self.rope.init_tables()  # float32, as HF computes them
        self.tie_weights()  # to_empty gives every module its own new parameters
        weight = self.embed_tokens.weight
        if self.config.embed_scale is not None:
            # Gemma: a float32 scalar cast to the weights' dtype, then multiplied (as HF rounds it).
            self.embed_scale = torch.tensor(self.config.embed_scale, device=weight.device).to(weight.dtype)
        self.use_fused_kernels(fused_kernels_enabled(weight.device))

    def use_fused_kernels(self, enabled: bool) -> None:
        """Route float32 norms, activations and (with a backend that can) rotary through the fused kernels."""
        if not enabled:
            self.native_stack = self.greedy_step = None
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.fused = enabled
            elif isinstance(module, Attention):
                module.fused_rotary = enabled and module.backend.fuses_rotary

    def build_native_stack(self) -> None:
        """Gather the layers' parameters for the one-call stack (models/native_stack.py); once the
        weights are final and calibrated (the loader calls it), as the kernel reads these tensors."""
        self.native_stack = build_native_stack(self.config, self.layers, self.norm, self.lm_head)
        self.greedy_step = build_greedy_step(self.native_stack, self.embed_tokens, self.embed_scale,
                                             (self.rope.cos, self.rope.sin), self.lm_head,
                                             self.config.final_logit_softcap)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, scaled where the family scales them (Gemma: sqrt(hidden_size))."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

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
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]: replaces the lookup (VLMs)
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size]."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        stack = self.native_stack
        if stack is not None and stack.accepts(x, kv_caches, meta):
            assert kv_caches is not None
            return stack(x, positions, kv_caches, meta, self.rope.cos, self.rope.sin)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, None if kv_caches is None else kv_caches[i], meta)
        return self.norm.add_forward(x, residual)[1]

    def greedy_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor] | None,
                      meta: Any) -> torch.Tensor | None:
        """Each row's greedy next token for a decode step whose rows all sample, in one kernel
        call (greedy_step.py); None where that call does not cover the step (then `forward`,
        `compute_logits` and the sampler)."""
        step = self.greedy_step
        if step is None or not step.accepts(input_ids, kv_caches, meta):
            return None
        assert kv_caches is not None
        return step(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for the rows that sample (soft-capped first where the family caps)."""
        cap = self.config.final_logit_softcap
        if cap is None:
            return self.lm_head.float_output(hidden)
        logits = self.lm_head(hidden)
        return (torch.tanh(logits / cap) * cap).float()
