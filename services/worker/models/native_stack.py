"""The decoder's layer stack in one kernel call for few-row steps (kernels/csrc/decoder_stack.cpp).

At decode sizes a layer's kernels are short and the Python around them (module calls, splits,
views, argument checks, ~4 us of dispatch an op) costs about as much. `torch.ops.spindle.
decoder_stack` runs every layer and the final norm in C++ through the same kernels in the same
order, so its output is bit for bit the fused Python path's; the step's Python keeps only the
embedding lookup, the LM head and sampling. Measured on a 2-core AMD EPYC (Zen 3), small
benchmark model (4 layers, hidden 256), one stream, Python loop -> this, interleaved runs:

  in process, ms a decode step (`ToyScheduler` rounds of 8)    2 threads 1.9-2.4 -> 1.0-1.2
                                                               1 thread  1.8-2.4 -> 1.3-1.6
  served (`spindle serve`, 24 requests of 128 + 128 tokens),   worker step 3.9-4.0 -> 2.8-3.0 ms
  one stream, output tokens/s                                  239-242 -> 317-340

The forward pass alone, one row, median of 21 interleaved samples (`python -m
benchmarks.fused_ops_bench --model small --rows 1`, and without `--model` for the medium
model): small 1,587 -> 689 us, medium (8 layers, hidden 1024, 400 MB of weights a step)
12.2 -> 9.7 ms. Served, the medium model's one stream gained 3-13 % in two interleaved pairs.

It runs where that path would call exactly those kernels: fused kernels on (models/fused.py),
the `paged` backend's rotary attention, pre-norm layers without per-head q/k norms (Llama,
Mistral, Qwen2, Phi-3; not Gemma 2's sandwich norms or Qwen3's q/k norms), and rows
few enough that every linear layer of the stack runs the small-M kernel (`kernel_max_rows`,
set by the calibration at load). Everything else (prefill chunks, big batches, other devices)
takes the Python path. `SPINDLE_DISABLE_NATIVE_STACK=1` keeps the Python path for side-by-side
runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from services.worker.attention.paged import PagedMetadata
from services.worker.models.config import DecoderConfig
from services.worker.models.fast_linear import FastLinear, round_max_rows
from shared.switches import switch_on

logger = logging.getLogger(__name__)

DISABLE_ENV = "SPINDLE_DISABLE_NATIVE_STACK"  # 1: the Python layer loop at every size
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class NativeStack:
    """The stack's parameters in the order the kernel takes them, gathered once at load."""

    weights: list[torch.Tensor]  # per layer: input norm, qkv, o, post-attention norm, gate_up, down; final norm
    biases: list[torch.Tensor | None]  # per layer: qkv, o, gate_up, down
    windows: list[int]  # per layer: sliding window, 0 for none
    eps: float
    unit_offset: bool
    activation: int
    num_heads: int
    scale: float
    softcap: float
    max_rows: int  # the most rows every linear layer runs through the small-M kernel

    def covers(self, rows: int, kv_caches: Sequence[torch.Tensor] | None, meta: object) -> bool:
        """Whether a pass of `rows` tokens over these caches and metadata is one the stack takes."""
        return 0 < rows <= self.max_rows and kv_caches is not None and isinstance(meta, PagedMetadata)

    def accepts(self, hidden: torch.Tensor, kv_caches: Sequence[torch.Tensor] | None, meta: object) -> bool:
        """Whether this forward pass can run here (else the caller takes the Python path)."""
        return (
            self.covers(hidden.shape[0], kv_caches, meta)
            and hidden.dtype == self.weights[0].dtype  # the model's activations (its norms' dtype)
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        meta: PagedMetadata,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states (after the last norm), as the Python layer loop computes them."""
        common = meta.common
        return torch.ops.spindle.decoder_stack(
            hidden, self.weights, self.biases, kv_caches, self.windows, self.eps, self.unit_offset,
            self.activation, self.num_heads, self.scale, self.softcap, common.slot_mapping,
            common.block_tables, common.seq_lens, common.query_start_loc, meta.work_items,
            positions.contiguous(), cos, sin,
        )


@contextmanager
def work_pool_scope() -> Iterator[None]:
    """The kernels called inside (on this thread) split their work on spindle's claim-and-finish
    pool instead of torch's OpenMP threads (kernels/csrc/work_pool.h): a thread that loses its
    core to the host services leaves its share to the others instead of holding every op at a
    barrier. Inside, torch's own ops run on this thread alone (OpenMP's thread count is 1 until
    the scope closes): OpenMP's threads spin after each region on the cores the pool's helpers
    need, and with them on, a 64-stream round's pooled kernels ran at one thread's speed. So only
    for spans whose heavy ops are all spindle's kernels (a round on the native stack)."""
    torch.ops.spindle.work_pool_enter()
    try:
        yield
    finally:
        torch.ops.spindle.work_pool_exit()


