"""The correctness oracle: Hugging Face transformers greedy generation on the same weights."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def _load(model_dir: str, dtype: torch.dtype = torch.float32):  # noqa: ANN202 - returns an HF model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    return model


def greedy_tokens(model_dir: Path, prompt_ids: list[int], max_new_tokens: int,
                  kv_cache_dtype: torch.dtype | None = None, dtype: torch.dtype = torch.float32) -> list[int]:
    """transformers `generate(do_sample=False)`: the new token ids, stopping at EOS like spindle.

    `kv_cache_dtype`: keys and values are rounded to it as they enter the cache (and every
    attention reads them rounded), as spindle's `--kv-cache-dtype` stores them; the arithmetic
    stays float32. `dtype`: the model's weights and arithmetic (spindle's `--dtype`).
    """
    model = _load(str(model_dir), dtype)
    cache = None if kv_cache_dtype is None else _rounding_cache(model.config, kv_cache_dtype)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=3,
            past_key_values=cache,
        )
    return out[0, len(prompt_ids):].tolist()


def _rounding_cache(config, dtype: torch.dtype):  # noqa: ANN001, ANN202 - transformers types
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return super().update(key_states.to(dtype).float(), value_states.to(dtype).float(), layer_idx,
                                  *args, **kwargs)

    return RoundingCache(config=config)


def next_token_logits(model_dir: Path, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits for the token after `ids` (one forward over all of them), as float32."""
    with torch.no_grad():
        return _load(str(model_dir), dtype)(torch.tensor([ids])).logits[0, -1].float()
