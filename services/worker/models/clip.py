"""CLIP vision tower (the image encoder of LLaVA-style models), in spindle's own code.

Images arrive as a batch of equally sized pixel tensors; their patch tokens are packed back to
back ([num_images * tokens_per_image, hidden]) and attention is bidirectional within each
image through the same backend interface as BERT (`AttentionType.ENCODER_ONLY`, no KV cache).
Pre-norm layers with quick-GELU, as HF `CLIPVisionModel`. Only as many layers run as the
requested feature layers need; the pooled head and post-layernorm are not used by LLaVA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    LayerAttentionSpec,
)

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_QKV = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}


@dataclass(slots=True, frozen=True)
class ClipVisionConfig:
    """What the tower needs from HF `vision_config`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def clip_vision_config(hf: dict[str, Any]) -> ClipVisionConfig:
    """Parse HF `vision_config`; a model type or activation spindle cannot run exactly is an error."""
    model_type = hf.get("model_type", "clip_vision_model")
    if model_type != "clip_vision_model":
        raise ValueError(f"unsupported vision tower model_type={model_type!r}; only 'clip_vision_model'")
    act = hf.get("hidden_act", "quick_gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported vision hidden_act={act!r}; expected one of {sorted(_ACTIVATIONS)}")
    return ClipVisionConfig(
        hidden_size=int(hf.get("hidden_size", 768)),
        intermediate_size=int(hf.get("intermediate_size", 3072)),
        num_layers=int(hf.get("num_hidden_layers", 12)),
        num_heads=int(hf.get("num_attention_heads", 12)),
        image_size=int(hf.get("image_size", 224)),
        patch_size=int(hf.get("patch_size", 32)),
        num_channels=int(hf.get("num_channels", 3)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        hidden_act=act,
    )


class ClipEncoderLayer(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual add (HF CLIPEncoderLayer)."""

    def __init__(self, config: ClipVisionConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h = config.hidden_size
        self.hidden_size = h
        self.layer_norm1 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.qkv_proj = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)
        self.layer_norm2 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(h, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, h)
        self.act = _ACTIVATIONS[config.hidden_act]
        d = config.head_dim
        self.spec = LayerAttentionSpec(config.num_heads, config.num_heads, d, d**-0.5)
        self.backend = backend

    def forward(self, x: torch.Tensor, meta: Any) -> torch.Tensor:
        s = self.spec
        q, k, v = (
            t.reshape(-1, s.num_heads, s.head_dim)
            for t in self.qkv_proj(self.layer_norm1(x)).split(self.hidden_size, -1)
        )
        attn = self.backend.forward(s, q, k, v, None, meta).reshape(-1, self.hidden_size)
        x = x + self.out_proj(attn)
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class ClipVisionTower(nn.Module):
    """Patch + class + position embeddings, pre-layernorm, then the encoder layers."""

    def __init__(self, config: ClipVisionConfig, backend: AttentionBackend, num_layers: int) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(h))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, h, kernel_size=config.patch_size, stride=config.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, h)
        self.pre_layrnorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(ClipEncoderLayer(config, backend) for _ in range(num_layers))
        self.backend = backend

    @property
    def tokens_per_image(self) -> int:
        return self.config.num_patches + 1

    def map_weight(self, name: str) -> tuple[str, int | None] | None:
        """HF names inside the vision model (prefix stripped) -> this module's names."""
        if name.startswith("embeddings."):
            return name.removeprefix("embeddings."), None
        if name.startswith("pre_layrnorm."):
            return name, None
        match = _LAYER.match(name)
        if match is None:
            return None  # post_layernorm, pooled head: unused by LLaVA
        layer, rest = match.groups()
        if int(layer) >= len(self.layers):
            return None  # layers past the deepest feature layer never run
        module, kind = rest.rsplit(".", 1)
        if module in _QKV:
            return f"layers.{layer}.qkv_proj.{kind}", _QKV[module] * self.config.hidden_size
        module = module.removeprefix("self_attn.").removeprefix("mlp.")
        return f"layers.{layer}.{module}.{kind}", None

    def _metadata(self, num_images: int, device: torch.device) -> Any:
        """Encoder-only metadata: each image is one sequence of `tokens_per_image` tokens."""
        n = self.tokens_per_image
        lens = np.full(num_images, n, np.int64)
        builder = self.backend.metadata_builder()
        extra = builder.prepare(lens, lens, AttentionType.ENCODER_ONLY)
        qsl = np.arange(num_images + 1, dtype=np.int64) * n
        common = CommonAttentionMetadata(
            attn_type=AttentionType.ENCODER_ONLY,
            num_reqs=num_images,
            num_tokens=num_images * n,
            max_query_len=n,
            max_seq_len=n,
            query_start_loc=torch.from_numpy(qsl).to(device),
            seq_lens=torch.from_numpy(lens).to(device),
            query_lens_host=lens,
            seq_lens_host=lens,
        )
        return builder.build(common, [torch.from_numpy(a).to(device) for a in extra])

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states [num_images, tokens_per_image, hidden] after 0..num_layers layers.

        Entry i is the input of layer i (entry 0 the pre-layernorm output), as HF's
        `hidden_states` tuple.
        """
        num_images = pixel_values.shape[0]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(num_images, 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        x = self.pre_layrnorm(x).reshape(-1, self.config.hidden_size)
        meta = self._metadata(num_images, x.device)
        shape = (num_images, self.tokens_per_image, self.config.hidden_size)
        states = [x.view(shape)]
        for layer in self.layers:
            x = layer(x, meta)
            states.append(x.view(shape))
        return states
