"""The encoder budget of a vision-language model, derived from model and scheduler configuration.

Two numbers, both in encoder (feature) tokens: how much the worker may encode in one round
(compute) and how much encoder output it may hold at once (cache space). Derived as vLLM
PR 11895 derives them (seed 003):

* an item larger than a step's token budget is chunked over several steps, so its output
  must live across steps: room for 1 item;
* otherwise a step can cover cdiv(max_num_batched_tokens, tokens per item) items;
* never more than max_num_seqs * items per prompt (all running requests' items at once);
* plus ONE extra item, for two requests that share a prefix ending inside an image: the
  second recomputes the last block (the last prompt token is always computed), so it needs
  that image's output again while the first request's images still occupy the budget.

spindle's cache is keyed by content, so the extra item is rarely used for identical
requests (they share the output); it also covers a differing image at the same place and
keeps the derivation identical to the reference, which the regression test pins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.execute import MultiModalItem


@dataclass(slots=True, frozen=True)
class EncoderBudget:
    """Per-round encoder compute and cache space, in feature tokens, for one worker."""

    tokens_per_item: int
    compute_tokens: int
    cache_tokens: int

    @property
    def max_items_cached(self) -> int:
        return self.cache_tokens // self.tokens_per_item


def derive_encoder_budget(
    tokens_per_item: int, max_num_batched_tokens: int, max_num_seqs: int, max_items_per_prompt: int
) -> EncoderBudget:
    """The budget for items of at most `tokens_per_item` feature tokens (see the module docstring)."""
    if tokens_per_item < 1:
        raise ValueError(f"{tokens_per_item=} must be >= 1 for a model that takes images")
    if max_items_per_prompt < 1:
        raise ValueError(f"limit_mm_per_prompt={max_items_per_prompt} must be >= 1")
    fits_a_step = tokens_per_item <= max_num_batched_tokens
    num_items = -(-max_num_batched_tokens // tokens_per_item) if fits_a_step else 1
    num_items = min(num_items, max_num_seqs * max_items_per_prompt)
    num_items += 1  # the shared-prefix recompute case (module docstring)
    budget = num_items * tokens_per_item
    return EncoderBudget(tokens_per_item, compute_tokens=budget, cache_tokens=budget)


def check_worker_capacity(budget: EncoderBudget, worker_capacity_tokens: int, address: str) -> None:
    """Fail at start-up when a worker cannot hold what the scheduler may ask it to cache."""
    if worker_capacity_tokens < budget.cache_tokens:
        raise ValueError(
            f"worker {address} holds {worker_capacity_tokens} encoder tokens, but the scheduler's encoder "
            f"cache budget is {budget.cache_tokens} ({budget.max_items_cached} images of "
            f"{budget.tokens_per_item} tokens); raise the worker's --encoder-cache-bytes or lower "
            f"--max-num-batched-tokens / --limit-mm-per-prompt"
        )


def mm_items_error(
    items: Sequence[MultiModalItem], num_prompt_tokens: int, budget: EncoderBudget | None, limit: int
) -> str | None:
    """Why a request's images can never be served (None: they can), checked before it queues.

    Each image is encoded whole in one round and must fit both budgets; placeholder ranges
    must lie inside the prompt, in order, without overlapping.
    """
    if not items:
        return None
    if budget is None:
        return "the model takes no images"
    if len(items) > limit:
        return f"the request has {len(items)} images; at most {limit} per prompt (--limit-mm-per-prompt)"
    previous_end = 0
    for i, item in enumerate(items):
        if item.length < 1 or item.offset < previous_end or item.end > num_prompt_tokens:
            return (f"image {i}: placeholder range [{item.offset}, {item.end}) is empty, overlaps the previous "
                    f"image or leaves the prompt of {num_prompt_tokens} tokens")
        if item.length > min(budget.compute_tokens, budget.cache_tokens):
            return (f"image {i} needs {item.length} encoder tokens; the encoder budget is "
                    f"{min(budget.compute_tokens, budget.cache_tokens)}")
        previous_end = item.end
    return None
