"""Kernel builds for other instruction sets than this CPU's (kernels/targets.py).

- which family builds a CPU runs, best first; names and CPUs are checked with a clear reason;
- a family build's cache key leaves the building CPU out (the image builds them on any CPU);
- Arm builds get no x86 options, and every kernel source compiles for Arm (a cross compiler);
- with no compiler, `auto` loads the best family build in the cache (the container image), and
  one stands in where the native build fails;
- the worker's kernel tests pass on an AVX2-only build (the code an AMD Zen 3 runs) and on the
  portable loops (what an Arm build takes), each in a fresh interpreter: -march=native on an
  AVX-512 host never compiles those paths, and CI's CPU changes between runs.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.kernels import build
from services.worker.kernels.targets import NATIVE, TARGET_ENV, family_targets_for, target_named

REPO = Path(__file__).resolve().parents[2]
ZEN3 = frozenset({"fpu", "sse2", "cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1",
                  "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}


def test_a_cpu_runs_the_family_builds_its_instructions_allow_best_first() -> None:
    def names(flags: frozenset[str], machine: str = "x86_64") -> list[str]:
        return [t.name for t in family_targets_for(flags, machine)]

    assert names(ZEN4) == ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    assert names(ZEN4 - {"avx512_bf16"}) == ["x86-64-v4", "x86-64-v3", "x86-64"]  # Skylake-SP, Ice Lake
    assert names(ZEN3) == ["x86-64-v3", "x86-64"]
    assert names(ZEN3 - {"fma"}) == ["x86-64"]
    assert names(frozenset({"fp", "asimd", "bf16"}), "aarch64") == ["armv8-a"]
    assert names(ZEN4, "riscv64") == []


def test_unknown_targets_and_builds_this_cpu_cannot_run_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TARGET_ENV, "x86-64-v9")
    with pytest.raises(build.KernelBuildError, match="unknown kernel target 'x86-64-v9'; expected auto or one of"):
        build.candidate_targets()
    monkeypatch.setenv(TARGET_ENV, "x86-64-v3")
    monkeypatch.setattr(build, "_cpu_features", lambda: "fpu sse2 avx")
    if platform.machine() == "x86_64":
        with pytest.raises(build.KernelBuildError, match="cannot run kernels built for x86-64-v3 .*avx2"):
            build.candidate_targets()
    monkeypatch.setenv(TARGET_ENV, "native")
    assert build.candidate_targets() == [NATIVE]


def test_only_a_native_build_is_keyed_by_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = {}
    for cpu in ("avx2 fma", "avx2 fma avx512f"):
        monkeypatch.setattr(build, "_cpu_features", lambda cpu=cpu: cpu)
        keys[cpu] = (build.build_key(NATIVE), build.build_key(target_named("x86-64-v3")))
    (native_a, family_a), (native_b, family_b) = keys.values()
    assert native_a != native_b and family_a == family_b
    assert family_a != build.build_key(target_named("x86-64"))


def test_a_family_build_is_calibrated_per_cpu_in_the_users_cache(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """The image's builds lie read-only and serve every CPU of a family; timings are one CPU's."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "image"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert build.calibration_dir(NATIVE) == build.target_library(NATIVE).parent
    dirs = set()
    for cpu in ("sse2 avx2", "sse2 avx2 avx512f"):
        monkeypatch.setattr(build, "_cpu_features", lambda cpu=cpu: cpu)
        dirs.add(build.calibration_dir(target_named("x86-64")))
    assert len(dirs) == 2 and all(d.is_relative_to(tmp_path / "home") for d in dirs)


