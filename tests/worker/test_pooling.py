"""Pooling over a hand-made packed batch, normalisation, and the sentence-transformers config rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.pooling import (
    PoolingMetadata,
    PoolingMethod,
    load_pooling_config,
    normalize_rows,
    pool,
)
from shared.types import RequestKind

# Three sequences of lengths 2, 1, 3 packed back to back; token t has hidden [t, 10 t].
LENS = [2, 1, 3]
HIDDEN = torch.tensor([[float(t), 10.0 * t] for t in range(6)])
META = PoolingMetadata(
    query_start_loc=torch.tensor([0, 2, 3, 6]),
    seq_lens=torch.tensor(LENS),
    token_to_req=torch.tensor([0, 0, 1, 2, 2, 2]),
)


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        (PoolingMethod.CLS, [[0, 0], [2, 20], [3, 30]]),
        (PoolingMethod.LAST, [[1, 10], [2, 20], [5, 50]]),
        (PoolingMethod.MEAN, [[0.5, 5], [2, 20], [4, 40]]),
    ],
)
def test_pool_each_sequence_of_a_packed_batch(method: PoolingMethod, expected: list[list[float]]) -> None:
    out = pool(HIDDEN, method, META)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32))


def test_mean_pooling_accumulates_low_precision_inputs_in_float32() -> None:
    hidden = torch.full((6, 2), 1.0 / 3.0, dtype=torch.bfloat16)
    out = pool(hidden, PoolingMethod.MEAN, META)
    torch.testing.assert_close(out, torch.full((3, 2), float(hidden[0, 0])), rtol=0, atol=1e-7)


def test_normalize_rows_only_where_asked() -> None:
    values = torch.tensor([[3.0, 4.0], [3.0, 4.0], [0.0, 0.0]])
    out = normalize_rows(values, torch.tensor([True, False, True]))
    torch.testing.assert_close(out, torch.tensor([[0.6, 0.8], [3.0, 4.0], [0.0, 0.0]]))  # zero stays finite


def _write_st(root: Path, pooling: dict, modules: list[str] | None = None, max_seq_length: int | None = None) -> Path:
    names = modules or ["Transformer", "Pooling", "Normalize"]
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    entries = [
        {"idx": i, "name": str(i), "path": paths[n], "type": f"sentence_transformers.models.{n}"}
        for i, n in enumerate(names)
    ]
    (root / "modules.json").write_text(json.dumps(entries))
    (root / "1_Pooling").mkdir(exist_ok=True)
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8} | pooling))
    if max_seq_length is not None:
        (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return root


@pytest.mark.parametrize(
    ("pooling", "method"),
    [
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, PoolingMethod.MEAN),
        ({"pooling_mode_cls_token": True}, PoolingMethod.CLS),
        ({"pooling_mode_lasttoken": True}, PoolingMethod.LAST),
        ({"pooling_mode": "lasttoken"}, PoolingMethod.LAST),  # sentence-transformers >= 5 format
        ({"pooling_mode": ["cls"]}, PoolingMethod.CLS),
        ({}, PoolingMethod.MEAN),  # no mode set: sentence-transformers' default
    ],
)
def test_sentence_transformers_pooling_mode_is_honoured(tmp_path: Path, pooling: dict, method: PoolingMethod) -> None:
    config = load_pooling_config(_write_st(tmp_path, pooling, max_seq_length=128), RequestKind.EMBED)
    assert (config.method, config.max_seq_length) == (method, 128)


def test_defaults_without_sentence_transformers_files_and_for_cross_encoders(tmp_path: Path) -> None:
    assert load_pooling_config(tmp_path, RequestKind.EMBED).method is PoolingMethod.CLS
    _write_st(tmp_path, {"pooling_mode_mean_tokens": True}, max_seq_length=64)
    score = load_pooling_config(tmp_path, RequestKind.SCORE)  # the classifier reads the first token
    assert (score.method, score.max_seq_length) == (PoolingMethod.CLS, 64)


@pytest.mark.parametrize(
    ("pooling", "modules", "message"),
    [
        ({"pooling_mode_max_tokens": True}, None, "unsupported sentence-transformers pooling \\['max'\\]"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, None, "exactly one of"),
        ({"pooling_mode_mean_tokens": True}, ["Transformer", "Pooling", "Dense"], "module .*Dense"),
        ({"pooling_mode_mean_tokens": True}, ["Transformer"], "has no Pooling module"),
    ],
)
def test_unreproducible_sentence_transformers_pipelines_are_rejected(
    tmp_path: Path, pooling: dict, modules: list[str] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_pooling_config(_write_st(tmp_path, pooling, modules), RequestKind.EMBED)
