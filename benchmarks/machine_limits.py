"""Measure what this machine allows, in the same run as the servers: peak fp32 GEMM and memory reads.

The CPU changes between sessions (issue 14), so the limits spindle is judged against are measured
each run, never taken from a note: torch's fp32 matmul on big square matrices with every core
(best of several, since the machine is shared), and the read bandwidth of summing a tensor far
larger than any cache. Both are what a well-tuned library reaches; benchmarks/roofline.py turns
them into fractions.

    python -m benchmarks.machine_limits
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from benchmarks.limit import machine_cores
from benchmarks.roofline import MachineLimits


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first-touch pages, thread pool start, MKL/oneDNN kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_gemm_flops(size: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of `size` x `size` matmuls (2 n^3 FLOPs each), the best of `repeats`."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    out = torch.empty(size, size)
    seconds = _best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2.0 * size**3 / seconds


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
            return MachineLimits(gemm_flops=peak_gemm_flops(), read_bandwidth=read_bandwidth())
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    limits = measure()
    sys.stdout.write(f"peak fp32 GEMM: {limits.gemm_flops / 1e9:.1f} GFLOP/s, "
                     f"memory reads: {limits.read_bandwidth / 1e9:.1f} GB/s ({machine_cores()} threads)\n")


if __name__ == "__main__":
    main()
