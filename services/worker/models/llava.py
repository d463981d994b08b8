"""LLaVA-style vision-language models: CLIP vision tower, projector, and a decoder LM.

The worker encodes images (`encode_images`) separately from the language model's forward
pass, because the scheduler budgets encoder work apart from decoder tokens and an image's
features may be needed by several chunks (and several requests). The runner scatters the
features over the image placeholder tokens' embeddings and passes `inputs_embeds` to the
language model, which is spindle's `DecoderForCausalLM` unchanged otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionBackend
from services.worker.models.base import SpindleModel, WeightTarget
from services.worker.models.clip import ClipVisionConfig, ClipVisionTower, clip_vision_config
from services.worker.models.config import DecoderConfig, llama_config, mistral_config, qwen2_config
from services.worker.models.decoder import DecoderForCausalLM
from shared.types import RequestKind

_TEXT_PARSERS = {"llama": llama_config, "mistral": mistral_config, "qwen2": qwen2_config}
_PROJECTOR_ACTS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_SELECT_STRATEGIES = ("default", "full")  # default drops the CLS token, full keeps it


@dataclass(slots=True, frozen=True)
class LlavaModelConfig:
    """A LLaVA checkpoint: text and vision configs plus how features are picked and projected."""

    architecture: str
    text: DecoderConfig
    vision: ClipVisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...]  # indices into the tower's hidden states (negative from the end)
    select_strategy: str
    projector_act: str
    projector_bias: bool

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.text.eos_token_ids

    # The KV cache is the language model's: kv_cache.py reads these three.
    @property
    def num_layers(self) -> int:
        return self.text.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.text.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.text.head_dim

    @property
    def tokens_per_image(self) -> int:
        """Feature tokens one image becomes: its patches, plus CLS with the "full" strategy."""
        return self.vision.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def feature_indices(self) -> tuple[int, ...]:
        """`feature_layers` as non-negative indices into HF's hidden-states tuple (num_layers + 1)."""
        n = self.vision.num_layers
        return tuple(layer if layer >= 0 else n + 1 + layer for layer in self.feature_layers)

    @property
    def num_vision_layers_run(self) -> int:
        """Layers the tower must run to produce the deepest requested hidden state."""
        return max(self.feature_indices)


def llava_config(hf: dict[str, Any]) -> LlavaModelConfig:
    """Parse a LlavaForConditionalGeneration config.json; unsupported settings are a ValueError."""
    text_hf = dict(hf.get("text_config") or {})
    model_type = text_hf.get("model_type", "llama")
    if model_type not in _TEXT_PARSERS:
        raise ValueError(f"unsupported text_config.model_type={model_type!r}; expected {sorted(_TEXT_PARSERS)}")
    if "eos_token_id" in hf:
        text_hf["eos_token_id"] = hf["eos_token_id"]  # generation_config's EOS, as read_hf_config put it
    vision = clip_vision_config(hf.get("vision_config") or {})
    layers = hf.get("vision_feature_layer", -2)
    layers = tuple(int(x) for x in layers) if isinstance(layers, list) else (int(layers),)
    for layer in layers:
        if not -(vision.num_layers + 1) <= layer <= vision.num_layers:
            raise ValueError(f"vision_feature_layer={layer} is outside the tower's {vision.num_layers} layers")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in _SELECT_STRATEGIES:
        raise ValueError(f"unsupported vision_feature_select_strategy={strategy!r}; expected {_SELECT_STRATEGIES}")
    act = hf.get("projector_hidden_act", "gelu")
    if act not in _PROJECTOR_ACTS:
        raise ValueError(f"unsupported projector_hidden_act={act!r}; expected one of {sorted(_PROJECTOR_ACTS)}")
    image_token_id = hf.get("image_token_id", hf.get("image_token_index"))
    if image_token_id is None:
        raise ValueError("config.json names no image_token_id / image_token_index")
    text = _TEXT_PARSERS[model_type](text_hf)
    return LlavaModelConfig(
        architecture=hf["architectures"][0],
        text=text,
        vision=vision,
        image_token_id=int(image_token_id),
        feature_layers=layers,
        select_strategy=strategy,
        projector_act=act,
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
    )


class MultiModalProjector(nn.Module):
    """linear -> activation -> linear, from vision features to the LM's hidden size."""

    def __init__(self, config: LlavaModelConfig) -> None:
        super().__init__()
        in_size = config.vision.hidden_size * len(config.feature_layers)
        out_size, bias = config.text.hidden_size, config.projector_bias
        self.linear_1 = nn.Linear(in_size, out_size, bias=bias)
        self.linear_2 = nn.Linear(out_size, out_size, bias=bias)
        self.act = _PROJECTOR_ACTS[config.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(SpindleModel):
    """Vision tower + projector + `DecoderForCausalLM`; generates like a decoder."""

    task = RequestKind.GENERATE

    def __init__(self, config: LlavaModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = ClipVisionTower(config.vision, backend, config.num_vision_layers_run)
        self.multi_modal_projector = MultiModalProjector(config)
        self.language_model = DecoderForCausalLM(config.text, backend)

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    def post_init(self) -> None:
        self.language_model.post_init()

    def map_weight(self, hf_name: str) -> WeightTarget | None:
        """Both checkpoint layouts: legacy (`language_model.model.*`) and `model.language_model.*`."""
        name = hf_name.removeprefix("model.")
        if name.startswith("vision_tower."):
            inner = name.removeprefix("vision_tower.").removeprefix("vision_model.")
            target = self.vision_tower.map_weight(inner)
            return None if target is None else (f"vision_tower.{target[0]}", target[1])
        if name.startswith("multi_modal_projector."):
            return name, None
        if name.startswith("lm_head.") or name.startswith("language_model.lm_head."):
            return "language_model." + name.removeprefix("language_model."), None
        if name.startswith("language_model."):
            inner = name.removeprefix("language_model.")
            target = self.language_model.map_weight(inner if inner.startswith("model.") else "model." + inner)
            return None if target is None else (f"language_model.{target[0]}", target[1])
        return None

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, tokens_per_image, text_hidden] features from [num_images, C, H, W] pixels."""
        states = self.vision_tower(pixel_values)
        picked = [states[i] for i in self.config.feature_indices]
        if self.config.select_strategy == "default":
            picked = [s[:, 1:] for s in picked]
        return self.multi_modal_projector(torch.cat(picked, dim=-1))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        meta: Any,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states; `inputs_embeds` (with image features in place) replaces the lookup."""
        return self.language_model(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
