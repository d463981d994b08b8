"""`shared.ports.free_port`: free now, and outside the range outgoing connections draw from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shared import ports


def test_ports_are_free_and_outside_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert ports.is_free(port)
        if low - ports.LOWEST_PORT >= 1000:  # Linux's default range leaves 10000-32767 below it
            assert not low <= port <= high


def test_a_run_of_ports_is_free_as_a_whole() -> None:
    base = ports.free_port(count=3)
    assert all(ports.is_free(p) for p in range(base, base + 3))


def test_a_port_in_use_is_not_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not ports.is_free(sock.getsockname()[1])


def test_no_room_outside_the_range_falls_back_to_the_kernels_choice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wide = tmp_path / "range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", wide)
    assert ports.ephemeral_range() == (1024, 65535)
    assert ports.is_free(ports.free_port())
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == ports.LINUX_DEFAULT_EPHEMERAL


def test_distinct_ports_skip_each_other_and_the_excluded(monkeypatch: pytest.MonkeyPatch) -> None:
    picks = iter([20001, 20001, 20002, 20003, 20004])  # a repeat, then a port promised elsewhere
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": next(picks))
    assert ports.distinct_free_ports(3, frozenset({20002})) == [20001, 20003, 20004]
