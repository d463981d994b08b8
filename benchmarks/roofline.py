"""How close a measured throughput comes to what the machine allows: pure arithmetic, no measuring.

Issue 14 judges spindle against the machine as well as against peers. One stream is bound by
memory: every decode step reads every weight once, so tok/s x weight bytes can at most reach the
memory read bandwidth. Many streams are bound by compute: a decode token costs 2 FLOPs per weight
it multiplies by, so 2 x params x tok/s can at most reach the peak GEMM FLOP/s. The inputs come
from benchmarks/machine_limits.py (measured in the same run) and the model's spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.tiny_models import TinyModelSpec

BYTES_PER_WEIGHT: dict[str, int] = {"float32": 4, "bfloat16": 2}


def decode_weights(spec: TinyModelSpec) -> int:
    """Weights a decode step multiplies by per token: every linear layer and the LM head.

    The input embedding is a row lookup, not a GEMM, so it is left out (the bench models do not
    tie it to the LM head); the RMSNorm scales are counted, since they are read every step too.
    """
    head_dim = spec.hidden_size // spec.num_heads
    kv = spec.num_kv_heads * head_dim
    attention = spec.hidden_size * (2 * spec.hidden_size + 2 * kv)  # q, o and k, v
    mlp = 3 * spec.hidden_size * spec.intermediate_size  # gate, up, down
    norms = 2 * spec.hidden_size
    return spec.num_layers * (attention + mlp + norms) + spec.hidden_size + spec.vocab_size * spec.hidden_size


def weight_bytes(spec: TinyModelSpec, dtype: str) -> int:
    """Bytes one decode step reads for the weights of `spec` stored as `dtype`."""
    if dtype not in BYTES_PER_WEIGHT:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(BYTES_PER_WEIGHT)}")
    return decode_weights(spec) * BYTES_PER_WEIGHT[dtype]


@dataclass(frozen=True, slots=True)
class MachineLimits:
    """What the machine did in the same run: peak fp32 GEMM, memory read bandwidth, and peak bf16
    GEMM where the CPU multiplies bf16 natively (None elsewhere: bf16 cells compute in fp32 there)."""

    gemm_flops: float  # FLOP/s
    read_bandwidth: float  # bytes/s
    bf16_gemm_flops: float | None = None  # FLOP/s

    def peak_flops(self, dtype: str) -> float:
        """The GEMM peak that bounds a cell with `dtype` weights: bf16's where it was measured."""
        return self.bf16_gemm_flops if dtype == "bfloat16" and self.bf16_gemm_flops else self.gemm_flops


def bandwidth_fraction(tokens_per_s: float, spec: TinyModelSpec, dtype: str, limits: MachineLimits) -> float:
    """Single stream: tok/s x weight bytes / read bandwidth (1.0 = every step reads the weights at full speed)."""
    return tokens_per_s * weight_bytes(spec, dtype) / limits.read_bandwidth


def gemm_fraction(tokens_per_s: float, spec: TinyModelSpec, limits: MachineLimits,
                  prompt_tokens_per_output: float = 0.0, dtype: str = "float32") -> float:
    """Batched decode: 2 x weights x tok/s / peak GEMM FLOP/s of `dtype` weights' arithmetic
    (attention's FLOPs not counted).

    With `prompt_tokens_per_output` (the workload's prompt / output lengths) the prompt tokens
    the same run computed count too, each through every weight but the LM head (only a prompt's
    last position is sampled): the FLOPs the machine did, where output tokens alone leave out
    half of a 128 + 128 workload's.
    """
    prompt_weights = decode_weights(spec) - spec.vocab_size * spec.hidden_size
    flops_per_output = 2.0 * (decode_weights(spec) + prompt_tokens_per_output * prompt_weights)
    return flops_per_output * tokens_per_s / limits.peak_flops(dtype)


def tail_ratio(p99_ms: float, p50_ms: float) -> float | None:
    """ITL p99 / median; None where the median is zero (nothing was streamed token by token)."""
    return p99_ms / p50_ms if p50_ms > 0 else None
