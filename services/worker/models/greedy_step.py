"""A greedy decode step in one kernel call: token ids in, next token ids out (kernels/csrc/greedy_decode.cpp).

With the layer stack in one call (native_stack.py), a decode step of a small model still spent
much of its time in Python around it: the embedding lookup, picking the sampling rows' hidden
states, the LM head, the sampler and its argmax, a few microseconds of dispatch each, and the
stack's call converting its ~45 weights, biases and caches from Python objects every step.
`torch.ops.spindle.greedy_decode` runs the same kernels in the same order from a `DecoderPlan`
that holds the parameters (built once at load), so its tokens are the Python path's.

The runner takes it for a decode step whose every row decodes one token and samples it
greedily with nothing that reshapes the logits: no logprobs, logit_bias, penalties, min_tokens
or grammar (model_runner.py `_greedy_step`); the stack must cover the step and the LM head
run its small-M kernel at that many rows. Everything else keeps the Python path.
`SPINDLE_DISABLE_GREEDY_STEP=1` keeps it for side-by-side runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from services.worker.attention.paged import PagedMetadata
from services.worker.models.fast_linear import FastLinear
from services.worker.models.native_stack import NativeStack
from shared.switches import switch_on

logger = logging.getLogger(__name__)

DISABLE_ENV = "SPINDLE_DISABLE_GREEDY_STEP"


@dataclass(slots=True)
class GreedyStep:
    """The model's parameters as the kernel takes them, and which steps it covers."""

    plan: torch.ScriptObject  # torch.classes.spindle.DecoderPlan
    stack: NativeStack
    lm_head: FastLinear

    def accepts(self, input_ids: torch.Tensor, kv_caches: Sequence[torch.Tensor] | None, meta: object) -> bool:
        """The stack covers the step and the LM head runs its small-M kernel at that many rows
        (the dtypes were checked when the plan was built)."""
        rows = input_ids.shape[0]
        return self.stack.covers(rows, kv_caches, meta) and self.lm_head.runs_kernel(rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                 meta: PagedMetadata) -> torch.Tensor:
        """Each row's next token (int64), as embedding, stack, LM head and argmax compute it."""
        common = meta.common
        return torch.ops.spindle.greedy_decode(
            self.plan, input_ids, kv_caches, common.slot_mapping, common.block_tables, common.seq_lens,
            common.query_start_loc, meta.work_items, positions,
        )


def build_greedy_step(stack: NativeStack | None, embedding: nn.Embedding, embed_scale: torch.Tensor | None,
                      rotary: tuple[torch.Tensor, torch.Tensor], lm_head: nn.Module,
                      final_logit_softcap: float | None) -> GreedyStep | None:
    """The one-call greedy step over `stack`, or None (logged) where it would not compute what
    the Python path does; `rotary` is the (cos, sin) tables the stack's attention reads."""
    reason = None
    if switch_on(DISABLE_ENV):
        reason = f"disabled by {DISABLE_ENV}"
    elif stack is None:
        reason = "the layer stack runs from Python"
    elif not isinstance(lm_head, FastLinear):
        reason = "the LM head is not a small-M kernel layer"
    elif final_logit_softcap is not None:
        reason = "the logits are soft-capped"
    elif embedding.weight.dtype != stack.weights[0].dtype:
        reason = "the embedding's dtype is not the activations'"
    if reason is not None:
        logger.info("greedy decode steps sample from Python: %s", reason)
        return None
    assert stack is not None and isinstance(lm_head, FastLinear)
    plan = torch.classes.spindle.DecoderPlan(
        stack.weights, stack.biases, stack.windows, stack.eps, stack.unit_offset, stack.activation,
        stack.num_heads, stack.scale, stack.softcap, *rotary, embedding.weight.detach(),
        embed_scale, lm_head.weight.detach(), None if lm_head.bias is None else lm_head.bias.detach(),
    )
    return GreedyStep(plan, stack, lm_head)
