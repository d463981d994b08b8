"""Fractions of the machine's limits: the weights a decode step reads, and the arithmetic on them."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.models import BENCH_MODELS
from benchmarks.roofline import (
    MachineLimits,
    bandwidth_fraction,
    decode_weights,
    gemm_fraction,
    tail_ratio,
    weight_bytes,
)


@pytest.mark.parametrize("name", ["small", "medium"])
def test_decode_weights_are_every_parameter_but_the_embedding(name: str) -> None:
    spec = BENCH_MODELS[name]
    config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         tie_word_embeddings=False)
    with torch.device("meta"):  # shapes only: no memory, no init
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert decode_weights(spec) == total - spec.vocab_size * spec.hidden_size


def test_weight_bytes_per_dtype() -> None:
    spec = BENCH_MODELS["small"]
    assert weight_bytes(spec, "float32") == 2 * weight_bytes(spec, "bfloat16") == 4 * decode_weights(spec)
    with pytest.raises(ValueError, match="float16"):
        weight_bytes(spec, "float16")


def test_fractions() -> None:
    spec = BENCH_MODELS["medium"]
    limits = MachineLimits(gemm_flops=2e11, read_bandwidth=4e10)
    per_token = decode_weights(spec)
    # Reading the fp32 weights 10 times a second out of 4e10 bytes/s.
    assert bandwidth_fraction(10.0, spec, "float32", limits) == pytest.approx(10 * 4 * per_token / 4e10)
    assert bandwidth_fraction(10.0, spec, "bfloat16", limits) == pytest.approx(10 * 2 * per_token / 4e10)
    assert gemm_fraction(500.0, spec, limits) == pytest.approx(2 * per_token * 500 / 2e11)
    # One prompt token per output token: every weight but the LM head once more per output token.
    lm_head = spec.vocab_size * spec.hidden_size
    assert gemm_fraction(500.0, spec, limits, 1.0) == pytest.approx(2 * (2 * per_token - lm_head) * 500 / 2e11)
    # bf16 cells count against the bf16 peak where one was measured (bf16 math), else the fp32 one.
    assert gemm_fraction(500.0, spec, limits, dtype="bfloat16") == gemm_fraction(500.0, spec, limits)
    native = MachineLimits(gemm_flops=2e11, read_bandwidth=4e10, bf16_gemm_flops=8e11)
    assert gemm_fraction(500.0, spec, native, dtype="bfloat16") == pytest.approx(2 * per_token * 500 / 8e11)
    assert gemm_fraction(500.0, spec, native) == gemm_fraction(500.0, spec, limits)
    assert tail_ratio(30.0, 10.0) == pytest.approx(3.0)
    assert tail_ratio(30.0, 0.0) is None
