"""Builds and loads spindle's C++ CPU kernels (`torch.ops.spindle.*`) on the machine that runs them.

Why build on the target: the kernels are plain loops left to gcc's vectoriser with
`-O3 -march=native`, which uses whatever the CPU has (AVX2/FMA, AVX-512, ...) with no
hand-written dispatch. A binary built that way may not run on another CPU (SIGILL), and the
host's CPU can change under the same disk (a VM moved to other hardware), so each build lives
in a cache folder keyed by the sources, the flags, the torch version and the CPU's feature
flags: a different CPU misses the cache and gets its own build, never a foreign binary.

`make install` builds once (`python -m services.worker.kernels.build`); a worker that finds no
build for its CPU compiles one at start-up (about a minute on 2 cores). Where there is no
compiler (the container image), or where the native build fails and one is cached, it loads a
build for its CPU's family instead, made where the image was built or by `--targets`
(targets.py). The compiler runs in a subprocess with a timeout under an exclusive file lock
(released by the OS if the holder dies, so a killed build never blocks the next), the library is
renamed into place atomically, and any failure is reported as a reason string: callers fall
back to the pure-torch backends.

The extension links only libtorch (`TORCH_LIBRARY`, no pybind11), which keeps it independent
of the Python version and quick to compile; torch.utils.cpp_extension supplies the include and
library paths.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.worker.kernels.targets import (
    AUTO,
    FAMILY,
    NATIVE,
    TARGETS,
    KernelTarget,
    families_of,
    family_targets_for,
    requested_target,
    target_named,
)
from shared.switches import switch_on

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(_CSRC / name for name in (
    "paged_attention.cpp", "linear_small_m.cpp", "fused_ops.cpp", "argmax.cpp", "encoder_attention.cpp",
    "decoder_stack.cpp", "greedy_decode.cpp", "head_screen.cpp", "work_pool.cpp", "linear_mid_m.cpp",
    "build_info.cpp"))
# Not compiled on their own, but part of a build's key.
HEADERS = (_CSRC / "fused_ops.h", _CSRC / "vec_math.h", _CSRC / "kernel_ops.h", _CSRC / "work_pool.h",
           _CSRC / "linear_mid_m.h", _CSRC / "env_flag.h", _CSRC / "linear_out.h", _CSRC / "prefill_lanes.h",
           _CSRC / "decode_pairs.h")
OPTIMIZE = ("-O3",)
CXX_FLAGS = ("-fopenmp", "-std=c++20", "-fPIC", "-shared", "-DNDEBUG")
# x86 only (gcc for Arm has no such option: with it a native Arm build failed): 256-bit vectors
# even where -march=native's tuning prefers 128 (AMD Zen 1/2): the kernels keep 4 heads x 16 fp32
# accumulators in registers, which 128-bit vectors spill (measured: -25 % time).
X86_FLAGS = ("-mprefer-vector-width=256",)
BUILD_TIMEOUT_S = 600.0
FAILED_RECORD = "failed.json"  # beside a build whose compile failed: the compiler, the error, when
FAILED_RETRY_S = 24 * 3600.0  # a remembered failure is tried again after this long
CACHE_ENV = "SPINDLE_KERNEL_CACHE"  # folder of builds; default ~/.cache/spindle/kernels
DISABLE_ENV = "SPINDLE_DISABLE_KERNELS"  # set to 1: never build or load (tests of the fallback)


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded here; the message says why."""


def _user_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spindle" / "kernels"


def cache_root() -> Path:
    """The folder of builds: $SPINDLE_KERNEL_CACHE (the image's family builds), else the user's cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return _user_cache_root()


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
    return not NATIVE_BF16_FLAGS.isdisjoint(cpu_flags())


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags, as /proc/cpuinfo names them."""
    return frozenset(_cpu_features().split())


