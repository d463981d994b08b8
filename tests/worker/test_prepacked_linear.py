"""PrepackedLinear: the oneDNN path equals F.linear, follows weight changes, and falls back cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.prepacked_linear import PrepackedLinear, use_bf16_inputs
from tests.worker.onednn_marks import needs_onednn, needs_onednn_bf16


def _layer(in_features: int = 48, out_features: int = 80) -> PrepackedLinear:
    torch.manual_seed(0)
    return PrepackedLinear(in_features, out_features)


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (300, 48), (2, 5, 48)])
def test_matches_f_linear_at_any_row_count(shape: tuple[int, ...]) -> None:
    layer = _layer()
    x = torch.randn(*shape)
    with torch.inference_mode():
        out = layer(x)
    assert layer.onednn.packed is not None  # the oneDNN path ran
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_strided_input_and_weight_updates() -> None:
    layer = _layer()
    fused = torch.randn(20, 3 * 48)
    x = fused[:, 48:96]  # a column slice of a fused projection, rows not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            layer.weight.mul_(-2.0)  # e.g. the loader copying a checkpoint in after a first call
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@needs_onednn
# oneDNN's fused post-op, F.gelu after F.linear
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
def test_fused_gelu_is_exact_gelu_of_the_projection(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = PrepackedLinear(48, 80, gelu=True).to(dtype)
    x = torch.randn(300, 48, dtype=dtype) * 2
    with torch.inference_mode():
        out = layer(x)
    assert layer.onednn.packed is not None and layer.onednn.packed.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, F.gelu(F.linear(x, layer.weight, layer.bias)), atol=tol, rtol=tol)
    assert (out < 0).any() and out.min() >= -0.2  # GELU's negative lobe, not a plain projection


def test_other_dtypes_keep_f_linear() -> None:
    layer = _layer().to(torch.float16)
    x = torch.randn(4, 48, dtype=torch.float16)
    with torch.inference_mode():
        out = layer(x)
    assert layer.onednn.packed is None
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))


def test_checkpoint_names_are_nn_linear_names() -> None:
    assert set(_layer().state_dict()) == set(nn.Linear(48, 80).state_dict()) == {"weight", "bias"}


@needs_onednn_bf16
@pytest.mark.parametrize("gelu", [False, True])
def test_bf16_inputs_run_the_bf16_gemm_and_return_float32(gelu: bool) -> None:
    """float32 in and out; in between the bf16 GEMM on rounded inputs, as a bf16 layer computes it."""
    torch.manual_seed(0)
    layer = PrepackedLinear(48, 80, gelu=gelu)
    assert use_bf16_inputs(nn.Sequential(layer, nn.ReLU())) == 1 and layer.bf16_inputs
    x = torch.randn(300, 48)
    with torch.inference_mode():
        out = layer(x)
        bf16_layer = PrepackedLinear(48, 80, gelu=gelu).to(torch.bfloat16)
        bf16_layer.load_state_dict(layer.state_dict())
        expected = bf16_layer(x.to(torch.bfloat16)).float()
    packed = layer.onednn.packed
    assert out.dtype == torch.float32 and packed is not None and packed.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    reference = F.linear(x, layer.weight, layer.bias)
    reference = F.gelu(reference) if gelu else reference
    torch.testing.assert_close(out, reference, atol=5e-2, rtol=2e-2)  # bf16's 8-bit mantissa, not float32's
    assert not torch.equal(out, reference)


@needs_onednn
def test_bf16_inputs_hand_a_bf16_result_on_unwidened_with_the_same_values() -> None:
    """`widen=False` gives the bf16 result as it is; a next bf16-input layer takes it as the float32 it
    would have rounded (an encoder MLP's two GEMMs), and the bias is rounded once, again when it changes."""
    torch.manual_seed(0)
    up, down = PrepackedLinear(48, 80, gelu=True), PrepackedLinear(80, 48)
    use_bf16_inputs(nn.Sequential(up, down))
    x = torch.randn(20, 48)
    with torch.inference_mode():
        half = up(x, widen=False)
        assert half.dtype == torch.bfloat16 and torch.equal(half.float(), up(x))
        assert torch.equal(down(half), down(half.float()))
        rounded = down.onednn._rounded_bias(down.bias)
        assert rounded is down.onednn._rounded_bias(down.bias) and torch.equal(rounded, down.bias.to(torch.bfloat16))
        before = down(half)
    with torch.no_grad():
        down.bias.add_(1.0)  # a new value: rounded again, and the layer computes with it
    with torch.inference_mode():
        assert torch.equal(down.onednn._rounded_bias(down.bias), down.bias.to(torch.bfloat16))
        torch.testing.assert_close(down(half), before + 1.0, atol=2e-2, rtol=0)  # within bf16's rounding


def test_row_buckets_bound_the_gemm_sizes() -> None:
    """Every row count maps to a bucket at least as large, one step at most above it; few buckets in all."""
    from services.worker.models.prepacked_linear import bucket_rows

    assert [bucket_rows(r) for r in (0, 1, 5, 8, 9, 16, 17, 256, 257, 1024, 1025, 4096, 4097, 8192)] == [
        0, 1, 5, 8, 16, 16, 24, 256, 288, 1024, 1152, 4096, 4608, 8192]
    buckets = [bucket_rows(r) for r in range(1, 8193)]
    assert all(r <= b for r, b in zip(range(1, 8193), buckets, strict=True))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= 100  # within oneDNN's cache of 1,024 GEMMs, a few weights over


@needs_onednn
@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_onednn_bf16)])
@pytest.mark.parametrize("gelu", [False, True])
def test_gemm_runs_at_bucketed_rows_and_returns_the_real_ones(
        monkeypatch: pytest.MonkeyPatch, gelu: bool, bf16: bool) -> None:
    """Rows zero-padded to their bucket, the real rows' results as without the padding: the same
    values as F.linear (bf16: as at the unpadded size), contiguous, shaped as the input."""
    import services.worker.models.prepacked_linear as pl

    layer = PrepackedLinear(48, 80, gelu=gelu)
    if bf16:
        use_bf16_inputs(nn.Sequential(layer))
    with torch.inference_mode():
        layer(torch.randn(2, 48))  # packs the weight (its probe is a GEMM too)
    seen: list[int] = []
    real = pl._packed_linear

    def recording(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(pl, "_packed_linear", recording)
    torch.manual_seed(1)
    for shape in [(9, 48), (130, 48), (3, 100, 48), (300, 48)]:
        x = torch.randn(*shape)
        seen.clear()
        with torch.inference_mode():
            out = layer(x)
            monkeypatch.setattr(pl, "ROW_BUCKETS_ON", False)
            unpadded = layer(x)
            monkeypatch.setattr(pl, "ROW_BUCKETS_ON", True)
        rows = x.numel() // 48
        assert seen == [pl.bucket_rows(rows), rows]  # padded, then (switched off) as it is
        assert out.shape == (*shape[:-1], 80) and out.is_contiguous()
        torch.testing.assert_close(out, unpadded, atol=2e-2 if bf16 else 1e-5, rtol=1e-2 if bf16 else 1e-5)
        reference = F.linear(x, layer.weight, layer.bias)
        reference = F.gelu(reference) if gelu else reference
        tol = 5e-2 if bf16 else 1e-5
        torch.testing.assert_close(out, reference, atol=tol, rtol=tol)


@needs_onednn_bf16
def test_build_gemms_runs_each_distinct_layer_at_every_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers alike (shape, GELU, bf16 inputs, bias) share oneDNN's GEMMs: one is run per bucket,
    through the layer's own forward (a bf16-input layer's GEMM on bf16 rows, as in a forward pass)."""
    import services.worker.models.prepacked_linear as pl

    model = nn.Sequential(PrepackedLinear(48, 80), PrepackedLinear(48, 80), PrepackedLinear(80, 48, gelu=True))
    use_bf16_inputs(model[2])
    with torch.inference_mode():
        model[0](torch.randn(2, 48))  # packed already: their probes are not counted
        model[2](torch.randn(2, 80))
    seen: list[tuple[int, int, torch.dtype]] = []
    real = pl._packed_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append((x.shape[0], x.shape[1], x.dtype))
        return real(x, packed, *args)

    monkeypatch.setattr(pl, "_packed_linear", recording)
    num_gemms, seconds = pl.build_gemms(model, 20, torch.float32)
    sizes = [*range(1, 9), 16, 24]
    assert num_gemms == 2 * len(sizes) and seconds >= 0
    assert sorted(r for r, k, _ in seen if k == 48) == sizes  # the two alike layers: once per bucket
    assert sorted(r for r, k, _ in seen if k == 80) == sizes
    assert {d for _, k, d in seen if k == 80} == {torch.bfloat16}  # rounded, as the forward rounds it
    assert {d for _, k, d in seen if k == 48} == {torch.float32}
    seen.clear()
    assert pl.build_gemms(model, 10_000, torch.float32)[0] == 2 * len({pl.bucket_rows(r) for r in range(1, 513)})
    assert max(r for r, _, _ in seen) == pl.BUILD_MAX_ROWS  # capped: a long-context model starts in time
    assert pl.build_gemms(model, 20, torch.float16) == (0, 0.0)  # no packed copy for these inputs: nothing
    monkeypatch.setattr(pl, "ROW_BUCKETS_ON", False)
    assert pl.build_gemms(model, 20, torch.float32) == (0, 0.0)


@needs_onednn
def test_bucketed_bf16_result_handed_on_unwidened(monkeypatch: pytest.MonkeyPatch) -> None:
    """`widen=False` under bf16 inputs at a padded row count: the real rows' bf16 result, which the
    next layer takes as it is, the same values as at the unpadded size."""
    import services.worker.models.prepacked_linear as pl

    up, down = PrepackedLinear(48, 80, gelu=True), PrepackedLinear(80, 48)
    use_bf16_inputs(nn.Sequential(up, down))
    x = torch.randn(13, 48)
    with torch.inference_mode():
        half = up(x, widen=False)
        out = down(half)
        monkeypatch.setattr(pl, "ROW_BUCKETS_ON", False)
        expected = down(up(x, widen=False))
    assert half.dtype == torch.bfloat16 and half.shape == (13, 80)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=1e-2)
