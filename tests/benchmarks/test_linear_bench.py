"""The linear bench times the kernel and oneDNN on the same inputs, at every shape and row count asked."""

from __future__ import annotations

import pytest
import torch

from benchmarks.linear_bench import bench, layer_shapes, stack_passes, stack_weights

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_shapes_are_the_models_linears() -> None:
    assert layer_shapes("small") == [("qkv", 384, 256), ("o", 256, 256), ("gate_up", 1536, 256),
                                     ("down", 256, 768), ("lm_head", 8192, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_shape_and_row_count_is_timed(dtype: torch.dtype) -> None:
    results = bench([("tiny", 24, 16)], [1, 9], dtype, repeats=2)
    assert [(label, rows) for label, rows, _, _ in results] == [("tiny 24 x 16", 1), ("tiny 24 x 16", 9)]
    assert all(kernel > 0 and onednn > 0 for _, _, kernel, onednn in results)


def test_stack_weights_are_a_decode_steps_linears_in_order() -> None:
    weights = stack_weights("small", torch.bfloat16)
    assert [tuple(w.shape) for w in weights] == [(384, 256), (256, 256), (1536, 256), (256, 768)] * 4 + [(8192, 256)]
    assert all(w.dtype == torch.bfloat16 for w in weights)


def test_a_stack_pass_is_timed_against_the_bandwidth_measured_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    weights = [torch.randn(24, 16), torch.randn(8, 24)]
    events: list[str] = []
    kernel = torch.ops.spindle.linear_small_m

    def counted(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        events.append(f"{x.shape[0]} rows")
        return kernel(x, w, bias)

    monkeypatch.setattr(torch.ops.spindle, "linear_small_m", counted)
    passes = stack_passes(weights, [1, 3], rounds=2, repeats=2,
                          bandwidth=lambda: events.append("bandwidth") or 1e9)
    one_row, three_rows = ["bandwidth"] + ["1 rows"] * 4, ["bandwidth"] + ["3 rows"] * 4  # 2 passes of 2 weights
    assert events == (one_row + three_rows) * 2
    assert [p.rows for p in passes] == [1, 3, 1, 3]
    assert all(p.weight_bytes == (24 * 16 + 8 * 24) * 4 and p.read_bytes_per_s == 1e9 for p in passes)
    assert all(0 < p.seconds < 1 and p.fraction == p.weight_bytes / p.seconds / 1e9 for p in passes)
