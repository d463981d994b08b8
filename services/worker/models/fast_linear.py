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

Past that prefix the kernel also runs the row counts where it won again (`kernel_row_table`):
the two trade places more than once. On a 2-core AMD EPYC Zen 4 (bf16, weights from memory)
oneDNN won at 8-16 rows and lost at 32-64 (the medium model's fused gate_up 5632 x 1024: 1,169
against 1,332 us at 32 rows, 2,083 against 2,282 at 64), so the prefix rule stopped at 4 rows
and a 64-stream decode step ran all its GEMMs on oneDNN. `SPINDLE_DISABLE_LINEAR_KERNEL_BANDS=1`
keeps the prefix alone (side-by-side runs).

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
from shared.switches import switch_on

logger = logging.getLogger(__name__)

PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel and the packed GEMM take
DISABLE_ENV = "SPINDLE_DISABLE_LINEAR_KERNEL"  # 1: no kernel, the GEMM at every row count (side-by-side runs)
DISABLE_BANDS_ENV = "SPINDLE_DISABLE_LINEAR_KERNEL_BANDS"  # 1: the kernel only up to kernel_max_rows
DISABLE_ONEDNN_ENV = "SPINDLE_DISABLE_ONEDNN_LINEAR"  # 1: past the kernel's rows, F.linear on the plain weight
ONEDNN_MAX_MEMORY_SHARE = 0.5  # packed copies may take at most this share of MemAvailable
# A round whose every layer runs the kernel goes on spindle's work pool (native_stack.fits_pool),
# out of OpenMP's barriers, which pays even where the kernel alone is a little slower: each
# parallel op no longer waits for a thread that lost its core to the host services, whose work
# grows with the tokens a round streams. So the native stack (and the LM head) take the kernel
# up to the most rows where the layers' summed kernel time exceeds the GEMM's by at most
# ROUND_ALLOWANCE_S per row (`round_max_rows`; summed, as single layers' probes are noisy on a
# host whose memory speed moves). Measured, 2-core AMD EPYC (Zen 5), 64 streams served: the
# small model on the kernel up to 256 rows gained +15-17 % (~27 us a token), the medium model
# on it up to 128 rows lost 2-6 % (its kernel ~19 us a row behind at 64 rows); 10 us kept the
# small model's 128 rows and the medium model's 32-64 (its calibrations vary). On a Zen 4
# (2026-11-29) 10 us left the small model at 8 rows (its kernel 15 us a row behind at 16 rows,
# 6-10 at 32-128): on the kernel up to 256 rows it ran 3,784 against 3,197 out tok/s on average
# over 8 interleaved pairs at 64 streams (6 won; ITL p50 ~12 against ~16 ms), one stream
# unchanged; the medium model stayed at 8 rows (220 us a row behind at 16), where forcing it
# to 256 lost 10 % (404 / 396 against 354 / 362). With bf16 k pairs (linear_mid_m.h) the
# bf16 small model needs 24 us (its kernel 23 us a row behind at 8 rows, ahead from 16 on): on
# the pool it ran 5,526 / 4,230 out tok/s against 4,295 / 3,466 without the pairs. So 30 us;
# the medium models stay at 8-16 rows here (190 us a row behind at 32). On the Zen 5 above, 30
# us may take the medium model's rounds onto the pool, which lost it 2-6 % there.
ROUND_ALLOWANCE_S = 30e-6
ROUND_ALLOWANCE_ENV = "SPINDLE_ROUND_ALLOWANCE_US"  # overrides it, in microseconds; 0: the kernel must win
_REPEATS = 3
_SPIKE = 1.25  # a probe this much slower than the next larger one is measured again (inflated_probes)
_RETRIES = 2  # at most this many second looks at such probes
_SAMPLE_S = 1e-3  # calls per timing sample: enough to fill this many seconds
# Probes cycle through copies of a weight as large in all as the model's linear weights, at most
# this much: past the caches when they are (a layer's weight is then evicted by the others'
# before it runs again), but not for a model that stays in the last-level cache, where the
# kernel's timings from memory (15-29 % behind oneDNN's at 64 rows) were not what its steps saw.
_COLD_BYTES = 64 << 20
_MAX_COPIES = 16
_WIDEN_SLICE_BYTES = 4 << 20  # float32 weights widened per BLAS call: bounded for large vocabularies
ProbeTimes = calibration_cache.Timings  # per PROBE_ROWS: best seconds of (kernel, GEMM)


