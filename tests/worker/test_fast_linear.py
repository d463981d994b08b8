"""The small-M linear kernel equals F.linear (fp32 and bf16 weights, with and without bias, every
row count and odd shapes), and FastLinear uses it only up to the row count calibration chose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.kernels.build import KernelBuildError, load_kernels
from services.worker.models.fast_linear import FastLinear, calibrate


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    try:
        load_kernels()
    except KernelBuildError as exc:
        pytest.skip(f"kernels unavailable: {exc}")


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 64, 32), (3, 37, 19), (4, 8, 8), (7, 130, 67), (16, 96, 256), (33, 5, 9)])
def test_kernel_equals_f_linear(rows: int, out_features: int, in_features: int, weight_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen)
    for b in (bias, None):
        want = F.linear(x, weight.float(), b)
        got = torch.ops.spindle.linear_small_m(x, weight, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_fast_linear_routes_by_the_calibrated_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = FastLinear(48, 24)
    calls = []
    real = torch.ops.spindle.linear_small_m

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(torch.ops.spindle, "linear_small_m", spy)
    layer.kernel_max_rows = 4
    with torch.inference_mode():
        for shape in ((2, 48), (1, 3, 48), (5, 48)):
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [2, 3], "inputs of up to 4 rows (3-d flattened) take the kernel, 5 rows do not"


def test_calibrate_sets_every_layer_of_a_shape_alike() -> None:
    model = torch.nn.Sequential(FastLinear(64, 64), FastLinear(64, 64), FastLinear(64, 128))
    chosen = calibrate(model)
    assert set(chosen) == {(64, 64), (128, 64)}
    assert model[0].kernel_max_rows == model[1].kernel_max_rows == chosen[(64, 64)]
