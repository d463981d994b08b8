"""Builds and loads spindle's C++ CPU kernels (`torch.ops.spindle.*`) on the machine that runs them.

Why build on the target: the kernels are plain loops left to gcc's vectoriser with
`-O3 -march=native`, which uses whatever the CPU has (AVX2/FMA, AVX-512, ...) with no
hand-written dispatch. A binary built that way may not run on another CPU (SIGILL), and the
host's CPU can change under the same disk (a VM moved to other hardware), so each build lives
in a cache folder keyed by the sources, the flags, the torch version and the CPU's feature
flags: a different CPU misses the cache and gets its own build, never a foreign binary.

`make install` builds once (`python -m services.worker.kernels.build`); a worker that finds no
build for its CPU compiles one at start-up (about a minute on 2 cores). The compiler runs in a
subprocess with a timeout under an exclusive file lock (released by the OS if the holder dies,
so a killed build never blocks the next), the library is renamed into place atomically, and
any failure is reported as a reason string: callers fall back to the pure-torch backends.

The extension links only libtorch (`TORCH_LIBRARY`, no pybind11), which keeps it independent
of the Python version and quick to compile; torch.utils.cpp_extension supplies the include and
library paths.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.switches import switch_on

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(_CSRC / name for name in (
    "paged_attention.cpp", "linear_small_m.cpp", "fused_ops.cpp", "argmax.cpp", "encoder_attention.cpp",
    "decoder_stack.cpp", "work_pool.cpp", "linear_mid_m.cpp"))
# Not compiled on their own, but part of a build's key.
HEADERS = (_CSRC / "fused_ops.h", _CSRC / "vec_math.h", _CSRC / "kernel_ops.h", _CSRC / "work_pool.h",
           _CSRC / "linear_mid_m.h", _CSRC / "env_flag.h", _CSRC / "linear_out.h", _CSRC / "prefill_lanes.h")
# 256-bit vectors even where -march=native's tuning prefers 128 (AMD Zen 1/2): the kernels keep
# 4 heads x 16 fp32 accumulators in registers, which 128-bit vectors spill (measured: -25 % time).
CXX_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-std=c++20", "-fPIC", "-shared",
             "-DNDEBUG")
BUILD_TIMEOUT_S = 600.0
CACHE_ENV = "SPINDLE_KERNEL_CACHE"  # folder of builds; default ~/.cache/spindle/kernels
DISABLE_ENV = "SPINDLE_DISABLE_KERNELS"  # set to 1: never build or load (tests of the fallback)


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded here; the message says why."""


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spindle" / "kernels"


def _cpu_features() -> str:
    """The CPU's instruction-set flags (what -march=native compiles for), as one sorted string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


# /proc/cpuinfo flags of bf16 dot products: x86 AVX512-BF16 or AMX, Arm's BF16 extension.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's bf16 GEMM ran at ~4.5x its fp32 one on
    an AVX512-BF16 AMD EPYC); without it a bf16 GEMM is emulated or crawls (~1 GFLOP/s on AVX2)."""
    return not NATIVE_BF16_FLAGS.isdisjoint(_cpu_features().split())


def build_key() -> str:
    """Names one build: sources, flags, torch version and CPU features."""
    digest = hashlib.sha256()
    sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    for part in (*sources, " ".join(CXX_FLAGS).encode(), torch.__version__.encode(), _cpu_features().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def library_path() -> Path:
    key = build_key()
    return cache_root() / key / f"spindle_kernels_{key}.so"


def _compile_command(output: Path) -> list[str]:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++) on PATH")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dirs = cpp_extension.library_paths()
    return [
        cxx,
        *CXX_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *[f"-I{p}" for p in cpp_extension.include_paths()],
        *[str(p) for p in SOURCES],
        *[f"-L{p}" for p in lib_dirs],
        *[f"-Wl,-rpath,{p}" for p in lib_dirs],
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def build(target: Path) -> None:
    """Compile into `target` (atomically: a reader never sees a half-written library)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = _compile_command(out)
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise KernelBuildError(f"compiler timed out after {BUILD_TIMEOUT_S:.0f} s") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise KernelBuildError(f"compiler exited {proc.returncode}: {' | '.join(tail)}")
        os.replace(out, target)
    logger.info("built %s in %.1f s", target, time.monotonic() - start)


def ensure_built() -> Path:
    """Path of this CPU's build, compiling it first when missing (one builder at a time)."""
    target = library_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if not target.is_file():
            logger.info("compiling CPU kernels for this CPU into %s", target.parent)
            build(target)
    return target


@functools.cache
def load_kernels() -> None:
    """Make `torch.ops.spindle.*` available in this process, building first if needed.

    Raises `KernelBuildError` (remembered: later calls raise the same without retrying).
    """
    if switch_on(DISABLE_ENV):
        raise KernelBuildError(f"disabled by {DISABLE_ENV}")
    try:
        path = ensure_built()
        torch.ops.load_library(str(path))
    except KernelBuildError:
        raise
    except Exception as exc:  # OSError from the loader, a read-only cache, a missing header ...
        raise KernelBuildError(f"{type(exc).__name__}: {exc}") from exc


def kernels_error() -> str | None:
    """None when the kernels are loaded, else why they cannot be."""
    try:
        load_kernels()
    except KernelBuildError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m services.worker.kernels.build`: build (or find) this CPU's kernels; used by `make install`.

    Exits 0 even when the build fails (the worker then falls back to the torch backends), unless
    --strict; prints one line either way.
    """
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else None)
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernels cannot be built")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    error = kernels_error()
    if error is None:
        print(f"spindle CPU kernels ready: {library_path()}")
        return 0
    print(f"spindle CPU kernels unavailable ({error}); workers will use the sdpa backend")
    return 1 if args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
