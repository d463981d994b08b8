"""`spindle serve`'s configuration checks (services/launcher.py ServeConfig)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.launcher import ServeConfig


@pytest.mark.parametrize("workers", [1, 3])
def test_metrics_ports_may_end_at_the_last_port(tmp_path: Path, workers: int) -> None:
    """Frontend at --metrics-port, scheduler +1, worker i at +2+i: the highest base leaves the last
    worker on 65535 (benchmarks.peer_bench drew 65533 for one worker and the check refused it)."""
    highest = 65535 - 1 - workers
    assert ServeConfig(model=str(tmp_path), num_workers=workers, metrics_port=highest).metrics_port == highest
    with pytest.raises(ValueError, match="leaves no room"):
        ServeConfig(model=str(tmp_path), num_workers=workers, metrics_port=highest + 1)
