"""Fixtures for end-to-end tests: tiny checkpoints built once per session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.tiny_models import TinyModelSpec, build_model

FAMILY_SPECS = {
    "llama": TinyModelSpec(family="llama", seed=1),
    # A window shorter than most prompts, so sliding-window attention really matters.
    "mistral": TinyModelSpec(family="mistral", sliding_window=16, seed=2),
    "qwen2": TinyModelSpec(family="qwen2", seed=3),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: build_model(root / f"tiny-{family}", spec) for family, spec in FAMILY_SPECS.items()}
