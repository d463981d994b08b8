"""SchedulerConfig validation and the entry point's flags / SPINDLE_* env defaults."""

from __future__ import annotations

import argparse

import pytest

from services.scheduler import __main__ as entry
from services.scheduler.config import SchedulerConfig


def _parse(argv: list[str]) -> SchedulerConfig:
    parser = argparse.ArgumentParser()
    entry.add_arguments(parser)
    return entry.config_from_args(parser.parse_args(argv))


def test_defaults() -> None:
    config = _parse([])
    assert config.listen == "0.0.0.0:50052" and config.worker_addresses == ("127.0.0.1:50061",)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.num_scheduler_steps) == (256, 2048, 8)
    assert config.enable_prefix_caching and not config.enable_priority_preemption
    assert config.max_inflight_rounds == 2


def test_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_WORKER_ADDRS", "a:1, b:2")
    monkeypatch.setenv("SPINDLE_SCHEDULER_LISTEN", "127.0.0.1:7000")
    monkeypatch.setenv("SPINDLE_ENABLE_PREFIX_CACHING", "false")
    config = _parse(["--num-scheduler-steps", "8", "--enable-priority-preemption", "--max-num-seqs", "32"])
    assert config.worker_addresses == ("a:1", "b:2") and config.listen == "127.0.0.1:7000"
    assert config.num_scheduler_steps == 8 and config.max_num_seqs == 32
    assert not config.enable_prefix_caching and config.enable_priority_preemption
    assert _parse(["--workers-addr", "c:3"]).worker_addresses == ("c:3",)


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps",
                                   "max_scheduler_steps", "max_inflight_rounds"])
def test_rejects_non_positive_limits(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: 0})


def test_round_target_from_flag_and_env_and_never_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (_parse([]).round_target_ms, _parse([]).max_scheduler_steps) == (24.0, 32)
    monkeypatch.setenv("SPINDLE_ROUND_TARGET_MS", "0")
    assert _parse([]).round_target_ms == 0.0
    config = _parse(["--round-target-ms", "12.5", "--max-scheduler-steps", "16"])
    assert (config.round_target_ms, config.max_scheduler_steps) == (12.5, 16)
    with pytest.raises(ValueError, match="round_target_ms"):
        SchedulerConfig(round_target_ms=-1.0)


def test_rejects_empty_worker_list() -> None:
    with pytest.raises(ValueError, match="worker"):
        SchedulerConfig(worker_addresses=())
