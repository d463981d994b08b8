"""`spindle serve` hands its service flags through: each reaches exactly the children that take it.

The children's own parsers check the hand-off, so a flag renamed or retyped in a service breaks
this test rather than `spindle serve` at start-up.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import fields
from pathlib import Path

import pytest

from services import cli
from services.frontend.limits import RequestLimits
from services.serve_flags import (
    FRONTEND,
    SCHEDULER,
    SERVE_FLAGS,
    WORKER,
    add_serve_flags,
    service_args,
    shutdown_grace_s,
)


def _sample(kind: object, name: str) -> object:
    """A value of the flag's type that is no service's default."""
    if kind is int:
        return 7
    if kind is float:
        return 7.5
    return {"state_store": "redis://127.0.0.1:1/3", "attention_backend": "naive", "dtype": "float32",
            "weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "encoder_matmul": "float32",
            "device": "cpu", "step_transport": "grpc"}[name]


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("service", [FRONTEND, SCHEDULER, WORKER])
def test_every_flag_is_parsed_by_the_services_that_take_it(service: str) -> None:
    values = {f.name: _sample(f.kind, f.name) for f in SERVE_FLAGS}
    argv = [a for f in SERVE_FLAGS for a in (f.flag, str(values[f.name]))]
    handed = service_args(_serve_args(*argv), service)
    parser = argparse.ArgumentParser()
    importlib.import_module(f"services.{service}.__main__").add_arguments(parser)
    parsed = parser.parse_args(list(handed))
    taken = [f for f in SERVE_FLAGS if service in f.services]
    assert taken, f"{service} takes no flag"
    for f in taken:
        assert getattr(parsed, f.name) == values[f.name], f.flag
    assert len(handed) == 2 * len(taken), "only the flags this service takes"


def test_unset_flags_are_not_handed_on() -> None:
    args = _serve_args("--rate-limit-rpm", "60")
    assert service_args(args, FRONTEND) == ("--rate-limit-rpm", "60")
    assert service_args(args, SCHEDULER) == () and service_args(args, WORKER) == ()


def test_every_request_limit_and_the_fault_tolerance_flags_are_there() -> None:
    names = {f.name for f in SERVE_FLAGS}
    assert {limit.name for limit in fields(RequestLimits)} <= names
    assert {"rate_limit_rpm", "state_store", "max_waiting_requests", "max_waiting_tokens", "shutdown_grace_s"} <= names


def test_serve_builds_each_childs_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = {}

    class FakeLauncher:
        def __init__(self, config: object) -> None:
            seen["config"] = config

        def run(self) -> int:
            return 0

    monkeypatch.setattr("services.launcher.Launcher", FakeLauncher)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", str(tmp_path), "--state-store", "redis://r:6379/0", "--rate-limit-rpm", "60",
                  "--max-prompt-chars", "100", "--max-waiting-requests", "5", "--max-num-seqs", "8",
                  "--log-requests"])
    assert exit_info.value.code == 0
    config = seen["config"]
    assert config.frontend_args == ("--state-store", "redis://r:6379/0", "--rate-limit-rpm", "60",
                                    "--max-prompt-chars", "100", "--log-requests")
    assert config.scheduler_args == ("--max-num-seqs", "8", "--max-waiting-requests", "5",
                                     "--state-store", "redis://r:6379/0")
    assert config.worker_args == ("--max-num-seqs", "8")
    assert config.shutdown_grace_s == 20.0, "the launcher waits as long as its children drain"


def test_the_launcher_knows_how_long_its_children_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPINDLE_SHUTDOWN_GRACE_S", raising=False)
    assert shutdown_grace_s(_serve_args()) == 20.0  # the services' default
    monkeypatch.setenv("SPINDLE_SHUTDOWN_GRACE_S", "45")
    assert shutdown_grace_s(_serve_args()) == 45.0  # what the children read without the flag
    assert shutdown_grace_s(_serve_args("--shutdown-grace-s", "5")) == 5.0


def test_a_bad_value_is_refused_by_serve_itself(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", str(tmp_path), "--rate-limit-rpm", "many"])
    assert exit_info.value.code == 2
    assert "--rate-limit-rpm" in capsys.readouterr().err