def compiler() -> str | None:
    """The C++ compiler to build with ($CXX, else g++ or c++ on PATH), or None where there is none."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def target_flags(target: KernelTarget) -> tuple[str, ...]:
    """gcc's code-generation flags for `target`: its instruction set, -O3, the x86 tuning on x86,
    CXX_FLAGS (in the order of the builds before Arm's, whose cache keys stay valid)."""
    return (*target.march_flags, *OPTIMIZE, *(X86_FLAGS if target.is_x86 else ()), *CXX_FLAGS)


def compile_flags(target: KernelTarget) -> list[str]:
    """Everything but the compiler, the sources and the linking: what compiling one source takes."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [*target_flags(target), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *[f"-I{p}" for p in cpp_extension.include_paths()]]


def build_key(target: KernelTarget) -> str:
    """Names one build: sources, flags (the target's among them), torch version and, for a native
    build, the CPU's features (a family build runs on any CPU of the family, so they stay out)."""
    digest = hashlib.sha256()
    sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    flags = " ".join(target_flags(target)).encode()
    cpu = _cpu_features().encode() if target.is_native else b""
    for part in (*sources, flags, torch.__version__.encode(), cpu):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def target_library(target: KernelTarget) -> Path:
    """Where `target`'s build lives in the cache."""
    key = build_key(target)
    return cache_root() / key / f"spindle_kernels_{key}.so"


def candidate_targets() -> list[KernelTarget]:
    """The builds this process may load ($SPINDLE_KERNEL_TARGET; targets.py says why there are
    several), in the order `load_kernels` tries them.

    A named target is the only candidate. auto: native where its build is cached or a compiler can
    make it, then the family builds in the cache that this CPU runs, best first (the container
    image ships them; elsewhere they stand in when the native build fails: a compiler too old for
    the flags, a broken toolchain). Raises `KernelBuildError` saying why none will do.
    """
    try:
        name = requested_target()
    except ValueError as exc:
        raise KernelBuildError(str(exc)) from exc
    flags = cpu_flags()
    if name != AUTO:
        target = target_named(name)
        if not target.is_native and not target.runs_on(flags):
            missing = " ".join(sorted(target.needs - flags)) or f"an {target.machine} CPU"
            raise KernelBuildError(f"this CPU cannot run kernels built for {name} (it lacks {missing})")
        return [target]
    runnable = family_targets_for(flags)
    cached = [target for target in runnable if target_library(target).is_file()]
    if target_library(NATIVE).is_file() or compiler() is not None:
        return [NATIVE, *cached]
    if cached:
        return cached
    names = ", ".join(t.name for t in runnable) or "none for this CPU"
    raise KernelBuildError(f"no C++ compiler to build this CPU's kernels, and no prebuilt build it can run "
                           f"({names}) in {cache_root()}")


def calibration_dir(target: KernelTarget) -> Path:
    """Where what was measured with `target`'s build on this CPU is kept (the linear kernels'
    calibration): beside a native build, whose key holds the CPU already; for a family build, which
    CPUs of the family share (read-only in the image), in the user's cache under the build and CPU."""
    if target.is_native:
        return target_library(target).parent
    cpu = hashlib.sha256(_cpu_features().encode()).hexdigest()[:12]
    return _user_cache_root() / "calibration" / f"{build_key(target)}-{cpu}"


def _compile_command(target: KernelTarget, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++) on PATH")
    lib_dirs = cpp_extension.library_paths()
    return [
        cxx,
        *compile_flags(target),
        *[str(p) for p in SOURCES],
        *[f"-L{p}" for p in lib_dirs],
        *[f"-Wl,-rpath,{p}" for p in lib_dirs],
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def build(kernel_target: KernelTarget, target: Path) -> None:
    """Compile `kernel_target`'s build into `target` (atomically: a reader never sees a half-written
    library). A compile that fails or times out is remembered beside it (`failed_build`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = _compile_command(kernel_target, out)
        start = time.monotonic()
        proc = _run_compiler(cmd, target)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            reason = f"compiler exited {proc.returncode}: {' | '.join(tail)}"
            if proc.returncode < 0:  # killed (out of memory, a signal): not the build's fault, not remembered
                raise KernelBuildError(reason)
            raise _remember_failure(target, reason)
        os.replace(out, target)
    failure_record(target).unlink(missing_ok=True)  # a retry that worked
    logger.info("built %s in %.1f s", target, time.monotonic() - start)


def _run_compiler(cmd: list[str], target: Path) -> subprocess.CompletedProcess[str]:
    """Run the compile; past BUILD_TIMEOUT_S kill it with its children (g++'s cc1plus outlives
    a killed driver) and remember the timeout."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise _remember_failure(target, f"compiler timed out after {BUILD_TIMEOUT_S:.0f} s") from exc
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def failure_record(target: Path) -> Path:
    """Where a failed compile of the build `target` is remembered (beside it, under its key)."""
    return target.parent / FAILED_RECORD


def _compiler_identity() -> str:
    """The compiler as a failure record names it: its real path, size and modification time, so that
    a new or updated compiler gets a fresh try."""
    cxx = compiler()
    if cxx is None:
        return "none"
    st = os.stat(cxx)
    return f"{os.path.realpath(cxx)} {st.st_size} {st.st_mtime_ns}"


def _remember_failure(target: Path, reason: str) -> KernelBuildError:
    """Record why `target` did not compile, and return the error to raise."""
    record = failure_record(target)
    try:
        record.write_text(json.dumps({"compiler": _compiler_identity(), "error": reason, "at": time.time()}))
    except OSError as exc:  # the failure itself matters more than remembering it
        logger.warning("could not record the failed compile in %s: %s", record, exc)
    else:
        logger.warning("recorded the failed compile in %s: worker starts skip it for %.0f h or until the compiler "
                       "changes; `python -m services.worker.kernels.build` retries it now", record,
                       FAILED_RETRY_S / 3600)
    return KernelBuildError(reason)


def failed_build(target: Path) -> str | None:
    """Why the last compile of `target` with this compiler failed, less than FAILED_RETRY_S ago;
    None when it has not.

    Why remembered: a worker that finds no usable build compiles at start-up, so without this
    every start (every restart of a crash-looping pod, every process of `--workers N`) ran a
    compile known to fail again, seconds for an error and up to BUILD_TIMEOUT_S for a compiler
    that hangs, before falling back. An explicit build (`make install`, `python -m
    services.worker.kernels.build`), a changed compiler and time (a fix elsewhere in the
    toolchain, a timeout under load) try again; a compiler killed by a signal is not remembered.
    """
    try:
        record = json.loads(failure_record(target).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("compiler") != _compiler_identity():
        return None
    at = record.get("at")
    if not isinstance(at, int | float) or not 0 <= time.time() - at < FAILED_RETRY_S:
        return None
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at))
    return (f"{record.get('error', 'unknown error')} (at {when}, with this compiler: not compiled again for "
            f"{FAILED_RETRY_S / 3600:.0f} h; `python -m services.worker.kernels.build` retries now, as does "
            f"removing {failure_record(target)})")


def ensure_built(kernel_target: KernelTarget, retry_failed: bool = False) -> Path:
    """Path of `kernel_target`'s build, compiling it first when missing (one builder at a time).

    A build whose compile failed before with the same compiler raises its error again without
    compiling, unless `retry_failed` (`failed_build` says why)."""
    target = target_library(kernel_target)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if not target.is_file():
            earlier = None if retry_failed else failed_build(target)
            if earlier is not None:
                raise KernelBuildError(earlier)
            logger.info("compiling CPU kernels for %s into %s", kernel_target.name, target.parent)
            build(kernel_target, target)
    return target


_outcome: KernelTarget | KernelBuildError | None = None  # what load_kernels got: kept, never retried


def load_kernels(retry_failed: bool = False) -> KernelTarget:
    """Make `torch.ops.spindle.*` available in this process, building first if needed; returns the
    target whose build it loaded (what the process runs after).

    Tries `candidate_targets()` in order: when one fails (a compile error, a library that will not
    load), the next; a fallback is logged with the reason. Raises `KernelBuildError` when none
    loads. The first call's outcome is kept: later calls return or raise it without retrying (a
    worker has several callers, and a failing native compile may run to its timeout).
    `retry_failed`: compile again a build whose compile failed before (`ensure_built`); it acts
    on the first call of a process only, since the outcome is kept.
    """
    global _outcome
    if _outcome is None:
        try:
            _outcome = _load_first_candidate(retry_failed)
        except KernelBuildError as exc:
            _outcome = exc
    if isinstance(_outcome, KernelBuildError):
        raise _outcome
    return _outcome


def forget_load_outcome() -> None:
    """Let the next `load_kernels` try again (tests that change the environment between calls)."""
    global _outcome
    _outcome = None


def _load_first_candidate(retry_failed: bool) -> KernelTarget:
    if switch_on(DISABLE_ENV):
        raise KernelBuildError(f"disabled by {DISABLE_ENV}")
    failures: list[str] = []
    for target in candidate_targets():
        try:
            torch.ops.load_library(str(ensure_built(target, retry_failed)))
        except Exception as exc:  # KernelBuildError, OSError from the loader, a read-only cache ...
            reason = str(exc) if isinstance(exc, KernelBuildError) else f"{type(exc).__name__}: {exc}"
            failures.append(f"the {target.name} build failed: {reason}")
            continue
        if failures:
            logger.warning("spindle CPU kernels: %s; loaded the %s build instead", "; ".join(failures), target.name)
        logger.info("spindle CPU kernels loaded: built for %s, vector instruction sets: %s", target.name,
                    torch.ops.spindle.instruction_sets() or "none (portable loops)")
        return target
    raise KernelBuildError("; ".join(failures))


def kernel_instruction_sets() -> frozenset[str]:
    """The vector instruction sets the loaded build was compiled for, as /proc/cpuinfo names them
    (avx2, avx512f, avx512_bf16, ...): what the kernels use, which for a build for another -march
    target is less than the CPU has. Raises `KernelBuildError` when the kernels cannot load."""
    load_kernels()
    return frozenset(torch.ops.spindle.instruction_sets().split())


def loaded_build() -> tuple[str, frozenset[str]] | None:
    """(target name, vector instruction sets) of the kernels this process runs, None where they cannot load."""
    try:
        target = load_kernels()
    except KernelBuildError:
        return None
    return target.name, kernel_instruction_sets()


def kernels_error() -> str | None:
    """None when the kernels are loaded, else why they cannot be."""
    try:
        load_kernels()
    except KernelBuildError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m services.worker.kernels.build`: build (or find) this CPU's kernels; used by `make install`.

    With --targets, build those targets' kernels instead (the container image builds the family
    ones, which need not run on the building CPU), without loading them. Exits 0 even when a
    build fails (the worker then falls back to the torch backends), unless --strict; prints one
    line a build either way.
    """
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else None)
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernels cannot be built")
    parser.add_argument("--targets", default="", help=f"comma list of {', '.join(TARGETS)} to build, not load; "
                        f"{FAMILY}: every family build for this machine")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.targets:
        failed = False
        names = [n.strip() for n in args.targets.split(",")]
        if FAMILY in names:
            at = names.index(FAMILY)
            names[at:at + 1] = [t.name for t in families_of()]
        if not names:
            print(f"spindle CPU kernels: no family builds for {platform.machine()}")
            return 1 if args.strict else 0
        for name in names:
            try:
                print(f"spindle CPU kernels for {name}: {ensure_built(target_named(name), retry_failed=True)}")
            except (KernelBuildError, ValueError) as exc:
                print(f"spindle CPU kernels for {name} failed: {exc}")
                failed = True
        return 1 if failed and args.strict else 0
    try:
        target = load_kernels(retry_failed=True)  # an explicit build tries a failed compile again
    except KernelBuildError as exc:
        print(f"spindle CPU kernels unavailable ({exc}); workers will use the sdpa backend")
        return 1 if args.strict else 0
    sets = " ".join(sorted(kernel_instruction_sets())) or "no vector instruction sets"
    print(f"spindle CPU kernels ready ({target.name}: {sets}): {target_library(target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
