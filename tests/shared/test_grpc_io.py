"""SPINDLE_GRPC_EVENT_ENGINE: gRPC's epoll polling by default, its EventEngine on request, and an
operator's own GRPC_EXPERIMENTS untouched; the services' processes really start with it."""

from __future__ import annotations

import os
import subprocess
import sys

from shared.grpc_io import ENV, LEGACY_POLLING_EXPERIMENTS, configure_grpc_io


def test_epoll_polling_by_default_turns_the_event_engine_client_and_listener_off() -> None:
    for environ in ({}, {ENV: "0"}, {ENV: ""}):
        assert configure_grpc_io(environ) == LEGACY_POLLING_EXPERIMENTS
        assert environ["GRPC_EXPERIMENTS"] == "-event_engine_client,-event_engine_listener"


def test_event_engine_on_request_and_operator_setting_kept() -> None:
    on_request = {ENV: "1"}
    assert configure_grpc_io(on_request) is None and "GRPC_EXPERIMENTS" not in on_request
    own = {ENV: "0", "GRPC_EXPERIMENTS": "event_engine_client"}
    assert configure_grpc_io(own) is None and own["GRPC_EXPERIMENTS"] == "event_engine_client"


def test_a_service_module_sets_it_before_grpc_starts() -> None:
    """Importing any service module (what `python -m services.<name>` does first) applies it."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", ENV)}
    code = ("import os; "
            "import services.scheduler.config; print(os.environ['GRPC_EXPERIMENTS'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == LEGACY_POLLING_EXPERIMENTS
