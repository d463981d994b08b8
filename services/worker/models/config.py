"""`DecoderConfig`: the shape of a decoder checkpoint, parsed from its HF config.json.

One parser per family says which HF fields turn into which flags (qkv bias, q/k norms, sliding
window per layer, Gemma's norms and soft-capping); RoPE settings are parsed by
`rope_scaling.parse_rope`. Anything spindle cannot run exactly (an unknown rope type, another
activation) is rejected here with a ValueError naming the field, never silently approximated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.worker.models.rope_scaling import RopeConfig, parse_rope

# HF activation name -> what the MLP gate runs (F.silu; F.gelu with tanh approximation).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(slots=True, frozen=True)
class DecoderConfig:
    """What the decoder implementation needs; HF names translated once."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    qk_norm: bool = False  # Qwen3: RMSNorm over each query / key head before RoPE
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), computed in float32
    sandwich_norms: bool = False  # Gemma 2: norms after attention and MLP too, plus one before the MLP
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attention_scale: float | None = None  # None = head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None  # Gemma 2: the same on the LM head's logits

    @property
    def max_position_embeddings(self) -> int:
        """Positions the model serves (the RoPE table): the scaled context where scaling extends it."""
        return self.rope.max_positions


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _base(
    hf: dict[str, Any],
    architecture: str,
    windows: tuple[int | None, ...],
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    activation: tuple[str, str] = ("hidden_act", "silu"),  # (HF field, its default)
    tie_default: bool = False,
    rope_aliases: dict[str, str] | None = None,
) -> DecoderConfig:
    act_field, act_default = activation
    act = hf.get(act_field) or act_default
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported {act_field}={act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    return DecoderConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(hf, head_dim, rope_aliases),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        sliding_windows=windows,
        eos_token_ids=_eos_ids(hf),
        hidden_act=act,
    )


def _per_layer(
    hf: dict[str, Any], window: int | None, default_sliding: Callable[[int], bool]
) -> tuple[int | None, ...]:
    """Window per layer: HF `layer_types` when given, else the family's default rule."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or [
        "sliding_attention" if default_sliding(i) else "full_attention" for i in range(layers)
    ]
    return tuple(window if t == "sliding_attention" else None for t in types)


def llama_config(hf: dict[str, Any]) -> DecoderConfig:
    bias = bool(hf.get("attention_bias", False))
    windows = (None,) * int(hf["num_hidden_layers"])
    return _base(hf, "LlamaForCausalLM", windows, bias, bias, bool(hf.get("mlp_bias", False)))


def mistral_config(hf: dict[str, Any]) -> DecoderConfig:
    window = hf.get("sliding_window")
    windows = (window,) * int(hf["num_hidden_layers"])  # Mistral: every layer, when set
    return _base(hf, "MistralForCausalLM", windows, False, False, False)


def qwen2_config(hf: dict[str, Any]) -> DecoderConfig:
    # Qwen2 (HF): the window applies only with use_sliding_window, to layers >= max_window_layers.
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    first = int(hf.get("max_window_layers", 0))
    windows = _per_layer(hf, window, lambda i: window is not None and i >= first)
    return _base(hf, "Qwen2ForCausalLM", windows, True, False, False)


def qwen3_config(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3: Qwen2's window rule, q/k RMSNorm per head, biases only with attention_bias."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    first = int(hf.get("max_window_layers", 0))
    windows = _per_layer(hf, window, lambda i: window is not None and i >= first)
    bias = bool(hf.get("attention_bias", False))
    return dataclasses.replace(_base(hf, "Qwen3ForCausalLM", windows, bias, bias, False), qk_norm=True)


def phi3_config(hf: dict[str, Any]) -> DecoderConfig:
    """Phi-3 / 3.5 / 4-mini: fused qkv and gate-up weights (loaded as they are), longrope."""
    window = hf.get("sliding_window")
    windows = (window,) * int(hf["num_hidden_layers"])  # every layer, when set
    # Older Phi-3 configs name longrope "su" or "yarn" (transformers reads both as longrope).
    aliases = {"su": "longrope", "yarn": "longrope"}
    return _base(hf, "Phi3ForCausalLM", windows, False, False, False, rope_aliases=aliases)


def gemma2_config(hf: dict[str, Any]) -> DecoderConfig:
    """Gemma 2: (1 + w) sandwich norms, scaled embeddings, soft-capping, alternating windows."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=true (Gemma 2 as an encoder)")
    window = hf.get("sliding_window")
    windows = _per_layer(hf, window, lambda i: window is not None and i % 2 == 0)  # HF: (i + 1) % 2
    bias = bool(hf.get("attention_bias", False))
    base = _base(hf, "Gemma2ForCausalLM", windows, bias, bias, False, ("hidden_activation", "gelu_pytorch_tanh"), True)
    softcap = hf.get("attn_logit_softcapping")
    final_softcap = hf.get("final_logit_softcapping")
    return dataclasses.replace(
        base,
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=base.hidden_size**0.5,
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcap=None if softcap is None else float(softcap),
        final_logit_softcap=None if final_softcap is None else float(final_softcap),
    )
