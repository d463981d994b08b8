"""Whether the decoder's CPU step uses spindle's fused kernels (kernels/csrc/fused_ops.cpp).

Three fusions, each replacing a chain of small torch ops whose per-op dispatch, not arithmetic,
is their cost at decode sizes:

- residual add + RMSNorm (`rms_norm`, `add_rms_norm`): every layer's two norms and the final
  one, each absorbing the residual add before it;
- act(gate) * up over the fused gate_up output (`act_and_mul`: SiLU, or Gemma's tanh GELU);
- the rotary embedding inside the paged attention kernel (`forward_rotary`), applied to the
  queries as it loads them and to the keys as it writes them to the KV cache.

They run for float32 activations on the CPU (weights may be bf16: activations stay float32),
wherever the kernels build and load; `SPINDLE_DISABLE_FUSED_KERNELS=1` keeps torch's ops for
side-by-side benchmarks. RoPE and SiLU round exactly as torch does; the RMSNorm's mean of
squares is summed in another order (last-bit differences), as the linear kernel's sums are.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "SPINDLE_DISABLE_FUSED_KERNELS"  # 1: torch's unfused ops (for side-by-side benchmarks)
# models' hidden_act -> act_and_mul's activation code
ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}


def fused_kernels_error(device: torch.device) -> str | None:
    """None when the fused kernels can run on `device` in this process, else why not."""
    if device.type != "cpu":
        return f"the fused kernels run on the CPU, not {device.type}"
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"disabled by {DISABLE_ENV}"
    from services.worker.kernels.build import kernels_error

    return kernels_error()
