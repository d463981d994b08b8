"""spindle's argmax kernel (kernels/csrc/argmax.cpp) picks the index torch.argmax picks.

Rows of any width (vector body and scalar tail), ties (the first index), NaN (the first NaN),
rows of -inf only, non-contiguous input; and a Sampler using the kernel samples exactly what
one using torch.argmax does, greedy and seeded random rows alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.sampler import Sampler
from services.worker.sampling_state import SamplingState
from shared.execute import NewRequestData
from shared.sampling import SamplingOptions

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _check(x: torch.Tensor) -> None:
    got = torch.ops.spindle.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 64, 1000, 8192])
def test_random_rows(rows: int, width: int) -> None:
    _check(torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width)))


def test_ties_take_the_first_index() -> None:
    x = torch.zeros(4, 37)
    x[0, [3, 20]] = 5.0  # both in vector bodies
    x[1, [30, 36]] = 5.0  # one in the tail
    x[2, :] = 1.0  # every element ties
    x[3, [0, 8]] = -0.0  # -0.0 == 0.0: index 0
    _check(x)


def test_nan_wins_as_in_torch() -> None:
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    x[0, 17] = float("nan")
    x[1, [5, 39]] = float("nan")
    x[2, 39] = float("nan")  # only in the scalar tail
    x[2, 0] = float("inf")
    _check(x)


def test_rows_of_minus_inf_only() -> None:
    x = torch.full((2, 19), float("-inf"))
    x[1, 11] = -1e30
    _check(x)


def test_non_contiguous_input() -> None:
    x = torch.randn(24, 50, generator=torch.Generator().manual_seed(3))
    _check(x[::2, 1:])


def test_rejects_what_it_does_not_serve() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.spindle.argmax_rows(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows, n"):
        torch.ops.spindle.argmax_rows(torch.zeros(4))


def test_sampler_with_the_kernel_samples_as_with_torch() -> None:
    vocab = 300
    options = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.8, top_k=40),
               SamplingOptions(temperature=1.0, seed=5), SamplingOptions(temperature=0.0)]
    picks = []
    for kernel in (False, True):
        state = SamplingState(vocab, (1,), torch.device("cpu"))
        for row, opts in enumerate(options):
            state.add(row, NewRequestData(f"r{row}", [5, 6, 7], 3, 0, [0], opts))
        sampler = Sampler(state.penalty_tables, torch.Generator().manual_seed(11), argmax_kernel=kernel)
        md = state.build(np.arange(len(options)))
        logits = torch.randn(5, len(options), vocab, generator=torch.Generator().manual_seed(2))
        picks.append([sampler(logits[step].clone(), md, step=step).token_ids for step in range(5)])
    for without, with_kernel in zip(*picks, strict=True):
        assert torch.equal(without, with_kernel)
