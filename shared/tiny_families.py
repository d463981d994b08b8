"""Tiny random checkpoints of the newer decoder families, in each family's real config.json layout.

Each entry is a real checkpoint's config.json (Llama 3.2, Qwen2.5 with YaRN, Qwen3, Phi-3.5,
Phi-4-mini, Gemma 2), field for field, shrunk: hidden size 64, 2-4 layers, the 512-token BPE
vocabulary of `tiny_models`, and short original context lengths so that tests reach positions
past `original_max_position_embeddings` (where RoPE scaling matters) with prompts of a few
dozen tokens. Values that would make a feature invisible at this size are shrunk with the rest
(Gemma's sliding window and soft-caps). The config.json that is written is that dict exactly
(not transformers' re-serialised form), so spindle parses what users' checkpoints hold; the
transformers oracle loads the same file. Fixed seed; weights drawn wide (std 0.2) so the greedy
token wins by a clear margin; norm weights are random too, so a misplaced norm shows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from shared.tiny_models import build_tokenizer

VOCAB = 512
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}


def _factors(seed: int, count: int, low: float, high: float) -> list[float]:
    rng = random.Random(seed)
    return sorted(round(rng.uniform(low, high), 4) for _ in range(count))


# family -> config.json (each from a real checkpoint of that family, shrunk as the module says).
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.2-1B: llama3 RoPE, tied embeddings, explicit head_dim, EOS list (Instruct).
    "llama3": {
        **_SHAPE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": [1, 2],
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 32,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "use_cache": True,
    },
    # A Llama 2 fine-tune with linear position interpolation (older "type" key).
    "llama-linear": {
        **_SHAPE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "max_position_embeddings": 48,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Dynamic NTK: served within max_position_embeddings only (see services/worker/models/rope_scaling.py).
    "llama-dynamic": {
        **_SHAPE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"type": "dynamic", "factor": 3.0},
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen2.5-7B-Instruct with the YaRN block its model card adds for long contexts.
    "qwen2.5-yarn": {
        **_SHAPE,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": 32,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32, "type": "yarn"},
    },
    # Qwen/Qwen3-0.6B: q/k norms, head_dim larger than hidden / heads, tied embeddings.
    "qwen3": {
        **_SHAPE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
    },
    # microsoft/Phi-3.5-mini-instruct: fused qkv_proj / gate_up_proj, longrope.
    "phi3.5": {
        **_SHAPE,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "num_key_value_heads": 4,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "embd_pdrop": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "original_max_position_embeddings": 48,
        "pad_token_id": 3,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": _factors(1, 8, 1.0, 24.0),
            "short_factor": _factors(2, 8, 1.0, 1.6),
            "type": "longrope",
        },
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": False,
        "use_cache": True,
    },
    # microsoft/Phi-4-mini-instruct: Phi3ForCausalLM with partial_rotary_factor 0.75, tied embeddings.
    "phi4-mini": {
        **_SHAPE,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "original_max_position_embeddings": 48,
        "pad_token_id": 3,
        "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": _factors(3, 6, 1.0, 24.0),
            "short_factor": _factors(4, 6, 1.0, 1.6),
            "type": "longrope",
        },
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": True,
    },
    # google/gemma-2-2b: window 4096 and caps 50 / 30 shrunk to 16 and 8 / 5 so they act here.
    "gemma2": {
        **_SHAPE,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 8.0,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 2],
        "final_logit_softcapping": 5.0,
        "head_dim": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 1024,
        "num_hidden_layers": 4,
        "pad_token_id": 3,
        "query_pre_attn_scalar": 24,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 16,
        "use_cache": True,
    },
}


def build_family(out_dir: str | Path, family: str, seed: int = 0, init_std: float = 0.2) -> Path:
    """Write `family`'s tiny checkpoint: config.json (real layout), safetensors, tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILY_CONFIGS)}")
    hf_config = FAMILY_CONFIGS[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, VOCAB)
    config_text = json.dumps(hf_config, indent=2)
    (out / "config.json").write_text(config_text)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma stores (scale - 1); the others the scale itself
                param.normal_(0.0 if family == "gemma2" else 1.0, 0.1)
            else:
                param.normal_(0.0, init_std)
    eos = hf_config["eos_token_id"]
    model.generation_config.bos_token_id = 0
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 3
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "config.json").write_text(config_text)  # the real layout, not transformers' rewrite
    return out