def test_auto_tries_native_then_the_cached_family_builds_best_first(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setenv(TARGET_ENV, "auto")
    monkeypatch.setattr(build, "_cpu_features", lambda: " ".join(sorted(ZEN4)))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    cached = {"x86-64-v3", "x86-64-v4-bf16"}
    monkeypatch.setattr(build, "target_library",
                        lambda t: tmp_path / ("cached" if t.name in cached else "missing") / t.name)
    (tmp_path / "cached").mkdir()
    for name in cached:
        (tmp_path / "cached" / name).touch()
    monkeypatch.setattr(build, "compiler", lambda: "/usr/bin/g++")
    assert [t.name for t in build.candidate_targets()] == ["native", "x86-64-v4-bf16", "x86-64-v3"]
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert [t.name for t in build.candidate_targets()] == ["x86-64-v4-bf16", "x86-64-v3"]


def test_a_build_that_will_not_load_gives_way_to_the_next_and_a_failure_is_remembered(
        cpu_kernels: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A library the loader refuses (an undefined symbol, a truncated file) is a failure like a
    compile error; and when none loads, later calls raise at once (no compiler run per caller)."""
    import torch

    first, second = target_named("x86-64-v4-bf16"), target_named("x86-64-v3")
    monkeypatch.setattr(build, "candidate_targets", lambda: [first, second])
    monkeypatch.setattr(build, "ensure_built", lambda target, retry_failed=False: Path(f"/cache/{target.name}.so"))
    loaded: list[str] = []

    def load_library(path: str) -> None:
        if first.name in path:
            raise OSError(f"{path}: undefined symbol: _ZN3c10")
        loaded.append(path)

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    try:
        build.forget_load_outcome()
        with caplog.at_level("WARNING"):
            assert build.load_kernels() is second and loaded == ["/cache/x86-64-v3.so"]
        assert "the x86-64-v4-bf16 build failed: OSError: /cache/x86-64-v4-bf16.so: undefined symbol" in caplog.text
        assert "loaded the x86-64-v3 build instead" in caplog.text
        tries: list[int] = []
        monkeypatch.setattr(build, "candidate_targets", lambda: tries.append(1) or [first])
        build.forget_load_outcome()
        for _ in range(3):
            with pytest.raises(build.KernelBuildError, match="the x86-64-v4-bf16 build failed"):
                build.load_kernels()
        assert tries == [1]
    finally:
        monkeypatch.undo()
        build.forget_load_outcome()
        build.load_kernels()


def test_x86_tuning_stays_off_arm_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcc for Arm rejects -mprefer-vector-width: with it every native Arm build failed."""
    assert "-mprefer-vector-width=256" in build.target_flags(target_named("x86-64-v3"))
    assert "-mprefer-vector-width=256" not in build.target_flags(target_named("armv8-a"))
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert "-mprefer-vector-width=256" not in build.target_flags(NATIVE)
    assert [t.name for t in family_targets_for(frozenset({"fp", "asimd"}))] == ["armv8-a"]
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert "-mprefer-vector-width=256" in build.target_flags(NATIVE)


def test_targets_family_builds_every_family_of_this_machine(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """What the image's build stage runs (`--targets family`), on x86 and on Arm."""
    built: list[str] = []
    monkeypatch.setattr(build, "ensure_built",
                        lambda target, retry_failed=False: built.append(target.name) or Path(target.name))
    for machine, expected in (("x86_64", ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64"]),
                              ("aarch64", ["armv8-a"])):
        monkeypatch.setattr(platform, "machine", lambda machine=machine: machine)
        built.clear()
        assert build.main(["--strict", "--targets", "family"]) == 0
        assert built == expected
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    built.clear()
    assert build.main(["--targets", "family"]) == 0 and built == []
    assert "no family builds for riscv64" in capsys.readouterr().out
    assert build.main(["--strict", "--targets", "family"]) == 1, "--strict: an image without kernels fails"


ARM_CXX = "aarch64-linux-gnu-g++"  # Debian's g++-aarch64-linux-gnu (make test installs it)


@pytest.mark.skipif(shutil.which(ARM_CXX) is None, reason=f"needs {ARM_CXX}")
def test_the_kernels_compile_for_arm() -> None:
    """Every source, with the armv8-a build's flags, through Debian's cross compiler: x86-only code
    (an unguarded intrinsic, an x86 option) would break Arm workers and the arm64 image, and no
    x86 host compiles that path otherwise (-fsyntax-only: the parse and template instantiation,
    which is where such code fails, in a third of a full compile's time)."""
    flags = build.compile_flags(target_named("armv8-a"))
    running = [(source, subprocess.Popen([ARM_CXX, *flags, "-fsyntax-only", str(source)], stderr=subprocess.PIPE,
                                         text=True)) for source in build.SOURCES]
    errors = {source.name: proc.communicate(timeout=600)[1][-2000:] for source, proc in running}
    assert all(proc.returncode == 0 for _, proc in running), {k: v for k, v in errors.items() if v}


def _runnable(name: str) -> bool:
    return target_named(name).runs_on(build.cpu_flags())


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=900)


LOADED = ("from services.worker.kernels.build import load_kernels, kernel_instruction_sets as sets; "
          "print(load_kernels().name, ' '.join(sorted(sets())))")


@pytest.mark.skipif(shutil.which("g++") is None or not _runnable("x86-64-v3"), reason="needs g++ and an AVX2 x86 CPU")
def test_without_a_compiler_auto_loads_the_best_family_build_in_the_cache(tmp_path: Path) -> None:
    """The container image: no compiler, the family builds made when the image was built."""
    v3 = build.ensure_built(target_named("x86-64-v3"))
    shutil.copytree(v3.parent, tmp_path / v3.parent.name)
    got = _python(LOADED, CXX="/nonexistent/g++", SPINDLE_KERNEL_CACHE=str(tmp_path), **{TARGET_ENV: "auto"})
    assert got.returncode == 0, got.stderr[-2000:]
    name, *sets = got.stdout.split()
    assert name == "x86-64-v3" and "avx2" in sets and "avx512f" not in sets
    empty = _python(LOADED, CXX="/nonexistent/g++", SPINDLE_KERNEL_CACHE=str(tmp_path / "empty"))
    assert empty.returncode != 0
    assert "no C++ compiler to build this CPU's kernels, and no prebuilt build" in empty.stderr


@pytest.mark.skipif(shutil.which("g++") is None or not _runnable("x86-64-v3"), reason="needs g++ and an AVX2 x86 CPU")
def test_auto_falls_back_to_a_family_build_when_the_native_build_fails(tmp_path: Path) -> None:
    """A compiler that fails (too old for the CPU, a broken toolchain): a cached family build stands
    in, with a warning that says why; with none cached, the error names the native failure."""
    v3 = build.ensure_built(target_named("x86-64-v3"))
    shutil.copytree(v3.parent, tmp_path / v3.parent.name)
    broken = tmp_path / "g++"
    broken.write_text("#!/bin/sh\necho 'cc1plus: error: bad value for -march' >&2\nexit 1\n")
    broken.chmod(0o755)
    code = "import logging; logging.basicConfig(level=logging.WARNING); " + LOADED
    got = _python(code, CXX=str(broken), SPINDLE_KERNEL_CACHE=str(tmp_path), **{TARGET_ENV: "auto"})
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split()[0] == "x86-64-v3"
    assert "the native build failed: compiler exited 1: cc1plus: error: bad value for -march" in got.stderr
    assert "loaded the x86-64-v3 build instead" in got.stderr
    alone = _python(LOADED, CXX=str(broken), SPINDLE_KERNEL_CACHE=str(tmp_path / "empty"), **{TARGET_ENV: "auto"})
    assert alone.returncode != 0 and "the native build failed: compiler exited 1" in alone.stderr


def test_a_failed_compile_is_not_run_again_at_each_start(tmp_path: Path) -> None:
    """A worker start after a failed native compile does not run it again (a crash-looping pod or
    `--workers N` would each wait for it, up to the compiler's timeout); an explicit build (`make
    install`), a changed compiler and a record a day old do, and a compile that works clears it."""
    calls = tmp_path / "calls"
    broken = tmp_path / "g++"
    broken.write_text(f"#!/bin/sh\necho run >> {calls}\necho 'cc1plus: internal compiler error' >&2\nexit 1\n")
    broken.chmod(0o755)
    env = {"CXX": str(broken), "SPINDLE_KERNEL_CACHE": str(tmp_path / "cache"), TARGET_ENV: "native"}

    def runs() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    first = _python(LOADED, **env)
    assert first.returncode != 0 and "compiler exited 1: cc1plus: internal compiler error" in first.stderr
    assert runs() == 1
    again = _python(LOADED, **env)
    assert again.returncode != 0 and runs() == 1
    assert "internal compiler error (at " in again.stderr and "with this compiler: not compiled again" in again.stderr
    explicit = subprocess.run([sys.executable, "-m", "services.worker.kernels.build"], cwd=REPO,
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert "unavailable (the native build failed: compiler exited 1" in explicit.stdout and runs() == 2
    os.utime(broken, ns=(0, 0))  # another compiler (an upgrade): tried again
    assert _python(LOADED, **env).returncode != 0 and runs() == 3
    [record] = (tmp_path / "cache").glob(f"*/{build.FAILED_RECORD}")
    stale = json.loads(record.read_text())
    record.write_text(json.dumps({**stale, "at": stale["at"] - build.FAILED_RETRY_S}))  # a day old
    assert _python(LOADED, **env).returncode != 0 and runs() == 4
    record.write_text("{not json")  # a torn record counts as none
    assert _python(LOADED, **env).returncode != 0 and runs() == 5
    works = tmp_path / "works"  # a compiler that makes a library: the record goes
    works.write_text("#!/bin/sh\nwhile [ \"$1\" != -o ]; do shift; done\ntouch \"$2\"\n")
    works.chmod(0o755)
    made = _python("from services.worker.kernels import build; from services.worker.kernels.targets import NATIVE; "
                   "print(build.ensure_built(NATIVE))", **{**env, "CXX": str(works)})
    assert made.returncode == 0, made.stderr[-2000:]
    assert Path(made.stdout.split()[-1]).is_file() and not record.exists()


# (target, an instruction set its build must have or None, one it must not)
# and which tests: all of tests/worker for AVX2 (CPUs seen here run it); for the portable loops, the
# kernels' own tests (each against its reference), which keeps CI's added time to ~4 minutes.
KERNEL_TESTS = ("test_paged_attention.py", "test_fast_linear.py", "test_fused_ops.py", "test_argmax_kernel.py",
                "test_native_stack.py", "test_packed_encoder.py", "test_work_pool.py")
FAMILY_RUNS = [("x86-64-v3", "avx2", "avx512f", ()), ("x86-64", None, "avx2", KERNEL_TESTS)]


@pytest.mark.parametrize(("target", "has", "lacks", "files"), FAMILY_RUNS)
def test_worker_kernel_tests_pass_on_a_family_build(target: str, has: str | None, lacks: str,
                                                    files: tuple[str, ...]) -> None:
    """tests/worker (or `files` of it) in a fresh interpreter with the kernels built for `target`:
    every kernel against its reference, and (all of tests/worker) the models' greedy tokens against
    transformers, on that build's code paths."""
    if shutil.which("g++") is None or not _runnable(target):
        pytest.skip(f"needs g++ and a CPU that runs {target}")
    if target == "x86-64-v3" and "avx512f" not in build.cpu_flags():
        pytest.skip("an AVX2-only CPU: its native build is this one, tested by the suite itself")
    loaded = _python(LOADED, **{TARGET_ENV: target})
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    name, *sets = loaded.stdout.split()
    assert name == target and (has is None or has in sets) and lacks not in sets
    paths = [f"tests/worker/{name}" for name in files] or ["tests/worker"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths,
                          f"--ignore={Path(__file__).relative_to(REPO)}"], cwd=REPO,
                         env={**os.environ, TARGET_ENV: target}, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


def test_the_worker_metric_names_the_build_it_runs(cpu_kernels: None) -> None:
    """spindle:worker_cpu_kernels: the loaded build, or target="none" where a worker runs torch's ops."""
    import torch
    from prometheus_client import generate_latest

    from services.worker.telemetry import WorkerMetrics

    target, sets = build.loaded_build() or ("", frozenset())
    assert target == build.candidate_targets()[0].name and sets == build.kernel_instruction_sets()
    exposed = {}
    for name, loaded in (("none", None), ("v3", ("x86-64-v3", frozenset({"fma", "avx2"})))):
        metrics = WorkerMetrics()
        metrics.report_cpu_kernels(loaded)
        exposed[name] = generate_latest(metrics.registry).decode()
    assert 'spindle:worker_cpu_kernels{instruction_sets="",target="none"} 1.0' in exposed["none"]
    assert 'spindle:worker_cpu_kernels{instruction_sets="avx2 fma",target="x86-64-v3"} 1.0' in exposed["v3"]
    # The LM head screen's counts come with the kernels (head_screen_metric.py), and only with them.
    assert "spindle:worker_head_screen_rows_total" not in exposed["none"]
    decided, undecided = torch.ops.spindle.head_screen_counts()
    assert f'spindle:worker_head_screen_rows_total{{outcome="decided"}} {float(decided)}' in exposed["v3"]
    assert f'spindle:worker_head_screen_rows_total{{outcome="undecided"}} {float(undecided)}' in exposed["v3"]
