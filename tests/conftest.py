"""Fixtures every test folder may use: spindle's CPU kernels (a test of one skips where they cannot be built)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """spindle's CPU kernels loaded (built first if need be), else the test is skipped."""
    from services.worker.kernels.build import KernelBuildError, load_kernels  # torch: only for tests that ask

    try:
        load_kernels()
    except KernelBuildError as exc:
        pytest.skip(f"kernels unavailable: {exc}")
