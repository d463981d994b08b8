"""Measure what this machine allows, in the same run as the servers: peak GEMM and memory reads.

The CPU changes between sessions (issue 14), so the limits spindle is judged against are measured
each run, never taken from a note: fp32 matmuls on big square matrices with every core, the
better of torch's (MKL) and oneDNN's on a packed weight (best of several, since the machine is
shared: on an AMD Zen 5 MKL reached 206 GFLOP/s where oneDNN and spindle's served GEMMs went past
290, so MKL alone would have put spindle above 1.0 of "the limit"); where the CPU multiplies bf16
natively, the same for oneDNN's bf16 GEMM (4.5x fp32 there), the limit of the bf16 cells that
then compute in bf16; and the read bandwidth of summing a tensor far larger than any cache.
benchmarks/roofline.py turns them into fractions.

    python -m benchmarks.machine_limits
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from benchmarks.limit import machine_cores
from benchmarks.roofline import MachineLimits
from services.worker.kernels.build import cpu_has_native_bf16


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first-touch pages, thread pool start, MKL/oneDNN kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_gemm_flops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of `size` x `size` matmuls (2 n^3 FLOPs each) in `dtype`, the best of `repeats` and
    of torch's matmul (float32 only) and oneDNN's on a weight packed once."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    best = float("inf")
    if dtype == torch.float32:
        out = torch.empty(size, size)
        best = _best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        best = min(best, _best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
                                       repeats))
    return 2.0 * size**3 / best


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s read by summing an fp32 tensor of `num_bytes` (1 GiB: far past the last-level cache)."""
    x = torch.ones(num_bytes // 4)
    seconds = _best_seconds(lambda: x.sum(), repeats)
    return num_bytes / seconds


def measure(num_threads: int | None = None) -> MachineLimits:
    """Both limits with `num_threads` torch threads (default: every core this process may use)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads or machine_cores())
    try:
        with torch.inference_mode():
            bf16 = peak_gemm_flops(dtype=torch.bfloat16) if cpu_has_native_bf16() else None
            return MachineLimits(gemm_flops=peak_gemm_flops(), read_bandwidth=read_bandwidth(), bf16_gemm_flops=bf16)
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    limits = measure()
    bf16 = f", peak bf16 GEMM: {limits.bf16_gemm_flops / 1e9:.1f} GFLOP/s" if limits.bf16_gemm_flops else ""
    sys.stdout.write(f"peak fp32 GEMM: {limits.gemm_flops / 1e9:.1f} GFLOP/s, "
                     f"memory reads: {limits.read_bandwidth / 1e9:.1f} GB/s{bf16} ({machine_cores()} threads)\n")


if __name__ == "__main__":
    main()
