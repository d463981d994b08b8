"""Whether the decoder's CPU step uses spindle's fused kernels (kernels/csrc/fused_ops.cpp).

Three fusions, each replacing a chain of small torch ops whose per-op dispatch, not arithmetic,
is their cost at decode sizes:

- residual add + RMSNorm (`rms_norm`, `add_rms_norm`): every layer's two norms and the final
  one, each absorbing the residual add before it;
- act(gate) * up over the fused gate_up output (`act_and_mul`: SiLU, or Gemma's tanh GELU);
- the rotary embedding inside the paged attention kernel (`forward_rotary`), applied to the
  queries as it loads them and to the keys as it writes them to the KV cache.

The sampler's argmax kernel (kernels/csrc/argmax.cpp) follows the same switch, and so do the
encoders (bert.py): their attention kernel, and their post-norm residual add + LayerNorm
(`add_layer_norm`, which also writes the bf16 copy the next GEMM reads under bf16 GEMM inputs)
where the residual stream is float32 (a `--dtype bfloat16` encoder keeps torch's ops for it).

Measured side by side (`python -m benchmarks.fused_ops_bench`, medium model shapes: hidden 1024,
intermediate 2816, 16 / 4 heads of 64, 192-token contexts, 2-core AMD EPYC Zen 1, shared with
other work; torch -> fused, us per call):

| rows | add + RMSNorm | SiLU(gate) * up | rotary + KV write + paged attention | forward pass, 8 layers |
| --- | --- | --- | --- | --- |
| 1 | 53.5 -> 13.5 | 24.6 -> 12.5 | 212 -> 62 (torch's rotary alone: 132) | 26.9 -> 22.4 ms |
| 16 | 78.6 -> 25.9 | 82.0 -> 61.3 | 1410 -> 956 (182) | 75.8 -> 70.3 ms |
| 64 | 109 -> 38.2 | 264 -> 227 | 7354 -> 7009 (306) | 257 -> 251 ms |

Each pays at every size, rotary the most: its ~12 small torch ops per layer cost more than the
attention itself for one row, while in the kernel it is a few multiplies per value that is
loaded or stored anyway.
SiLU * mul gains least at 64 rows, where SLEEF's exp (kept for torch's rounding) dominates.

End to end, off vs on in one run (`python -m benchmarks.run --models medium --concurrency
1,16,64 --input-len 128 --output-len 64 --configs spindle --scheduler-steps 8
--spindle-env-variant unfused:SPINDLE_DISABLE_FUSED_KERNELS=1 --spindle-env-variant fused`),
output tokens/s: 25.5 -> 29.7 at 1 stream (ITL p50 32.7 -> 27.7 ms), 80.6 -> 89.2 at 16
(94.5 -> 82.4 ms), 93.3 -> 97.9 at 64 (259 -> 246 ms): +16 %, +11 %, +5 %.

The decoder's run for float32 activations on the CPU (weights may be bf16: activations stay float32)
and for bfloat16 ones (`--dtype bfloat16`: widened, computed in fp32 and rounded to bf16 at
each point where torch's separate bf16 ops round), wherever the kernels build and load;
`SPINDLE_DISABLE_FUSED_KERNELS=1` keeps torch's ops for side-by-side benchmarks. RoPE and SiLU
round exactly as torch does; the RMSNorm's mean of squares is summed in another order (last-bit
differences), as the linear kernel's sums are.
"""

from __future__ import annotations

import logging

import torch

from shared.switches import switch_on

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activations the fused kernels take
DISABLE_ENV = "SPINDLE_DISABLE_FUSED_KERNELS"  # 1: torch's unfused ops (for side-by-side benchmarks)
# models' hidden_act -> act_and_mul's activation code
ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}


def fused_kernels_error(device: torch.device) -> str | None:
    """None when the fused kernels can run on `device` in this process, else why not."""
    if device.type != "cpu":
        return f"the fused kernels run on the CPU, not {device.type}"
    if switch_on(DISABLE_ENV):
        return f"disabled by {DISABLE_ENV}"
    from services.worker.kernels.build import kernels_error

    return kernels_error()


def fused_kernels_enabled(device: torch.device) -> bool:
    """Whether a model on `device` should use the fused kernels; logs why not where it should not."""
    error = fused_kernels_error(device)
    if error is not None and device.type == "cpu":
        logger.info("the model keeps torch's unfused ops (norms, activations, rotary, attention): %s", error)
    return error is None
