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

The LM head (float32 or bfloat16, under float32 or bfloat16 activations) also gets an int8
screen (kernels/csrc/head_screen.cpp): a step of up to 4 rows reads 1 byte a weight of the head,
and the exact logits of only the rows the screen's error bound leaves in the running, so its
tokens are the full head's at one row. It costs a byte a weight of memory and some work
around the head, so it is built only where the bytes it saves a step (the head's less the
screen's) are at least `SCREEN_MIN_SAVED_SHARE` of the weights a step reads: the small
benchmark model saves 31 % (float32) or 21 % (bfloat16), the medium 6.4 % or 4.3 %, a 7B model
with a 32k vocabulary 1-1.5 %. Served on a 2-core Zen 4, one stream, against the screen off
(`benchmarks.paired`): small float32 -16.9 %, small bfloat16 -0.3 to -3.7 %, medium float32
-0.5 % (CI -4.0..+3.2 %), medium bfloat16 +3.0 to +3.7 % in two runs (slower), so the last is not
screened. `SPINDLE_DISABLE_HEAD_SCREEN=1` reads the full head (side-by-side runs).
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
DISABLE_SCREEN_ENV = "SPINDLE_DISABLE_HEAD_SCREEN"
SCREEN_MIN_SAVED_SHARE = 0.05


@dataclass(slots=True)
class GreedyStep:
    """The model's parameters as the kernel takes them, and which steps it covers."""

    plan: torch.ScriptObject  # torch.classes.spindle.DecoderPlan
    stack: NativeStack
    lm_head: FastLinear
    screen: torch.Tensor | None = None  # the head's int8 screen, which the plan shares (head_screen)

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
    head = lm_head.weight.detach()
    bias = None if lm_head.bias is None else lm_head.bias.detach()
    screen = head_screen(head, bias, stack)
    plan = torch.classes.spindle.DecoderPlan(
        stack.weights, stack.biases, stack.windows, stack.eps, stack.unit_offset, stack.activation,
        stack.num_heads, stack.scale, stack.softcap, *rotary, embedding.weight.detach(),
        embed_scale, head, bias, *screen,
    )
    return GreedyStep(plan, stack, lm_head, screen[0])


Screen = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, float, float]


def head_screen(head: torch.Tensor, bias: torch.Tensor | None, stack: NativeStack) -> Screen:
    """(the head in int8, its rows' scales, bounds on its rows' rounding errors |w_r - q_r s_r|_2,
    its largest |w|, its largest row sum of |w|) for kernels/csrc/head_screen.cpp, or (None,
    None, None, 0, 0) (logged) where the head is not screened.

    The kernel takes float32 activations with a float32 or bfloat16 head and a float32 bias or
    none, or bfloat16 activations with a bfloat16 head and no bias (the stack's first weight, a
    norm, is in the activations' dtype), so a plan holds a screen only where every step it
    screens has them."""
    activations = stack.weights[0].dtype
    head_bytes = head.numel() * head.element_size()
    saved = (head_bytes - head.numel()) / (head_bytes + sum(w.numel() * w.element_size() for w in stack.weights))
    reason = None
    if switch_on(DISABLE_SCREEN_ENV):
        reason = f"disabled by {DISABLE_SCREEN_ENV}"
    elif head.dtype not in (torch.float32, torch.bfloat16) or not head.is_contiguous():
        layout = "" if head.is_contiguous() else ", strided"
        reason = f"the head is {head.dtype}{layout}, not contiguous float32 or bfloat16"
    elif activations not in (torch.float32, torch.bfloat16):
        reason = f"the activations are {activations}, not float32 or bfloat16"
    elif activations == torch.bfloat16 and (head.dtype != torch.bfloat16 or bias is not None):
        reason = "bfloat16 activations with a float32 head or a bias"
    elif bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        reason = f"the head's bias is {bias.dtype}{'' if bias.is_contiguous() else ', strided'}, not contiguous float32"
    elif saved < SCREEN_MIN_SAVED_SHARE:
        reason = f"it would save {saved:.1%} of a step's weight bytes (< {SCREEN_MIN_SAVED_SHARE:.0%})"
    if reason is not None:
        logger.info("greedy steps read the whole LM head: %s", reason)
        return None, None, None, 0.0, 0.0
    magnitudes = head.float().abs()
    row_max = magnitudes.amax(dim=1)
    # An all-zero row keeps scale 1 (its int8 copy is zeros either way, and the bound uses max |w|).
    scales = torch.where(row_max > 0, row_max / 127, torch.ones_like(row_max)).contiguous()
    screen = torch.round(head.float() / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    # In float64 from the stored values (exact), then rounded up past float32's rounding.
    errors = (head.double() - screen.double() * scales.double()[:, None]).norm(dim=1).mul_(1 + 1e-6).float()
    logger.info("greedy steps of up to 4 rows screen the LM head in int8 (+%.1f MB; saves %.0f%% of a step's "
                "weight bytes)", screen.numel() / 1e6, 100 * saved)
    return screen, scales, errors, float(row_max.max()), float(magnitudes.sum(dim=1, dtype=torch.float64).max())