class FastLinear(nn.Linear):
    """nn.Linear; inputs of at most `kernel_max_rows` rows, or of a row count `kernel_at` marks,
    use the small-M kernel."""

    kernel_max_rows: int = 0  # set per layer by `calibrate`: the kernel at every row count up to this
    kernel_at: bytes = b""  # set by `calibrate`: index = row count, 1 where the kernel runs (kernel_row_table)
    probe_s: ProbeTimes = ()  # per PROBE_ROWS: (kernel, GEMM) seconds, from `calibrate`
    onednn: OneDnnWeight | None = None  # set by `calibrate` where the GEMM runs on a oneDNN-packed copy

    def _kernel(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor | None:
        """The small-M kernel's y for `x` (`float_out`: as float32, see the op), or None where x
        has a row count calibration did not choose for the kernel or is not an activation dtype it takes."""
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not (self.runs_kernel(rows) and x.dtype in ACTIVATION_DTYPES):
            return None
        y = torch.ops.spindle.linear_small_m(x.reshape(rows, x.shape[-1]), self.weight, self.bias, float_out)
        return y.view(*x.shape[:-1], self.out_features)

    def runs_kernel(self, rows: int) -> bool:
        """Whether an input of `rows` rows goes through the small-M kernel (calibration's choice)."""
        return 0 < rows <= self.kernel_max_rows or (rows < len(self.kernel_at) and bool(self.kernel_at[rows]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._kernel(x)
        if y is not None:
            return y
        if self.onednn is not None:
            return self.onednn.linear(x, self.weight, self.bias)
        return blas_linear(x, self.weight, self.bias)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x).float()`: y rounded to x's dtype, as float32 (logits for the sampler). The
        kernel stores it so, without a second pass over y to widen it (at 64 rows of the
        small model's LM head, two 100-us copies a step)."""
        y = self._kernel(x, float_out=True)
        return y if y is not None else self(x).float()


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


def probe_times(weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = False,
                dtype: torch.dtype = torch.float32, working_set: int = _COLD_BYTES) -> ProbeTimes:
    """The kernel's and the GEMM's (oneDNN's where `onednn`) time at every probe row count, on
    `dtype` activations, cycling through copies of the weight `working_set` bytes in all."""
    weight_bytes = weight.numel() * weight.element_size()
    weights = [weight] + [weight.clone() for _ in range(min(_MAX_COPIES, -(-working_set // weight_bytes)) - 1)]
    packs = [OneDnnWeight() for _ in weights] if onednn else []

    def gemm(c: int, x: torch.Tensor) -> torch.Tensor:
        return packs[c].linear(x, weights[c], bias) if packs else blas_linear(x, weights[c], bias)

    def measure(rows: int) -> tuple[float, float]:
        x = torch.randn(rows, weight.shape[1], dtype=dtype)
        kernel, other = _best_times((lambda c: torch.ops.spindle.linear_small_m(x, weights[c], bias),
                                     lambda c: gemm(c, x)), len(weights))
        return kernel, other

    times = [measure(rows) for rows in PROBE_ROWS]
    for _ in range(_RETRIES):
        suspects = inflated_probes(times)
        if not suspects:
            break
        logger.debug("linear %s: probes at %s rows measured again (slower than more rows)",
                     tuple(weight.shape), [PROBE_ROWS[i] for i in suspects])
        for i in suspects:
            again = measure(PROBE_ROWS[i])
            times[i] = (min(times[i][0], again[0]), min(times[i][1], again[1]))
    return tuple(times)


def inflated_probes(times: list[tuple[float, float]]) -> list[int]:
    """Probes whose kernel or GEMM time exceeds the next larger probe's by over _SPIKE: with fewer
    rows the same code does less work, so such a time is more likely what shared the CPU at
    start-up than the code (a medium model's summed GEMM once took 45 ms at 8 rows and 21 at 16).
    Measured again and the best kept: noise only adds time. Where fewer rows really run slower
    (oneDNN at one row), the second look agrees and costs a few ms at start-up."""
    return [i for i in range(len(times) - 1)
            if any(times[i][c] > _SPIKE * times[i + 1][c] for c in (0, 1))]


def rows_within(times: ProbeTimes, allowance_s: float = 0.0) -> int:
    """The largest probe row count up to which the kernel took less than the GEMM's time plus
    `allowance_s` a row at every probe (0: not even at one row; no allowance: beat it)."""
    best = 0
    for rows, (kernel, other) in zip(PROBE_ROWS, times, strict=False):
        if kernel >= other + allowance_s * rows:
            break
        best = rows
    return best


def kernel_row_table(times: ProbeTimes) -> bytes:
    """Per row count from 0 to the last probe's, 1 where the kernel runs: at a probe's row count
    where it beat the GEMM there, and between two probes where it beat it at both (between
    probes both times grow in steps, not in a line: the kernel's tiles are 8 rows tall up to 11
    rows, or 27 on rows of 512+ values, and 16 rows wide from there (linear_small_m.cpp's
    kMidRows), so the 16 and 32 probes may time different tiles; a win at each end is the
    evidence for the counts between). Empty where the bands are switched off."""
    if switch_on(DISABLE_BANDS_ENV):
        return b""
    table = bytearray(PROBE_ROWS[-1] + 1)
    previous_rows, previous_won = 0, False
    for rows, (kernel, other) in zip(PROBE_ROWS, times, strict=False):
        won = kernel < other
        if won:
            start = previous_rows + 1 if previous_won else rows
            table[start:rows + 1] = b"\x01" * (rows + 1 - start)
        previous_rows, previous_won = rows, won
    return bytes(table)


def describe_rows(table: bytes) -> str:
    """`kernel_row_table`'s runs of row counts, as "1-4, 32-64" ("none" where there are none)."""
    runs, start = [], None
    for rows, on in enumerate([*table, 0]):
        if on and start is None:
            start = rows
        elif not on and start is not None:
            runs.append(f"{start}-{rows - 1}" if rows - 1 > start else str(start))
            start = None
    return ", ".join(runs) or "none"


def round_allowance_s() -> float:
    """ROUND_ALLOWANCE_S, or the operator's SPINDLE_ROUND_ALLOWANCE_US (a worker with a malformed
    value stops at start-up with an error that names the variable)."""
    value = os.environ.get(ROUND_ALLOWANCE_ENV, "").strip()
    if not value:
        return ROUND_ALLOWANCE_S
    try:
        allowance_us = float(value)
    except ValueError:
        allowance_us = -1.0
    if not allowance_us >= 0:  # also NaN
        raise ValueError(f"{ROUND_ALLOWANCE_ENV}={value!r} must be a number of microseconds >= 0")
    return allowance_us * 1e-6


def round_max_rows(layers: list[FastLinear]) -> int:
    """The largest probe row count up to which the layers' summed kernel time stays within their
    summed GEMM time plus ROUND_ALLOWANCE_S a row, at every probe; 0 where some layer was not timed."""
    if not layers or any(len(m.probe_s) != len(PROBE_ROWS) for m in layers):
        return 0
    allowance_s = round_allowance_s()
    summed = tuple((sum(m.probe_s[i][0] for m in layers), sum(m.probe_s[i][1] for m in layers))
                   for i in range(len(PROBE_ROWS)))
    return rows_within(summed, allowance_s)


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
    """Where this kernel build's calibration on this CPU is kept (kernels/build.py, calibration_dir)."""
    from services.worker.kernels.build import calibration_dir, load_kernels

    return calibration_dir(load_kernels()) / calibration_cache.FILE_NAME


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache level (sysfs; 0 where Linux does not say)."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            sizes[level] = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
        except (OSError, ValueError):
            continue
    return sizes[max(sizes)] if sizes else 0


def set_one_row_pairs(weight_bytes: int) -> bool:
    """One row of bf16 x with bf16 W takes k pairs (vdpbf16ps) only where the weights fit in half the
    last-level cache: there it is compute that limits, and the kernel does a quarter of the work;
    streamed from memory it measured slower (kernels/csrc/linear_small_m.cpp). Returns whether it is on."""
    cache_bytes = last_level_cache_bytes()
    on = bool(torch.ops.spindle.set_one_row_pairs(0 < weight_bytes <= cache_bytes // 2))
    logger.info("one-row bf16 linears %s (%.0f MB of weights, last-level cache %.0f MB)",
                "on k pairs" if on else "widened", weight_bytes / 2**20, cache_bytes / 2**20)
    return on


@torch.inference_mode()
def calibrate(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[tuple[int, int, str], int]:
    """Set `kernel_max_rows` (where the kernel wins every probe), `kernel_at` (every row count
    where it runs) and `probe_s` (the timings, for `round_max_rows`) on every CPU FastLinear of
    `model` for `dtype` activations (float32 or bfloat16); returns the prefix rows per (out, in,
    weight dtype).

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
    unique = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size() for m in layers}
    weight_bytes = sum(unique.values())
    if dtype == torch.bfloat16:
        set_one_row_pairs(weight_bytes)
    working_set = min(weight_bytes, _COLD_BYTES)
    measured: dict[str, ProbeTimes] = {}
    times_by_shape: dict[tuple[int, int, str], ProbeTimes] = {}
    shapes = []
    for layer in layers:
        shape = (layer.out_features, layer.in_features, str(layer.weight.dtype).removeprefix("torch."))
        shapes.append(shape)
        if shape not in times_by_shape:
            onednn = layer.onednn is not None
            key = calibration_cache.entry_key(*shape, layer.bias is not None, torch.get_num_threads(), onednn,
                                              str(dtype).removeprefix("torch."), working_set)
            times = stored.get(key)
            if times is None or len(times) != len(PROBE_ROWS):
                times = measured[key] = probe_times(layer.weight, layer.bias, onednn, dtype, working_set)
            times_by_shape[shape] = times
    calibration_cache.store(path, measured)
    by_shape = {shape: rows_within(times) for shape, times in times_by_shape.items()}
    tables = {shape: kernel_row_table(times) for shape, times in times_by_shape.items()}
    for layer, shape in zip(layers, shapes, strict=True):  # each shape's answer worked out once
        layer.probe_s, layer.kernel_max_rows, layer.kernel_at = times_by_shape[shape], by_shape[shape], tables[shape]
    bands = ({shape: describe_rows(table) for shape, table in tables.items()}
             if not switch_on(DISABLE_BANDS_ENV) else f"off ({DISABLE_BANDS_ENV}): the prefix alone")
    logger.info("linear kernel chosen by measurement (%.1f s; %d of %d shapes read from %s): at every row "
                "count up to %s per (out, in, weight dtype); rows on the kernel: %s", time.perf_counter() - start,
                len(by_shape) - len(measured), len(by_shape), path, by_shape, bands)
    return by_shape
