"""The correctness oracle: Hugging Face transformers greedy generation on the same weights."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def _load(model_dir: str):  # noqa: ANN202 - returns an HF model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def greedy_tokens(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate(do_sample=False)`: the new token ids, stopping at EOS like spindle."""
    model = _load(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=3,
        )
    return out[0, len(prompt_ids):].tolist()
