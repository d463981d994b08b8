"""A container's CPU quota (services/cpu_quota.py) and the worker's default thread count from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.cpu_quota import cgroup_cpu_limit, threads_for_quota
from services.worker.__main__ import add_arguments, config_from_args


def _v2(tmp_path: Path, limits: dict[str, str], own: str = "/") -> tuple[Path, Path]:
    """A cgroup v2 tree with cpu.max per folder, and a /proc/self/cgroup naming `own`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    for folder, text in limits.items():
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "cpu.max").write_text(text + "\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(f"0::{own}\n")
    return tmp_path, self_cgroup


def test_v2_the_tightest_limit_from_the_own_cgroup_up(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(*_v2(tmp_path / "a", {".": "200000 100000"})) == 2.0  # a container's own root
    assert cgroup_cpu_limit(*_v2(tmp_path / "b", {".": "max 100000"})) is None
    nested = {"kubepods": "max 100000", "kubepods/pod1": "150000 100000", "kubepods/pod1/c": "400000 100000"}
    assert cgroup_cpu_limit(*_v2(tmp_path / "c", nested, "/kubepods/pod1/c")) == 1.5
    assert cgroup_cpu_limit(*_v2(tmp_path / "d", {"x": "garbage"}, "/x")) is None


def test_v1_quota_over_period(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu,cpuacct"
    cpu.mkdir()
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path, tmp_path / "none") is None
    (cpu / "cpu.cfs_quota_us").write_text("50000\n")
    assert cgroup_cpu_limit(tmp_path, tmp_path / "none") == 0.5
    assert cgroup_cpu_limit(tmp_path / "missing", tmp_path / "none") is None


@pytest.mark.parametrize(("cores", "limit", "threads"), [(64, 2.0, 2), (64, 1.5, 2), (64, 0.5, 1), (2, 2.0, None),
                                                         (2, 8.0, None), (8, None, None)])
def test_threads_are_the_quota_rounded_up_where_it_caps_the_cores(cores: int, limit: float | None,
                                                                  threads: int | None) -> None:
    assert threads_for_quota(cores, limit) == threads


def test_a_worker_told_no_thread_count_takes_its_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import services.worker.__main__ as worker_main

    def config(*argv: str) -> int | None:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return config_from_args(parser.parse_args(["--model", "m", *argv])).num_threads

    monkeypatch.delenv("SPINDLE_NUM_THREADS", raising=False)
    monkeypatch.delenv("SPINDLE_CPU_CORES", raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(worker_main, "cgroup_cpu_limit", lambda: 0.5)
    assert config() == (1 if cores > 1 else None)
    assert config("--num-threads", "3") == 3  # told: as told
    assert config("--num-threads", "0") == (1 if cores > 1 else None)  # the chart's request of 0: not told
    monkeypatch.setattr(worker_main, "cgroup_cpu_limit", lambda: None)
    assert config() is None  # torch's own count
