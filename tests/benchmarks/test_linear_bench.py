"""The linear bench times the kernel and oneDNN on the same inputs, at every shape and row count asked."""

from __future__ import annotations

import pytest
import torch

from benchmarks.linear_bench import bench, layer_shapes

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_shapes_are_the_models_linears() -> None:
    assert layer_shapes("small") == [("qkv", 384, 256), ("o", 256, 256), ("gate_up", 1536, 256),
                                     ("down", 256, 768), ("lm_head", 8192, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_shape_and_row_count_is_timed(dtype: torch.dtype) -> None:
    results = bench([("tiny", 24, 16)], [1, 9], dtype, repeats=2)
    assert [(label, rows) for label, rows, _, _ in results] == [("tiny 24 x 16", 1), ("tiny 24 x 16", 9)]
    assert all(kernel > 0 and onednn > 0 for _, _, kernel, onednn in results)