def fits_pool(model: nn.Module, num_scheduled: np.ndarray) -> bool:
    """Whether a step computing `num_scheduled` tokens per row runs on spindle's kernels alone:
    its tokens (decode rows and prefill chunks) few enough for every layer's kernel (the native
    stack) and its rows for the LM head's (greedy choice is a kernel too). Prefill chunks are in
    (kernels/csrc/linear_mid_m.h made the kernel fit tens to hundreds of rows). A round whose
    step 0 fits runs in a `work_pool_scope` (model_runner.py): one left to OpenMP leaves its
    threads spinning on the helpers' cores for the pooled rounds after it (kOpenMpSpin in
    work_pool.cpp)."""
    stack: NativeStack | None = getattr(model, "native_stack", None)
    lm_head = getattr(model, "lm_head", None)
    if stack is None or not isinstance(lm_head, FastLinear):
        return False
    tokens, rows = int(num_scheduled.sum()), len(num_scheduled)
    return 0 < tokens <= stack.max_rows and rows <= lm_head.kernel_max_rows


def build_native_stack(config: DecoderConfig, layers: nn.ModuleList, final_norm: nn.Module,
                       lm_head: nn.Module | None = None) -> NativeStack | None:
    """The native stack for these layers, or None (logged) where it would not compute what they do.

    It takes rows up to where every layer's kernel beat the GEMM or, further, up to where the
    kernel's time summed over the layers and the LM head stays within the GEMM's plus an
    allowance a row (fast_linear.round_max_rows: a round on the stack runs on spindle's pool, out
    of OpenMP's barriers); the LM head then runs the kernel as far, so that such a round stays on
    the pool."""
    linears = [m for m in layers.modules() if isinstance(m, FastLinear)]
    reason = _unsupported(config, layers, linears)
    if reason is not None:
        logger.info("decoder layers run from Python at every size: %s", reason)
        return None
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    windows: list[int] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.o_proj.weight,
                    layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
        biases += [attn.qkv_proj.bias, attn.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias]
        windows.append(attn.spec.sliding_window or 0)
    weights.append(final_norm.weight)
    spec = layers[0].self_attn.spec
    heads = [lm_head] if isinstance(lm_head, FastLinear) else []
    round_rows = round_max_rows(linears + heads)
    max_rows = max(min(m.kernel_max_rows for m in linears), round_rows)
    for head in heads:
        head.kernel_max_rows = max(head.kernel_max_rows, round_rows)
    logger.info("decoder layers run in one native call up to %d rows", max_rows)
    return NativeStack(
        weights=[w.detach() for w in weights],
        biases=[None if b is None else b.detach() for b in biases],
        windows=windows,
        eps=config.rms_norm_eps,
        unit_offset=config.norm_unit_offset,
        activation=layers[0].mlp.act_code,
        num_heads=spec.num_heads,
        scale=spec.scale,
        softcap=spec.logit_softcap or 0.0,
        max_rows=max_rows,
    )


def _unsupported(config: DecoderConfig, layers: nn.ModuleList, linears: list[FastLinear]) -> str | None:
    """Why the native stack cannot stand in for `layers`; None when it can."""
    if switch_on(DISABLE_ENV):
        return f"disabled by {DISABLE_ENV}"
    if config.sandwich_norms or config.qk_norm:
        return "sandwich norms or per-head q/k norms"
    specs = {(layer.self_attn.spec.scale, layer.self_attn.spec.logit_softcap) for layer in layers}
    if len(specs) != 1:
        return "layers with different attention scales or soft-caps"
    for layer in layers:
        if not (layer.self_attn.fused_rotary and layer.input_layernorm.fused and layer.mlp.fused):
            return "the fused kernels are off or the attention backend does not fuse rotary"
    if any(m.weight.dtype not in _WEIGHT_DTYPES or m.weight.device.type != "cpu" for m in linears):
        return "linear weights not float32 / bfloat16 on the CPU"
    if min(m.kernel_max_rows for m in linears) == 0:
        return "some linear layer never runs the small-M kernel (calibration)"
    return None
