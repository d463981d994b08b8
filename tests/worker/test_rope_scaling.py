"""RoPE variants against transformers: inverse frequencies and cos/sin tables, bit for bit.

Each case is a config.json dict (the real layout of a family that uses the variant). The
frequencies must equal transformers' `ROPE_INIT_FUNCTIONS`, and spindle's cos/sin table must
equal what transformers' rotary embedding module returns at the same positions, including
positions past `original_max_position_embeddings` (where scaling matters).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from services.worker.models.config import gemma2_config, llama_config, phi3_config, qwen2_config
from services.worker.models.rope import rope_tables
from services.worker.models.rope_scaling import RopeConfig, parse_rope, rope_frequencies
from shared.tiny_families import FAMILY_CONFIGS

_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 512,
    "rope_theta": 10000.0,
}
_DEEPSEEK_YARN = {  # DeepSeek-V2/V3 style YaRN block: mscale and mscale_all_dim
    "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 0.707,
}
CASES: dict[str, dict[str, Any]] = {
    "default": {**_LLAMA, "max_position_embeddings": 128},
    "linear": FAMILY_CONFIGS["llama-linear"],
    "dynamic": FAMILY_CONFIGS["llama-dynamic"],
    "llama3": FAMILY_CONFIGS["llama3"],
    "yarn": FAMILY_CONFIGS["qwen2.5-yarn"],
    "yarn-mscale": {**_LLAMA, "max_position_embeddings": 2560, "rope_scaling": _DEEPSEEK_YARN},
    "yarn-untruncated": {
        **_LLAMA, "max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                         "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "attention_factor": 1.25},
    },
    "longrope": FAMILY_CONFIGS["phi3.5"],
    "longrope-partial": FAMILY_CONFIGS["phi4-mini"],
}


def _hf_config(case: str):  # noqa: ANN202 - a transformers config
    raw = copy.deepcopy(CASES[case])
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def _ours(case: str) -> RopeConfig:
    hf = CASES[case]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return parse_rope(hf, head_dim, {"su": "longrope"})


def _hf_rotary(case: str) -> torch.nn.Module:
    config = _hf_config(case)
    return Phi3RotaryEmbedding(config) if config.model_type == "phi3" else LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_inverse_frequencies_equal_transformers(case: str) -> None:
    ours = _ours(case)
    sets, attention = rope_frequencies(ours)
    config = _hf_config(case)
    kind = config.rope_parameters["rope_type"]
    assert ours.rope_type == kind
    if kind == "default":
        hf_inv, hf_attention = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        hf_inv, hf_attention = ROPE_INIT_FUNCTIONS[kind](config, None)
    assert torch.equal(sets[0][1], hf_inv)
    assert attention == hf_attention
    if kind == "longrope":
        original = config.rope_parameters["original_max_position_embeddings"]
        hf_long, _ = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=original + 1)
        assert sets[1][0] == original and torch.equal(sets[1][1], hf_long)
        assert not torch.equal(hf_long, hf_inv)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cos_sin_tables_equal_transformers_past_the_original_window(case: str) -> None:
    """Positions on both sides of original_max_position_embeddings (the long set for longrope)."""
    ours = _ours(case)
    rows = ours.max_positions
    cos, sin = rope_tables(ours, rows)
    rotary = _hf_rotary(case)
    x = torch.zeros(1, dtype=torch.float32)
    original = ours.original_max_position_embeddings or ours.max_position_embeddings
    # transformers picks longrope's set per call, so each side of the window is its own call.
    for start, stop in ((0, min(original, rows)), (min(original, rows), rows)):
        if start == stop:
            continue
        hf_cos, hf_sin = rotary(x, torch.arange(start, stop)[None])
        assert torch.equal(cos[start:stop], hf_cos[0]), f"cos rows {start}..{stop}"
        assert torch.equal(sin[start:stop], hf_sin[0]), f"sin rows {start}..{stop}"


def test_served_positions_follow_the_scaling(caplog: pytest.LogCaptureFixture) -> None:
    assert _ours("linear").max_positions == 48 * 4
    assert _ours("yarn").max_positions == 32 * 4  # original window x factor, as vLLM derives it
    assert _ours("llama3").max_positions == 1024  # Llama 3.1 configs already state the long context
    assert _ours("longrope").max_positions == 1024
    assert _ours("dynamic").max_positions == 256  # dynamic NTK is served within its window only
    assert "'dynamic' is served within max_position_embeddings=256 only" in caplog.text
    assert _ours("longrope-partial").rotary_dim == 12  # partial_rotary_factor 0.75 of head_dim 16


def test_transformers_5_layout_parses_like_the_original_one() -> None:
    """config.json saved by transformers 5 (`rope_parameters`) gives the same RopeConfig."""
    for case in ("llama3", "yarn", "linear", "dynamic", "longrope-partial"):
        saved = _hf_config(case).to_dict()
        parse = phi3_config if saved["model_type"] == "phi3" else llama_config
        assert parse(saved).rope == parse(CASES[case]).rope, case


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "proportional", "factor": 2.0}, "unsupported rope scaling 'proportional'"),
        ({"type": "mrope", "mrope_section": [2, 3, 3]}, "unsupported rope scaling 'mrope'"),
        ({"rope_type": "default", "mrope_section": [2, 3, 3]}, "mrope_section"),
        ({"rope_type": "linear"}, "rope scaling 'linear' needs rope_scaling.factor"),
        ({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "need 8 values each"),
    ],
)
def test_unsupported_rope_settings_are_clear_errors(scaling: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama_config({**CASES["default"], "rope_scaling": scaling})


def test_phi3_legacy_su_name_means_longrope() -> None:
    legacy = copy.deepcopy(FAMILY_CONFIGS["phi3.5"])
    legacy["rope_scaling"]["type"] = "su"
    assert phi3_config(legacy).rope == phi3_config(FAMILY_CONFIGS["phi3.5"]).rope
    with pytest.raises(ValueError, match="unsupported rope scaling 'su'"):
        llama_config({**CASES["default"], "rope_scaling": {"type": "su"}})


def test_family_flags() -> None:
    gemma = gemma2_config(FAMILY_CONFIGS["gemma2"])
    assert gemma.sliding_windows == (16, None, 16, None)  # transformers: even layers slide
    assert gemma.tie_word_embeddings and gemma.norm_unit_offset and gemma.sandwich_norms
    assert gemma.attention_scale == 24**-0.5 and gemma.head_dim == 32
    assert (gemma.attn_logit_softcap, gemma.final_logit_softcap) == (8.0, 5.0)
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.eos_token_ids == (1, 2)
    qwen = qwen2_config(FAMILY_CONFIGS["qwen2.5-yarn"])
    assert qwen.rope.rope_type == "yarn" and qwen.qkv_bias and qwen.sliding_windows == (None, None)
    with pytest.raises(ValueError, match="unsupported hidden_activation='gelu'"):
        gemma2_config({**FAMILY_CONFIGS["gemma2"], "hidden_activation": "gelu"})
    with pytest.raises(ValueError, match="unsupported hidden_act='relu2'"):
        llama_config({**CASES["default"], "hidden_act": "relu2"})
