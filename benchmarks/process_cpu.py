"""CPU time of a served run, by process: the host work per token, side by side for every server.

On a small CPU host the server's processes and the benchmark's own load client share the cores
with the model, so tokens/s alone cannot say whether a gap is in the model or around it. Here,
CPU seconds (user + system, every thread, from /proc/<pid>/stat) are read for every process of
the server's process group (each benchmark server is started in a session of its own) and for
this process, which runs the load client, once before the timed requests and once after; the
difference divided by the output tokens is each process's CPU per token.

Processes are named by role: a spindle service by its module (`services.worker` -> "worker";
the `spindle serve` launcher is "launcher"), any other by its executable ("llama-server") or,
for a Python program, its module or script ("vllm"). Processes of one role are summed. Linux
only (it reads /proc); elsewhere every reading is empty.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LOAD_CLIENT = "load client"
_PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class CpuReading:
    """CPU seconds so far of each process (by pid) of a group, with their roles."""

    seconds: Mapping[int, float]
    roles: Mapping[int, str]


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; the command name (field 2) may hold spaces."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:  # gone, or not Linux
        return None
    return text[text.rindex(")") + 2:].split()


def _cpu_of(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime: fields 14 and 15


def cpu_seconds(pid: int | str) -> float | None:
    """User + system CPU seconds of every thread of process `pid` (exited threads included)."""
    fields = _stat_fields(pid)
    return None if fields is None else _cpu_of(fields)


def role_of(argv: list[str]) -> str:
    """A process's role from its command line (module docstring)."""
    if not argv:
        return "?"
    program = Path(argv[0]).name
    if not program.startswith("python"):
        return program
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return "launcher" if module == "services.cli" else module.removeprefix("services.").split(".")[0]
    script = next((arg for arg in argv[1:] if not arg.startswith("-")), None)
    return Path(script).stem if script is not None and "-c" not in argv else "python"


def _argv(pid: str) -> list[str]:
    try:
        raw = (_PROC / pid / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def read_group(pgid: int) -> CpuReading:
    """CPU seconds of every process in process group `pgid`, and of this process as the load client."""
    seconds: dict[int, float] = {}
    roles: dict[int, str] = {}
    if _PROC.is_dir():
        for entry in _PROC.iterdir():
            if not entry.name.isdigit():
                continue
            fields = _stat_fields(entry.name)
            if fields is None or int(fields[2]) != pgid:  # field 5: the process group
                continue
            seconds[int(entry.name)] = _cpu_of(fields)
            roles[int(entry.name)] = role_of(_argv(entry.name))
        own = cpu_seconds(os.getpid())
        if own is not None and os.getpid() not in seconds:
            seconds[os.getpid()] = own
            roles[os.getpid()] = LOAD_CLIENT
    return CpuReading(seconds, roles)


def cpu_ms_per(before: CpuReading, after: CpuReading, count: int) -> dict[str, float] | None:
    """ms of CPU per unit of work (`count` output tokens, or requests) by role between two readings
    (a process started in between counts from zero); None without work or without /proc."""
    if count <= 0 or not after.seconds:
        return None
    by_role: dict[str, float] = {}
    for pid, used in after.seconds.items():
        role = after.roles[pid]
        by_role[role] = by_role.get(role, 0.0) + used - before.seconds.get(pid, 0.0)
    return {role: used / count * 1e3 for role, used in sorted(by_role.items(), key=lambda kv: -kv[1])}
