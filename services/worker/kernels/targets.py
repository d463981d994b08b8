"""What instruction set a build of the CPU kernels is compiled for: this CPU's, or a family's.

Why: the kernels are compiled with gcc's `-march`, and `native` (this CPU's instruction set) needs
a compiler where the worker runs. The container image has none (its final stage installs no
compiler, by design), so there a worker could not build its kernels and ran every op on torch's
fallbacks. The image therefore ships builds for families of CPUs (on x86 the psABI levels, plus
AVX512-BF16; on Arm any 64-bit Arm), and a worker without a compiler, or whose native build
fails, loads the best cached one its CPU can run. The same
targets let tests and benchmarks build and check an AVX2-only CPU's code paths (x86-64-v3) or the
portable loops an Arm build also takes (x86-64) on whatever host they run on.

`SPINDLE_KERNEL_TARGET` picks one: `auto` (the default: native where a compiler is or a native
build is cached, else, or when that fails, the best cached family build), `native`, or a family's
name.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

TARGET_ENV = "SPINDLE_KERNEL_TARGET"
AUTO = "auto"


@dataclass(frozen=True, slots=True)
class KernelTarget:
    """One instruction set to build for: gcc's flags for it and what a CPU needs to run the result."""

    name: str
    march_flags: tuple[str, ...]
    needs: frozenset[str] = frozenset()  # /proc/cpuinfo flags a CPU must have
    machine: str | None = None  # platform.machine() it runs on; None: the building host's own

    @property
    def is_native(self) -> bool:
        return self.name == NATIVE.name

    @property
    def is_x86(self) -> bool:
        """Whether it builds for x86-64 (a native build: where it is built)."""
        return (self.machine or platform.machine()) == "x86_64"

    def runs_on(self, cpu_flags: frozenset[str], machine: str | None = None) -> bool:
        """Whether a CPU with these flags (on `machine`, default this one) can run this build."""
        on = machine or platform.machine()
        return (self.machine is None or self.machine == on) and self.needs <= cpu_flags


NATIVE = KernelTarget("native", ("-march=native",))

# The x86-64 psABI levels, as /proc/cpuinfo names their instructions (abm: LZCNT).
_X86_64_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2",
                        "f16c", "fma", "abm", "movbe", "xsave"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Family builds, best first: a worker without a compiler loads the first its CPU runs. v4 with
# AVX512-BF16 (and AVX512-VNNI, which every such CPU has) is Zen 4 and later, Cooper Lake and
# Sapphire Rapids on (bf16 dot products in the linear kernels, int8 ones in the LM head's screen);
# v4 the other AVX-512 CPUs; v3 AVX2 ones (Zen 1-3, Haswell on); x86-64 any.
# armv8-a: any 64-bit Arm (the kernels' portable loops, which gcc vectorises with NEON).
FAMILY_TARGETS: tuple[KernelTarget, ...] = (
    KernelTarget("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
                 _X86_64_V4 | {"avx512_bf16", "avx512_vnni"}, "x86_64"),
    KernelTarget("x86-64-v4", ("-march=x86-64-v4",), _X86_64_V4, "x86_64"),
    KernelTarget("x86-64-v3", ("-march=x86-64-v3",), _X86_64_V3, "x86_64"),
    KernelTarget("x86-64", ("-march=x86-64",), frozenset(), "x86_64"),
    KernelTarget("armv8-a", ("-march=armv8-a",), frozenset(), "aarch64"),
)
FAMILY = "family"  # in a build's --targets: every family build for the building machine
TARGETS: dict[str, KernelTarget] = {t.name: t for t in (NATIVE, *FAMILY_TARGETS)}


def target_named(name: str) -> KernelTarget:
    """The target called `name`; ValueError naming the choices otherwise."""
    if name not in TARGETS:
        raise ValueError(f"unknown kernel target {name!r}; expected {AUTO} or one of {', '.join(TARGETS)}")
    return TARGETS[name]


def requested_target() -> str:
    """$SPINDLE_KERNEL_TARGET (default auto), checked: auto or a name of TARGETS."""
    name = os.environ.get(TARGET_ENV, "").strip() or AUTO
    if name != AUTO:
        target_named(name)
    return name


def families_of(machine: str | None = None) -> list[KernelTarget]:
    """The family builds for a machine (default this one), whatever its CPU runs: what the image builds."""
    on = machine or platform.machine()
    return [t for t in FAMILY_TARGETS if t.machine == on]


def family_targets_for(cpu_flags: frozenset[str], machine: str | None = None) -> list[KernelTarget]:
    """The family builds a CPU with these flags can run, best first."""
    return [t for t in families_of(machine) if t.needs <= cpu_flags]
