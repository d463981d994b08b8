"""RoPE variants: parse a checkpoint's rope settings, compute inverse frequencies as transformers does.

Every supported `rope_type` reproduces transformers' float32 arithmetic step for step (same
operations in the same order), so the cos/sin tables built from these frequencies equal the
ones transformers computes and a float32 forward matches it exactly:

- `default`: theta ** (-2i / d).
- `linear`: default / factor (position interpolation).
- `llama3`: low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1+).
- `yarn`: per-dimension blend of interpolated and extrapolated frequencies, plus an attention
  factor (mscale) that multiplies cos and sin (Qwen2.5, Qwen3, DeepSeek-style configs).
- `longrope`: per-dimension short and long rescale factors (Phi-3 / 3.5 / 4-mini). spindle
  rotates positions below `original_max_position_embeddings` with the short set and the rest
  with the long set, as vLLM does: a key's rotation depends on its position only, so prefix
  caching, chunked prefill and preemption stay exact. transformers instead uses one set per
  sequence: short while the sequence fits the original window, and once it grows past it
  `Phi3ForCausalLM` drops its KV cache and recomputes the whole sequence with the long set.
  Both agree token for token while prompt + output fit the original window; past it they
  differ by design (matching it would need the scheduler to recompute a request, in its own
  prefix-cache namespace, when it crosses the window).
- `dynamic` (dynamic NTK): transformers recomputes the base from the longest sequence a forward
  pass has seen and keeps the keys already cached under older frequencies, so a key's rotation
  depends on the history of the sequence and of the batch it ran in. A paged cache whose blocks
  are shared by prefix caching across requests cannot reproduce that. Within
  `max_position_embeddings` dynamic NTK is exactly default RoPE (the formula at that length
  gives the unscaled base), so spindle serves such a checkpoint up to `max_position_embeddings`
  positions and no further (`--max-model-len` beyond it is refused at start-up).

Anything else (`mrope`, `proportional`, unknown names) is a ValueError naming the field.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(slots=True, frozen=True)
class RopeConfig:
    """One model's rotary embedding, with HF names translated once."""

    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int  # leading dimensions of each head that rotate (partial_rotary_factor)
    max_position_embeddings: int  # the checkpoint's field (the base of linear, dynamic and longrope factors)
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope: None = the paper's default
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope

    @property
    def max_positions(self) -> int:
        """Positions spindle serves: the scaled context, as vLLM derives it from the same config."""
        if self.rope_type == "linear":
            return int(self.max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return int((self.original_max_position_embeddings or self.max_position_embeddings) * self.factor)
        return self.max_position_embeddings


def parse_rope(hf: dict[str, Any], head_dim: int, aliases: dict[str, str] | None = None) -> RopeConfig:
    """RopeConfig from config.json, in transformers 5's `rope_parameters` or the older layout.

    The older layout keeps `rope_theta`, `partial_rotary_factor` and (Phi-3)
    `original_max_position_embeddings` at the top level and the scaling in `rope_scaling`
    (`type` or `rope_type`). `aliases` renames legacy types (Phi-3: su / yarn mean longrope).
    """
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling {rope_type!r} (rope_scaling / rope_parameters); "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("mrope_section") is not None:
        raise ValueError("unsupported rope_scaling.mrope_section (multimodal RoPE)")
    max_pos = int(hf.get("max_position_embeddings", 2048))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope") and original is None:
        original = max_pos  # transformers' default for these types

    def num(key: str, default: float | None) -> float | None:
        value = params.get(key)
        return default if value is None else float(value)

    factor = num("factor", None)
    if factor is None and rope_type in ("linear", "dynamic", "llama3", "yarn"):
        raise ValueError(f"rope scaling {rope_type!r} needs rope_scaling.factor")
    config = RopeConfig(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        max_position_embeddings=max_pos,
        factor=factor if factor is not None else (max_pos / original if original else 1.0),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=num("beta_fast", None) or 32.0,  # transformers: a falsy value means the default
        beta_slow=num("beta_slow", None) or 1.0,
        truncate=bool(params.get("truncate", True)),
        mscale=num("mscale", None),
        mscale_all_dim=num("mscale_all_dim", None),
        attention_factor=num("attention_factor", None),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
    )
    if rope_type == "dynamic":
        logger.warning(
            "rope_scaling 'dynamic' is served within max_position_embeddings=%d only (exactly default RoPE "
            "there); transformers' extension past it depends on each sequence's history, which a shared "
            "paged KV cache cannot reproduce",
            max_pos,
        )
    if rope_type == "longrope" and not (
        len(config.short_factor) == len(config.long_factor) == config.rotary_dim // 2
    ):
        raise ValueError(
            f"rope_scaling short_factor / long_factor need {config.rotary_dim // 2} values each, got "
            f"{len(config.short_factor)} / {len(config.long_factor)}"
        )
    if config.rotary_dim % 2 or not 0 < config.rotary_dim <= head_dim:
        raise ValueError(f"unsupported partial_rotary_factor={partial} for head_dim={head_dim}")
    return config


def _exponents(dim: int, device: torch.device | None) -> torch.Tensor:
    """2i / dim for i < dim / 2, from an int64 arange cast to float32 (as transformers)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _plain(base: float, dim: int, device: torch.device | None) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim, device))


def _llama3(rope: RopeConfig, device: torch.device | None) -> torch.Tensor:
    inv_freq = _plain(rope.theta, rope.rotary_dim, device)
    assert rope.original_max_position_embeddings is not None
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, device: torch.device | None) -> tuple[torch.Tensor, float]:
    dim, base = rope.rotary_dim, rope.theta
    assert rope.original_max_position_embeddings is not None
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** _exponents(dim, device)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp  # share of each dimension left unscaled
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention = _yarn_mscale(rope.factor)
    return inv_freq, float(attention)


def _longrope(rope: RopeConfig, factors: tuple[float, ...], device: torch.device | None) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    return 1.0 / (ext * rope.theta ** _exponents(rope.rotary_dim, device))


def _longrope_attention(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    assert rope.original_max_position_embeddings is not None
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def rope_frequencies(
    rope: RopeConfig, device: torch.device | None = None
) -> tuple[list[tuple[int, torch.Tensor]], float]:
    """([(first position, inverse frequencies [rotary_dim / 2]) ...], attention factor).

    One entry except for longrope, whose long set starts at original_max_position_embeddings.
    The attention factor multiplies cos and sin (so q.k by its square), as transformers does.
    """
    kind, dim = rope.rope_type, rope.rotary_dim
    if kind == "default":
        return [(0, _plain(rope.theta, dim, device))], 1.0
    if kind == "linear":
        inv_freq = _plain(rope.theta, dim, device)
        inv_freq /= rope.factor
        return [(0, inv_freq)], 1.0
    if kind == "dynamic":
        # transformers' formula at seq_len = max_position_embeddings: served positions never exceed it.
        max_pos = rope.max_position_embeddings
        base = rope.theta * ((rope.factor * max_pos / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
        return [(0, _plain(base, dim, device))], 1.0
    if kind == "llama3":
        return [(0, _llama3(rope, device))], 1.0
    if kind == "yarn":
        inv_freq, attention = _yarn(rope, device)
        return [(0, inv_freq)], attention
    assert kind == "longrope" and rope.original_max_position_embeddings is not None
    short = _longrope(rope, rope.short_factor, device)
    long = _longrope(rope, rope.long_factor, device)
    return [(0, short), (rope.original_max_position_embeddings, long)], _longrope_attention(rope)
