"""`FastLinear`: an `nn.Linear` that runs few-row inputs (decode steps) through spindle's kernel.

torch's CPU GEMM is fast for many rows but can be slow for a handful: with MKL on an AMD CPU
it measured 12.7 GB/s of weights for one row and 2.7 GB/s for eight, where the machine streams
21 GB/s. `torch.ops.spindle.linear_small_m` (kernels/csrc/linear_small_m.cpp) reads the weights
once for all rows. Which one is faster depends on the CPU, the BLAS and the shape, so nothing
is assumed: `calibrate` times both for each weight shape of the loaded model at a few row
counts and sets, per layer, the largest row count up to which the kernel won every probe
(0 where it never did, e.g. on a CPU where the BLAS is better), once per kernel build and
thread count: the answer is kept on disk (calibration_cache.py). Same parameter names as
`nn.Linear`, so checkpoints load unchanged.

Past the kernel's rows, float32 weights run through oneDNN on a copy packed once at load
(prepacked_linear.OneDnnWeight) rather than torch's `F.linear`: at the medium model's shapes
and 16-192 rows it measured 74-160 GFLOP/s against MKL's 42-128 and the kernel's 62-115 (2-core
AMD EPYC; `benchmarks.run --models medium --concurrency 64`: 181 -> 212-224 tok/s). The copy
doubles the linear weights' memory, so it is made only while they take at most half of the
memory available (`SPINDLE_DISABLE_ONEDNN_LINEAR=1`: never); the calibration then times the
kernel against it.

Weights may be stored in bfloat16 under float32 activations (`--weight-dtype bfloat16`,
`store_weights_as`): a single stream then reads half the bytes. The kernel widens bf16 in
registers; past its row count the GEMM runs on a float32 oneDNN copy (the same memory guard:
the copies take 4 bytes a parameter), else the BLAS gets float32 weights widened a slice at a
time, because a bf16 GEMM on a CPU without bf16 math ran at ~1 GFLOP/s (measured on AVX2).

With bfloat16 activations (`--dtype bfloat16`) the kernel widens x too and rounds y back, and the
GEMM runs on a bfloat16 oneDNN-packed copy, where oneDNN uses the CPU's native bf16 dot products;
the calibration times the two on bf16 inputs (its own cache entries).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models import calibration_cache
from services.worker.models.prepacked_linear import PACKABLE_DTYPES, OneDnnWeight

logger = logging.getLogger(__name__)

PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel and the packed GEMM take
DISABLE_ENV = "SPINDLE_DISABLE_LINEAR_KERNEL"  # 1: no kernel, the GEMM at every row count (side-by-side runs)
DISABLE_ONEDNN_ENV = "SPINDLE_DISABLE_ONEDNN_LINEAR"  # 1: past the kernel's rows, F.linear on the plain weight
ONEDNN_MAX_MEMORY_SHARE = 0.5  # packed copies may take at most this share of MemAvailable
# The kernel is kept while it takes at most this multiple of the GEMM's time (TOLERANCE_ENV
# overrides it). A round whose every layer runs the kernel goes on spindle's work pool
# (native_stack.round_scope): with every layer forced onto it, 64 streams of the small model
# served +13-17 % output (2-core AMD EPYC, Zen 5), though its layers alone ran 15-29 % slower
# than oneDNN's from memory. But 1.3 let the calibration's noisy probes (this machine's memory
# speed moves 2x within minutes) keep the kernel for some layers of a step and not others: the
# pool never opened at 64 streams, and 128-token prefills ran the slower kernel on OpenMP (one
# stream: -7 %, first token +2.3 ms). So the kernel must win, until the calibration times whole
# rounds rather than layers.
KERNEL_TOLERANCE = 1.0
TOLERANCE_ENV = "SPINDLE_LINEAR_KERNEL_TOLERANCE"
_REPEATS = 3
_SAMPLE_S = 1e-3  # calls per timing sample: enough to fill this many seconds
_COLD_BYTES = 64 << 20  # probes cycle through copies of a weight this large in all: past the caches
_MAX_COPIES = 16
_WIDEN_SLICE_BYTES = 4 << 20  # float32 weights widened per BLAS call: bounded for large vocabularies


class FastLinear(nn.Linear):
    """nn.Linear; inputs of at most `kernel_max_rows` rows use the small-M kernel."""

    kernel_max_rows: int = 0  # set per layer by `calibrate`; 0: always the GEMM
    onednn: OneDnnWeight | None = None  # set by `calibrate` where the GEMM runs on a oneDNN-packed copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if 0 < rows <= self.kernel_max_rows and x.dtype in ACTIVATION_DTYPES:
            y = torch.ops.spindle.linear_small_m(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.onednn is not None:
            return self.onednn.linear(x, self.weight, self.bias)
        return blas_linear(x, self.weight, self.bias)


def blas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear; weights stored narrower than `x` are widened a slice of output features at a time."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    step = max(1, _WIDEN_SLICE_BYTES // (weight.shape[1] * x.element_size()))
    if step >= weight.shape[0]:
        return F.linear(x, weight.to(x.dtype), bias)
    y = x.new_empty(*x.shape[:-1], weight.shape[0])
    for start in range(0, weight.shape[0], step):
        part = slice(start, start + step)
        y[..., part] = F.linear(x, weight[part].to(x.dtype), None if bias is None else bias[part])
    return y


def store_weights_as(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every FastLinear weight of `model` in `dtype` (biases and activations keep theirs).

    A weight shared with an embedding (tied LM head) is copied rather than converted, so the
    embedding keeps the activations' dtype. Returns the bytes the converted weights now take.
    """
    total = 0
    for layer in (m for m in model.modules() if isinstance(m, FastLinear)):
        if layer.weight.dtype != dtype:
            layer.weight = nn.Parameter(layer.weight.detach().to(dtype), requires_grad=False)
        total += layer.weight.numel() * layer.weight.element_size()
    return total


