"""The worker sets OpenMP's spin count for prefill-only models before torch loads (openmp_wait.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.models import MODEL_REGISTRY, is_prefill_only, resolve_model
from services.worker.openmp_wait import PREFILL_ONLY_SPIN_COUNT, WAIT_POLICY_VARIABLES, configure_openmp_wait
from shared.types import RequestKind

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter runs the worker's entry point `serve` with the torch-importing service module
# replaced by one that reports what it would start under: GOMP_SPINCOUNT, and whether torch was
# already loaded (it must not be, or libgomp has read its settings before they were chosen).
PROBE = """
import asyncio, os, sys, types
import services.worker
service = types.ModuleType("services.worker.service")
async def serve(config):
    print(os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
service.serve = serve
sys.modules["services.worker.service"] = services.worker.service = service
from services.worker.__main__ import serve as entry_point
from services.worker.config import WorkerConfig
asyncio.run(entry_point(WorkerConfig(model=sys.argv[1], listen="127.0.0.1:0")))
"""


def _started_under(model_dir: Path | str, **env: str) -> tuple[str, str]:
    """(GOMP_SPINCOUNT, torch loaded) as the worker's service would start for `model_dir`."""
    clean = {k: v for k, v in os.environ.items() if k not in WAIT_POLICY_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], cwd=REPO, capture_output=True, text=True,
                         check=True, env=clean | env)
    spin, torch_loaded = out.stdout.split()
    return spin, torch_loaded


def test_prefill_only_models_start_with_a_short_spin_before_torch_loads(minilm_dir: Path,
                                                                        cross_encoder_dir: Path) -> None:
    assert _started_under(minilm_dir) == (str(PREFILL_ONLY_SPIN_COUNT), "False")
    assert _started_under(cross_encoder_dir) == (str(PREFILL_ONLY_SPIN_COUNT), "False")


def test_decoders_keep_openmps_default(llama_dir: Path) -> None:
    assert _started_under(llama_dir) == ("None", "False")


def test_the_operators_setting_wins(minilm_dir: Path) -> None:
    assert _started_under(minilm_dir, GOMP_SPINCOUNT="300000") == ("300000", "False")
    assert _started_under(minilm_dir, OMP_WAIT_POLICY="active") == ("None", "False")


def test_an_unreadable_model_directory_is_left_to_the_loader(tmp_path: Path) -> None:
    assert _started_under(tmp_path / "missing") == ("None", "False")


def test_too_late_once_torch_is_loaded(minilm_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    for name in WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert "torch" in sys.modules  # this test process imported it
    with caplog.at_level(logging.WARNING):
        assert configure_openmp_wait(str(minilm_dir)) is None
    assert "GOMP_SPINCOUNT" not in os.environ
    assert "would not take effect" in caplog.text


@pytest.mark.parametrize("architecture", sorted(MODEL_REGISTRY))
def test_prefill_only_matches_each_model_classs_task(architecture: str) -> None:
    model_class, _, _ = resolve_model(architecture)
    assert is_prefill_only(architecture) == (model_class.task is not RequestKind.GENERATE)


def test_an_unregistered_architecture_is_not_prefill_only() -> None:
    assert not is_prefill_only("GPT2LMHeadModel")
