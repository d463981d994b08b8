"""Pooling rounds shared by the encoder tests: requests of very different lengths in one batch,
and the pooled vectors a worker returns for them."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.step_output import PooledStep
from services.worker.worker import Worker
from shared.execute import ExecuteRound, PoolingRequestData
from shared.types import RequestKind

LENS = [1, 200, 3, 64, 17, 2]  # very different lengths in one batch


def pooling_requests(kind: RequestKind) -> list[PoolingRequestData]:
    gen = np.random.default_rng(1)
    return [
        PoolingRequestData(f"r{i}", kind, gen.integers(5, 1000, n).tolist(), [], False) for i, n in enumerate(LENS)
    ]


def pooled_vectors(worker: Worker, requests: list[PoolingRequestData]) -> torch.Tensor:
    steps: list[PooledStep] = []
    worker.runner.execute_round(ExecuteRound(0, pooling_requests=requests), steps.append)
    assert steps[0].values is not None
    return steps[0].values
