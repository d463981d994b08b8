"""`FastLinear`: an `nn.Linear` that runs few-row inputs (decode steps) through spindle's kernel.

torch's CPU GEMM is fast for many rows but can be slow for a handful: with MKL on an AMD CPU
it measured 12.7 GB/s of weights for one row and 2.7 GB/s for eight, where the machine streams
21 GB/s. `torch.ops.spindle.linear_small_m` (kernels/csrc/linear_small_m.cpp) reads the weights
once for all rows. Which one is faster depends on the CPU, the BLAS and the shape, so nothing
is assumed: `calibrate` times both for each weight shape of the loaded model at a few row
counts and sets, per layer, the largest row count up to which the kernel won every probe
(0 where it never did, e.g. on a CPU where the BLAS is better). Same parameter names as
`nn.Linear`, so checkpoints load unchanged.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DISABLE_ENV = "SPINDLE_DISABLE_LINEAR_KERNEL"  # 1: torch's GEMM only (for side-by-side benchmarks)
_REPEATS = 3


class FastLinear(nn.Linear):
    """nn.Linear; inputs of at most `kernel_max_rows` rows use the small-M kernel."""

    kernel_max_rows: int = 0  # set per layer by `calibrate`; 0: always F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if 0 < rows <= self.kernel_max_rows and x.dtype == torch.float32:
            y = torch.ops.spindle.linear_small_m(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def _time(fn: object) -> float:
    fn()  # type: ignore[operator]
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def kernel_max_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The largest probe row count up to which the kernel beat F.linear at every probe."""
    best = 0
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=torch.float32)
        kernel = _time(lambda x=x: torch.ops.spindle.linear_small_m(x, weight, bias))
        blas = _time(lambda x=x: F.linear(x, weight, bias))
        if kernel >= blas:
            break
        best = rows
    return best


@torch.inference_mode()
def calibrate(model: nn.Module) -> dict[tuple[int, int], int]:
    """Set `kernel_max_rows` on every FastLinear of `model` (fp32 on CPU); returns it per (out, in) shape.

    Layers of one shape share one measurement. Without the kernels (not built, or disabled)
    everything stays on F.linear.
    """
    from services.worker.kernels.build import KernelBuildError, load_kernels

    layers = [m for m in model.modules() if isinstance(m, FastLinear)
              and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not layers or os.environ.get(DISABLE_ENV) == "1":
        return {}
    try:
        load_kernels()
    except KernelBuildError as exc:
        logger.info("linear layers use torch's GEMM only: %s", exc)
        return {}
    start = time.perf_counter()
    by_shape: dict[tuple[int, int], int] = {}
    for layer in layers:
        shape = (layer.out_features, layer.in_features)
        if shape not in by_shape:
            by_shape[shape] = kernel_max_rows(layer.weight, layer.bias)
        layer.kernel_max_rows = by_shape[shape]
    logger.info("linear kernel chosen by measurement (%.1f s): up to %s rows per (out, in) shape",
                time.perf_counter() - start, by_shape)
    return by_shape
