"""Load an HF checkpoint directory into spindle's model classes.

Reads config.json, picks the class from `MODEL_REGISTRY` by `architectures[0]`, and copies
safetensors weights to where the model's `map_weight` says (renaming HF parameters and fusing
q/k/v and gate/up on the way). A checkpoint that leaves any parameter unset is an error, not
a random model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.worker.attention import AttentionBackend
from services.worker.models import MODEL_REGISTRY, read_hf_config, resolve_model
from services.worker.models.base import SpindleModel
from services.worker.models.config import DecoderConfig
from services.worker.models.decoder import DecoderForCausalLM
from services.worker.models.encoder_config import EncoderConfig
from services.worker.models.fast_linear import ACTIVATION_DTYPES, calibrate, store_weights_as

logger = logging.getLogger(__name__)

ModelConfig = DecoderConfig | EncoderConfig


def parse_config(hf: dict) -> ModelConfig:
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError("config.json names no architectures")
    _, _, parse = resolve_model(architectures[0])
    return parse(hf)


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    weight_dtype: torch.dtype | None = None,
) -> SpindleModel:
    """Build the model for `model_dir` and load its weights (on `device`, in `dtype`).

    `weight_dtype` (default `dtype`) is how the linear layers' weights are stored: bfloat16
    under float32 activations halves the bytes a decode step reads.
    """
    hf = read_hf_config(model_dir)
    config = parse_config(hf)
    model_cls, _, _ = resolve_model(config.architecture)
    with torch.device("meta"):
        model = model_cls(config, backend)
    model = model.to_empty(device=device).to(dtype=dtype)
    model.post_init()
    _load_weights(model, Path(model_dir))
    logger.info("loaded %s (%s) from %s", config.architecture, dtype, model_dir)
    if weight_dtype is not None and weight_dtype != dtype:
        linear_bytes = store_weights_as(model, weight_dtype)
        logger.info("linear weights stored as %s: %.1f MiB", weight_dtype, linear_bytes / 2**20)
    if device.type == "cpu" and dtype in ACTIVATION_DTYPES:
        calibrate(model, dtype)  # which linear layers run few-row inputs through spindle's kernel
        for module in model.modules():
            if isinstance(module, DecoderForCausalLM):
                module.build_native_stack()  # needs the calibration's row counts
    return model.eval()


def _load_weights(model: SpindleModel, model_dir: Path) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors files")
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    unset = set(params)
    filled: dict[str, int] = {}
    for file in files:
        for hf_name, tensor in load_file(str(file)).items():
            target = model.map_weight(hf_name)
            if target is None or target[0] not in params:
                logger.debug("ignoring checkpoint tensor %s", hf_name)
                continue
            name, start = target
            _copy(params[name], tensor, start)
            filled[name] = filled.get(name, 0) + tensor.shape[0]
            if start is None or filled[name] == params[name].shape[0]:
                unset.discard(name)
    if unset:
        raise ValueError(f"checkpoint in {str(model_dir)!r} lacks weights for {sorted(unset)[:5]}")


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, start: int | None) -> None:
    """Copy a checkpoint tensor into a parameter, or into rows [start:] of a fused one."""
    target = param if start is None else param[start : start + tensor.shape[0]]
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {tuple(tensor.shape)} does not fit parameter {tuple(param.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)


__all__ = ["MODEL_REGISTRY", "load_model", "parse_config", "read_hf_config"]
