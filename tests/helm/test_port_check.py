"""The wiring test's check that the chart's ports are free: it waits out a connection that holds one briefly."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from shared.ports import free_port
from tests.helm.cluster import LocalCluster, WiringError


def _release_with_port(port: int) -> SimpleNamespace:
    pod = SimpleNamespace(name="pod-0", container={"ports": [{"containerPort": port, "name": "grpc"}]})
    return SimpleNamespace(pods=[pod])


def test_a_port_held_for_a_moment_is_waited_for() -> None:
    port = free_port()
    holder = socket.create_server(("127.0.0.1", port))
    threading.Timer(0.8, holder.close).start()
    started = time.monotonic()
    LocalCluster.check_ports_free(_release_with_port(port), wait_s=10.0)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.5


def test_a_port_held_past_the_wait_is_named_in_the_error() -> None:
    port = free_port()
    with socket.create_server(("127.0.0.1", port)), pytest.raises(WiringError, match=f"port {port} \\(pod-0 grpc\\)"):
        LocalCluster.check_ports_free(_release_with_port(port), wait_s=0.6)  # type: ignore[arg-type]
