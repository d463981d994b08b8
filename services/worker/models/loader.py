"""Load an HF checkpoint directory into spindle's model classes.

Reads config.json, picks the class from `MODEL_REGISTRY` by `architectures[0]`, and copies
safetensors weights in, renaming HF parameters and fusing q/k/v and gate/up on the way.
A checkpoint that leaves any parameter unset is an error, not a random model.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from services.worker.attention import AttentionBackend
from services.worker.models import MODEL_REGISTRY, resolve_model
from services.worker.models.config import DecoderConfig

logger = logging.getLogger(__name__)

# HF name suffix -> (spindle parameter suffix, index of the shard inside a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
    hf = json.loads(path.read_text())
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file() and "eos_token_id" in (gen_cfg := json.loads(gen.read_text())):
        hf["eos_token_id"] = gen_cfg["eos_token_id"]  # generation config wins, as in HF generate
    return hf


def parse_config(hf: dict) -> DecoderConfig:
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError("config.json names no architectures")
    _, _, parse = resolve_model(architectures[0])
    return parse(hf)


def load_model(
    model_dir: str | Path, backend: AttentionBackend, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Build the model for `model_dir` and load its weights (on `device`, in `dtype`)."""
    hf = read_hf_config(model_dir)
    config = parse_config(hf)
    model_cls, _, _ = resolve_model(config.architecture)
    with torch.device("meta"):
        model = model_cls(config, backend)
    model = model.to_empty(device=device).to(dtype=dtype)
    model.rope.init_tables()  # float32, as HF computes them
    model.tie_weights()  # to_empty gives every module its own new parameters
    _load_weights(model, Path(model_dir), config)
    logger.info("loaded %s (%s) from %s", config.architecture, dtype, model_dir)
    return model.eval()


def _load_weights(model: nn.Module, model_dir: Path, config: DecoderConfig) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors files")
    params = dict(model.named_parameters())
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    offsets = {"qkv_proj": (0, q, q + kv), "gate_up_proj": (0, config.intermediate_size)}
    unset = set(params)
    filled: dict[str, int] = {}
    for file in files:
        for hf_name, tensor in load_file(str(file)).items():
            name, shard = _map_name(hf_name)
            if name is None or name not in params:
                logger.debug("ignoring checkpoint tensor %s", hf_name)
                continue
            start = None if shard is None else offsets[name.split(".")[-2]][shard]
            _copy(params[name], tensor, start)
            filled[name] = filled.get(name, 0) + tensor.shape[0]
            if shard is None or filled[name] == params[name].shape[0]:
                unset.discard(name)
    if config.tie_word_embeddings:
        unset.discard("lm_head.weight")
    if unset:
        raise ValueError(f"checkpoint in {str(model_dir)!r} lacks weights for {sorted(unset)[:5]}")


def _map_name(hf_name: str) -> tuple[str | None, int | None]:
    """HF parameter name -> (spindle name, shard index or None)."""
    if "rotary_emb" in hf_name:
        return None, None
    match = _LAYER.match(hf_name)
    if match is None:
        return hf_name.removeprefix("model."), None
    layer, module, kind = match.groups()
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", shard
    return f"layers.{layer}.{module}.{kind}", None


def _copy(param: nn.Parameter, tensor: torch.Tensor, start: int | None) -> None:
    """Copy a checkpoint tensor into a parameter, or into rows [start:] of a fused one."""
    target = param if start is None else param[start : start + tensor.shape[0]]
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {tuple(tensor.shape)} does not fit parameter {tuple(param.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)


__all__ = ["MODEL_REGISTRY", "load_model", "parse_config", "read_hf_config"]
