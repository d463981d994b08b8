"""Build a small random-initialised LLaVA checkpoint (CLIP vision tower + Llama) with its processor.

No downloads: the tokenizer is the byte-level BPE of `tiny_models` plus an `<image>` special
token, the image processor is a `CLIPImageProcessor` sized for the tiny tower (transformers
falls back to its PIL implementation when torchvision is missing). Fixed seed, so two builds
are identical; weights drawn wide so greedy tokens win by a clear margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.tiny_models import build_tokenizer

IMAGE_TOKEN = "<image>"
# Content may be a string or OpenAI-style parts ({"type": "image"} / {"type": "text"}).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyVlmSpec:
    """Shape of a random LLaVA checkpoint."""

    image_size: int = 32
    patch_size: int = 8
    vision_hidden: int = 32
    vision_layers: int = 3
    text_hidden: int = 64
    text_layers: int = 2
    vocab_size: int = 512  # BPE vocabulary; the model's is larger by the added <image> token
    feature_layer: int = -2
    select_strategy: str = "default"  # "default" drops CLS, "full" keeps it
    init_std: float = 0.2
    seed: int = 0

    @property
    def image_tokens(self) -> int:
        """Feature tokens per image (what one <image> placeholder expands to)."""
        patches = (self.image_size // self.patch_size) ** 2
        return patches + (1 if self.select_strategy == "full" else 0)


def build_vlm(out_dir: str | Path, spec: TinyVlmSpec = TinyVlmSpec()) -> Path:
    """Write a LlavaForConditionalGeneration checkpoint and a LlavaProcessor to `out_dir`."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers, num_attention_heads=4, image_size=spec.image_size,
        patch_size=spec.patch_size, projection_dim=spec.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=2 * spec.text_hidden,
        num_hidden_layers=spec.text_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=3,
        tie_word_embeddings=False, rope_theta=10000.0,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id,
        vision_feature_layer=spec.feature_layer, vision_feature_select_strategy=spec.select_strategy,
        image_seq_length=spec.image_tokens, tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, spec.init_std)
    model.generation_config.bos_token_id = 0
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 3
    model.save_pretrained(str(out), safe_serialization=True)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=spec.patch_size,
        vision_feature_select_strategy=spec.select_strategy, image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    return out
