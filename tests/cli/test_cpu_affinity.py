"""Core placement: which cores each worker and the host services get, and how a service applies them.

No timing here: what each policy is worth was measured (services/cpu_affinity.py says the numbers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cpu_affinity import (
    AUTO_POLICY,
    CorePlan,
    add_cpu_cores_argument,
    compute_core,
    format_cores,
    parse_cores,
    plan_cores,
    split_cores,
    worker_env,
)
from services.launcher import Launcher, ServeConfig


def test_core_lists_parse_and_format() -> None:
    assert parse_cores("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cores(" 5, 1-2 ,2") == (1, 2, 5)
    assert format_cores((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert format_cores(()) == ""
    for cores in [(0,), (0, 2, 4), tuple(range(16))]:
        assert parse_cores(format_cores(cores)) == cores
    for bad in ["", "a", "3-1", "1,,2", "-1"]:
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_workers_split_cores_evenly_and_share_only_when_short() -> None:
    assert split_cores(range(8), 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert split_cores(range(7), 3) == ((0, 1, 2), (3, 4), (5, 6))
    assert split_cores((4, 5), 1) == ((4, 5),)
    assert split_cores((0, 1), 3) == ((0,), (1,), (0,))
    with pytest.raises(ValueError):
        split_cores((), 1)


def test_policies() -> None:
    assert plan_cores("off", 2, (0, 1)) == CorePlan(((), ()))
    assert not plan_cores("off", 1, (0, 1)).is_pinned
    assert plan_cores("spread", 1, (0, 1)) == CorePlan(((0, 1),))
    assert plan_cores("spread", 2, (1, 0, 2, 3)) == CorePlan(((0, 1), (2, 3)))
    assert plan_cores("isolate", 1, (0, 1)) == CorePlan(((0,),), (1,))
    assert plan_cores("isolate", 2, range(5)) == CorePlan(((0, 1), (2, 3)), (4,))
    # Too few cores to set one aside: the workers keep them all.
    assert plan_cores("isolate", 2, (0, 1)) == CorePlan(((0,), (1,)))
    # The workers keep every core; the host services share the last one.
    assert plan_cores("share", 1, (0, 1)) == CorePlan(((0, 1),), (1,))
    assert plan_cores("share", 2, range(4)) == CorePlan(((0, 1), (2, 3)), (3,))
    assert plan_cores("share", 1, (5,)) == CorePlan(((5,),), (5,))
    for workers in (1, 2, 3):
        assert plan_cores("auto", workers, range(4)) == plan_cores(AUTO_POLICY, workers, range(4))


def test_explicit_maps() -> None:
    assert plan_cores("workers=0-3;host=4", 2, range(6)) == CorePlan(((0, 1), (2, 3)), (4,))
    assert plan_cores("w0=0,2;w1=1,3", 2, range(4)) == CorePlan(((0, 2), (1, 3)))
    assert plan_cores("host=5", 1, range(6)) == CorePlan(((),), (5,))
    assert plan_cores("workers=0-1;host=1", 1, (0, 1)) == CorePlan(((0, 1),), (1,))  # overlap is allowed
    for bad in ["bogus", "workers=0-1;workers=2", "w0=0", "w0=0;w1=1;workers=2", "host=9", "worker=0", "w0=x"]:
        with pytest.raises(ValueError):
            plan_cores(bad, 2, range(4))


def test_worker_environment_binds_one_thread_per_core() -> None:
    assert worker_env(()) == {}
    assert worker_env((2, 3)) == {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{2},{3}", "OMP_PROC_BIND": "close"}


def test_compute_core_is_a_bound_workers_first_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPINDLE_DISABLE_EVENT_LOOP_ON_COMPUTE_CORE", raising=False)
    assert compute_core(worker_env((2, 3))) == (2,)
    assert compute_core(worker_env((5,))) == (5,)
    assert compute_core({"OMP_PROC_BIND": "close", "OMP_PLACES": "{0,1},{2,3}"}) == (0, 1)
    assert compute_core({"OMP_PLACES": "{0},{1}"}) == ()  # threads not bound: nothing to follow
    assert compute_core({"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}) == ()  # not worker_env's form
    assert compute_core({}) == ()
    assert compute_core({"OMP_PROC_BIND": "false", "OMP_PLACES": "{0},{1}"}) == ()  # libgomp binds nothing
    assert compute_core({"OMP_PROC_BIND": "close", "OMP_PLACES": "{0,},{1}"}) == ()  # malformed: libgomp warns
    assert compute_core({**worker_env((2, 3)), "SPINDLE_DISABLE_EVENT_LOOP_ON_COMPUTE_CORE": "1"}) == ()
    monkeypatch.setenv("SPINDLE_DISABLE_EVENT_LOOP_ON_COMPUTE_CORE", "1")
    assert compute_core(worker_env((2, 3))) == (2,)  # the switch is read from the environment given


def test_cpu_cores_flag_and_worker_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.__main__ import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_cpu_cores_argument(parser)
    assert parser.parse_args([]).cpu_cores == ()
    assert parser.parse_args(["--cpu-cores", "1-2"]).cpu_cores == (1, 2)
    monkeypatch.setenv("SPINDLE_CPU_CORES", "3")
    parser = argparse.ArgumentParser()
    add_cpu_cores_argument(parser)
    assert parser.parse_args([]).cpu_cores == (3,)
    monkeypatch.delenv("SPINDLE_CPU_CORES")

    worker = argparse.ArgumentParser()
    add_arguments(worker)

    def threads(*argv: str) -> int | None:
        return config_from_args(worker.parse_args(["--model", "m", *argv])).num_threads

    assert threads("--cpu-cores", "0-2") == 3
    assert threads("--cpu-cores", "0-2", "--num-threads", "1") == 1
    assert threads() is None


def test_launcher_hands_each_child_its_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    with pytest.raises(ValueError):
        ServeConfig(model=str(tmp_path), cpu_affinity="w0=7")
    launcher = Launcher(ServeConfig(model=str(tmp_path), num_workers=2, cpu_affinity="isolate"))
    spawned: dict[str, tuple[list[str], dict[str, str]]] = {}
    monkeypatch.setattr(Launcher, "_popen", lambda self, name: spawned.setdefault(
        name, (self._commands[name][0], self._commands[name][2])))
    launcher.start()

    def cores(name: str) -> str | None:
        cmd = spawned[name][0]
        return cmd[cmd.index("--cpu-cores") + 1] if "--cpu-cores" in cmd else None

    assert (cores("worker-0"), cores("worker-1"), cores("scheduler"), cores("frontend")) == ("0-1", "2-3", "4", "4")
    assert spawned["worker-1"][1]["OMP_PLACES"] == "{2},{3}"
    assert spawned["frontend"][1] == {}


def test_a_service_pins_itself(tmp_path: Path) -> None:
    """`--cpu-cores` reaches os.sched_setaffinity in the child (checked in a subprocess)."""
    core = min(os.sched_getaffinity(0))
    code = (
        "import os, sys\n"
        "from services.cli import run_service\n"
        "import services.scheduler.__main__ as m\n"
        f"m.serve = lambda config: sys.exit(0 if os.sched_getaffinity(0) == {{{core}}} else 3)\n"
        "m.config_from_args = lambda args: None\n"
        f"run_service('scheduler', m, ['--cpu-cores', '{core}'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