def _best_times(fns: tuple[Callable[[int], object], ...], copies: int) -> list[float]:
    """Each function's best seconds per call over `_REPEATS` rounds that alternate between them.

    `fns[i](c)` runs on weight copy `c`; calls cycle through the copies so that each one reads
    its weight from memory, as decode does (a layer's weight is evicted by the other layers'
    before it runs again), not from a cache a repeated call would warm. Alternating, and
    timing enough calls per sample to fill `_SAMPLE_S`, makes the comparison survive what
    shares the CPU at start-up (the frontend loading its tokenizer on the same 2 cores once
    turned every single-call probe into "BLAS wins" and left decode on the BLAS).
    """
    best = [float("inf")] * len(fns)
    turn = 0
    for _ in range(_REPEATS):
        for i, fn in enumerate(fns):
            calls, start = 0, time.perf_counter()
            while calls < copies and (calls == 0 or time.perf_counter() - start < _SAMPLE_S):
                fn(turn % copies)
                calls, turn = calls + 1, turn + 1
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return best


def kernel_tolerance() -> float:
    """How much slower than the GEMM the kernel may be and still be chosen (KERNEL_TOLERANCE)."""
    return float(os.environ.get(TOLERANCE_ENV) or KERNEL_TOLERANCE)


def kernel_max_rows(weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = False,
                    dtype: torch.dtype = torch.float32) -> int:
    """The largest probe row count up to which the kernel beat the GEMM (oneDNN's where `onednn`),
    or came within `kernel_tolerance`, at every probe, on `dtype` activations."""
    weight_bytes = weight.numel() * weight.element_size()
    weights = [weight] + [weight.clone() for _ in range(min(_MAX_COPIES, -(-_COLD_BYTES // weight_bytes)) - 1)]
    packs = [OneDnnWeight() for _ in weights] if onednn else []

    def gemm(c: int, x: torch.Tensor) -> torch.Tensor:
        return packs[c].linear(x, weights[c], bias) if packs else blas_linear(x, weights[c], bias)

    best = 0
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=dtype)
        kernel, other = _best_times((lambda c, x=x: torch.ops.spindle.linear_small_m(x, weights[c], bias),
                                     lambda c, x=x: gemm(c, x)), len(weights))
        if kernel >= other * kernel_tolerance():
            break
        best = rows
    return best


def _available_memory() -> int | None:
    """MemAvailable in bytes (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def prepack(layers: list[FastLinear], dtype: torch.dtype = torch.float32) -> int:
    """Give the layers a oneDNN-packed copy for the GEMM on `dtype` activations (see the module
    docstring); returns bytes packed."""
    packable = [m for m in layers if m.weight.dtype in PACKABLE_DTYPES]
    copy_bytes = torch.finfo(dtype).bits // 8  # the copies are in the activations' dtype whatever the weight's
    total = sum(m.weight.numel() * copy_bytes for m in packable)
    if not packable or os.environ.get(DISABLE_ONEDNN_ENV) == "1" or not torch.backends.mkldnn.is_available():
        return 0
    available = _available_memory()
    if available is not None and total > ONEDNN_MAX_MEMORY_SHARE * available:
        logger.info("linear layers keep torch's GEMM: packed copies would take %.0f MB of %.0f MB available",
                    total / 2**20, available / 2**20)
        return 0
    packed = 0
    for layer in packable:
        onednn = OneDnnWeight()
        if onednn.get(layer.weight, layer.bias, dtype) is not None:
            layer.onednn = onednn
            packed += layer.weight.numel() * copy_bytes
    return packed


def calibration_path() -> Path:
    """Where this kernel build's calibration is kept (beside the build, keyed like it)."""
    from services.worker.kernels.build import library_path

    return library_path().parent / calibration_cache.FILE_NAME


@torch.inference_mode()
def calibrate(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[tuple[int, int, str], int]:
    """Set `kernel_max_rows` on every CPU FastLinear of `model` for `dtype` activations (float32 or
    bfloat16); returns it per (out, in, weight dtype).

    Layers of one shape share one measurement, and a shape measured before on this kernel
    build with this many threads is read back (calibration_cache.py). Without the kernels
    (not built, or disabled) everything stays on the GEMM (oneDNN's where `prepack` packed).
    """
    from services.worker.kernels.build import KernelBuildError, load_kernels

    layers = [m for m in model.modules() if isinstance(m, FastLinear)
              and m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32, torch.bfloat16)]
    if (packed := prepack(layers, dtype)):
        logger.info("linear GEMMs run on oneDNN-packed copies (%.0f MB)", packed / 2**20)
    if not layers or os.environ.get(DISABLE_ENV) == "1":
        return {}
    try:
        load_kernels()
    except KernelBuildError as exc:
        logger.info("linear layers use torch's GEMM only: %s", exc)
        return {}
    start = time.perf_counter()
    path = calibration_path()
    stored = calibration_cache.load(path)
    measured: dict[str, int] = {}
    by_shape: dict[tuple[int, int, str], int] = {}
    for layer in layers:
        shape = (layer.out_features, layer.in_features, str(layer.weight.dtype).removeprefix("torch."))
        if shape not in by_shape:
            onednn = layer.onednn is not None
            key = calibration_cache.entry_key(*shape, layer.bias is not None, torch.get_num_threads(), onednn,
                                              str(dtype).removeprefix("torch."), kernel_tolerance())
            rows = stored.get(key)
            if rows is None:
                rows = measured[key] = kernel_max_rows(layer.weight, layer.bias, onednn, dtype)
            by_shape[shape] = rows
        layer.kernel_max_rows = by_shape[shape]
    calibration_cache.store(path, measured)
    logger.info("linear kernel chosen by measurement (%.1f s; %d of %d shapes read from %s): up to %s rows "
                "per (out, in, weight dtype)", time.perf_counter() - start, len(by_shape) - len(measured),
                len(by_shape), path, by_shape)
    return by_shape
