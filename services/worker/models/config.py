"""`DecoderConfig`: the shape of a decoder checkpoint, parsed from its HF config.json.

One parser per family says which HF fields turn into which flags (qkv bias, sliding window per
layer); anything spindle cannot run exactly (rope scaling, other activations) is rejected here
with a ValueError naming the field, never silently approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    eos_token_ids: tuple[int, ...]


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta from transformers 5 `rope_parameters` or the older top-level fields."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if scaling:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(
            f"unsupported rope scaling {rope_type!r} (rope_scaling/rope_parameters); only default RoPE"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


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
) -> DecoderConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act={act!r}; only 'silu'")
    num_heads = int(hf["num_attention_heads"])
    return DecoderConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        sliding_windows=windows,
        eos_token_ids=_eos_ids(hf),
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
