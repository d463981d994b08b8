"""The small-M linear kernel equals F.linear (fp32 and bf16 weights, with and without bias, every
row count and odd shapes), and FastLinear uses it only at the row counts calibration chose;
past it, float32 weights run on a oneDNN-packed copy that follows weight changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker.models import fast_linear
from services.worker.models.fast_linear import (
    PROBE_ROWS,
    FastLinear,
    ProbeTimes,
    calibrate,
    describe_rows,
    inflated_probes,
    kernel_row_table,
    probe_times,
    round_max_rows,
    rows_within,
    store_weights_as,
)
from tests.worker.onednn_marks import needs_onednn, needs_onednn_bf16

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 64, 32), (1, 130, 75), (1, 3, 5), (1, 200, 1024),
                          (3, 37, 19), (4, 8, 8), (7, 130, 67), (16, 96, 256), (33, 5, 9),
                          # the AVX-512 few-rows tiles (linear_small_m.cpp): row counts 2-11, and
                          # up to 27 on rows of 512+ values, in row blocks of up to 8, one feature
                          # a tile up to 3 rows, features past the last block of 3, K not a
                          # multiple of 16
                          (2, 130, 75), (5, 103, 40), (6, 64, 300), (11, 37, 40), (8, 20, 33),
                          (9, 8, 1024), (10, 14, 16), (17, 40, 600), (27, 31, 520), (12, 40, 512),
                          (16, 41, 512), (5, 2, 40), (6, 1, 33),
                          # the AVX-512 kernel's edges (linear_mid_m.cpp): partial row groups and
                          # tiles, features past a 96-wide block, K not a multiple of 16
                          (12, 97, 19), (12, 40, 511), (17, 200, 75), (28, 50, 520), (64, 385, 300), (65, 100, 33),
                          (130, 50, 16)])
def test_kernel_equals_f_linear(rows: int, out_features: int, in_features: int, weight_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen)
    for b in (bias, None):
        want = F.linear(x, weight.float(), b)
        got = torch.ops.spindle.linear_small_m(x, weight, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(8, 97, 19), (12, 97, 19), (16, 96, 256), (17, 200, 75), (64, 385, 300), (65, 100, 33),
                          (130, 50, 16), (64, 24, 1), (2, 97, 19), (3, 8, 1), (4, 130, 75), (6, 64, 33), (7, 41, 300),
                          (10, 9, 70), (20, 41, 601), (27, 41, 520), (28, 97, 520), (2, 97, 75), (3, 41, 601),
                          (8, 97, 75), (16, 41, 520), (24, 40, 512), (12, 40, 512), (12, 40, 511), (5, 2, 40)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_bf16_activations_and_weights_match_a_float64_reference(rows: int, out_features: int, in_features: int,
                                                                 weight_dtype: torch.dtype) -> None:
    """A --dtype bfloat16 model's linear layers: bf16 x and W (on AVX512-BF16 the tiles take k in
    pairs, vdpbf16ps, from x's rows as they lie, from 2 rows on; odd K pairs its last k with zero), or bf16 x and
    fp32 W (x widened as it is transposed); within one bf16 rounding of the exact result, as a
    native bf16 GEMM is."""
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    for b in (bias, None):
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = torch.ops.spindle.linear_small_m(x, weight, b)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5 * in_features)


@pytest.mark.parametrize("pairs", [True, False])
def test_one_bf16_row_is_within_a_rounding_on_either_path(pairs: bool) -> None:
    """One row of bf16 x with bf16 W: on k pairs (weights that fit in the cache) or widened (the
    rest); both within one bf16 rounding of the exact result."""
    gen = torch.Generator().manual_seed(11)
    try:
        torch.ops.spindle.set_one_row_pairs(pairs)
        for out_features, in_features in ((97, 19), (130, 300), (64, 128), (33, 1)):
            x = torch.randn(1, in_features, generator=gen).to(torch.bfloat16)
            weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
            bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
            exact = F.linear(x.double(), weight.double(), bias.double())
            got = torch.ops.spindle.linear_small_m(x, weight, bias)
            torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5 * in_features)
    finally:
        torch.ops.spindle.set_one_row_pairs(False)  # the state before any load turns it on


def test_one_row_pairs_only_for_weights_that_fit_in_half_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.kernels.build import kernel_instruction_sets

    monkeypatch.setattr(fast_linear, "last_level_cache_bytes", lambda: 32 << 20)
    try:
        assert fast_linear.set_one_row_pairs(10 << 20) == ("avx512_bf16" in kernel_instruction_sets()), \
            "fits: on where the build has bf16 math"
        assert not fast_linear.set_one_row_pairs(17 << 20), "past half the cache: widened"
        monkeypatch.setattr(fast_linear, "last_level_cache_bytes", lambda: 0)
        assert not fast_linear.set_one_row_pairs(1 << 20), "cache size unknown: widened"
    finally:
        torch.ops.spindle.set_one_row_pairs(False)


@pytest.mark.parametrize("rows", [1, 2, 5, 11, 27, 28, 64])  # one row, the few-rows tiles, the tens-of-rows kernel
def test_bf16_outputs_are_rounded_in_the_kernel_as_torch_rounds(rows: int) -> None:
    """Each kernel rounds its fp32 sums (bias included) to bf16 as it stores them, bit for bit as
    torch's conversion of the fp32 result does (bf16 x with fp32 W sums exactly as fp32 x does);
    `float_out` gives those rounded values as float32."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 520, generator=gen).to(torch.bfloat16)  # 520: rows long enough for tiles to 27 rows
    bias = torch.randn(130, generator=gen).to(torch.bfloat16)
    for weight_dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(130, 520, generator=gen).to(weight_dtype)
        for b in (bias, None):
            got = torch.ops.spindle.linear_small_m(x, weight, b)
            widened = torch.ops.spindle.linear_small_m(x, weight, b, True)
            assert got.dtype == torch.bfloat16 and widened.dtype == torch.float32
            assert torch.equal(widened, got.float())
            if weight_dtype == torch.float32:
                sums = torch.ops.spindle.linear_small_m(x.float(), weight, None if b is None else b.float())
                assert torch.equal(got, sums.to(torch.bfloat16))


def test_float_output_is_the_layer_output_widened() -> None:
    """FastLinear.float_output (the LM head's logits): self(x).float(), on the kernel and past it."""
    layer = FastLinear(40, 90).to(torch.bfloat16)
    layer.kernel_max_rows = 4
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for rows in (1, 4, 9):
            x = torch.randn(rows, 40, generator=gen).to(torch.bfloat16)
            got = layer.float_output(x)
            assert got.dtype == torch.float32 and torch.equal(got, layer(x).float())
        layer.float()  # float32 activations: the flag changes nothing
        x = torch.randn(3, 40)
        assert torch.equal(layer(x), layer.float_output(x))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_is_the_same_at_any_thread_count(threads: int) -> None:
    """Output features are split across torch's threads: every feature is computed exactly once,
    the same way, whatever the split."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 96, generator=gen)
    weight, bias = torch.randn(1001, 96, generator=gen), torch.randn(1001, generator=gen)  # 1001: uneven shares
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = torch.ops.spindle.linear_small_m(x, weight, bias)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert torch.equal(got, torch.ops.spindle.linear_small_m(x, weight, bias))  # bit for bit at the default count


def _kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every call of the small-M kernel from here on (the kernel still runs)."""
    calls: list[int] = []
    real = torch.ops.spindle.linear_small_m

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, float_out: bool = False) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b, float_out)

    monkeypatch.setattr(torch.ops.spindle, "linear_small_m", spy)
    return calls


def test_fast_linear_routes_by_the_calibrated_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = FastLinear(48, 24)
    calls = _kernel_calls(monkeypatch)
    layer.kernel_max_rows = 4
    with torch.inference_mode():
        for shape in ((2, 48), (1, 3, 48), (5, 48)):
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [2, 3], "inputs of up to 4 rows (3-d flattened) take the kernel, 5 rows do not"


def test_fast_linear_takes_the_kernel_in_its_bands_past_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row counts `kernel_at` marks take the kernel beyond `kernel_max_rows`; the rest the GEMM."""
    layer = FastLinear(48, 24)
    calls = _kernel_calls(monkeypatch)
    monkeypatch.delenv(fast_linear.DISABLE_BANDS_ENV, raising=False)
    layer.kernel_max_rows = 2
    layer.kernel_at = kernel_row_table(tuple((1.0 if r in (32, 64) else 3.0, 2.0) for r in PROBE_ROWS))
    with torch.inference_mode():
        for rows in (1, 3, 31, 32, 40, 64, 65, 300):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [1, 32, 40, 64], "the prefix, then 32-64 rows; not 3, 31, 65 or past the probes"


def test_kernel_row_table_marks_the_probes_it_won_and_the_counts_between_two_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fast_linear.DISABLE_BANDS_ENV, raising=False)
    won = {1, 2, 16, 64, 128}
    table = kernel_row_table(tuple((1.0 if r in won else 2.0, 1.5) for r in PROBE_ROWS))
    assert len(table) == PROBE_ROWS[-1] + 1
    assert describe_rows(table) == "1-2, 16, 64-128", "16 alone: 8 and 32 lost; 65-127 between two wins"
    assert describe_rows(kernel_row_table(((2.0, 2.0),) * len(PROBE_ROWS))) == "none", "a tie is not a win"
    monkeypatch.setenv(fast_linear.DISABLE_BANDS_ENV, "1")
    assert kernel_row_table(((1.0, 2.0),) * len(PROBE_ROWS)) == b"", "switched off: the prefix alone"


def test_calibrate_sets_every_layer_of_a_shape_alike() -> None:
    model = torch.nn.Sequential(FastLinear(64, 64), FastLinear(64, 64), FastLinear(64, 128))
    chosen = calibrate(model)
    assert set(chosen) == {(64, 64, "float32"), (128, 64, "float32")}
    assert model[0].kernel_max_rows == model[1].kernel_max_rows == chosen[(64, 64, "float32")]
    assert model[0].kernel_at == model[1].kernel_at == kernel_row_table(model[0].probe_s)


def _winning_up_to(rows: int, kernel: float = 0.5) -> ProbeTimes:
    """Timings where the kernel takes `kernel` s against the GEMM's 1 s up to `rows`, then 2 s."""
    return tuple((kernel if r <= rows else 2.0, 1.0) for r in PROBE_ROWS)


def test_calibration_is_measured_once_then_read_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A second start reads the stored timings instead of measuring; SPINDLE_RECALIBRATE=1 measures again."""
    path = tmp_path / "build" / "linear_calibration.json"
    monkeypatch.setattr(fast_linear, "calibration_path", lambda: path)
    measured: list[tuple[int, ...]] = []

    def fake_measure(weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = False,
                     dtype: torch.dtype = torch.float32, working_set: int = 0) -> ProbeTimes:
        measured.append(tuple(weight.shape))
        return _winning_up_to(PROBE_ROWS[len(measured)])

    monkeypatch.setattr(fast_linear, "probe_times", fake_measure)
    model = torch.nn.Sequential(FastLinear(64, 64), FastLinear(64, 128, bias=False))
    assert calibrate(model) == {(64, 64, "float32"): 2, (128, 64, "float32"): 4}
    assert model[0].probe_s == _winning_up_to(2), "the timings stay on the layer (for the native stack)"
    assert measured == [(64, 64), (128, 64)] and path.is_file()
    assert calibrate(torch.nn.Sequential(FastLinear(64, 64), FastLinear(64, 32))) == {
        (64, 64, "float32"): 2, (32, 64, "float32"): 8}, "only the new shape is measured"
    assert measured == [(64, 64), (128, 64), (32, 64)]
    monkeypatch.setenv("SPINDLE_RECALIBRATE", "1")
    assert calibrate(model) == {(64, 64, "float32"): 16, (128, 64, "float32"): 32}
    monkeypatch.delenv("SPINDLE_RECALIBRATE")
    assert calibrate(model) == {(64, 64, "float32"): 16, (128, 64, "float32"): 32}, "the new answer was stored"
    assert len(measured) == 5
    bf16 = torch.nn.Sequential(FastLinear(64, 64)).to(torch.bfloat16)
    assert calibrate(bf16, torch.bfloat16) == {(64, 64, "bfloat16"): 64}, "bf16 activations: measured on their own"
    keys = set(json.loads(path.read_text()))
    assert any("x-bfloat16" in k for k in keys) and any("x-bfloat16" not in k for k in keys)
    assert all(k.endswith(" set=0MiB") for k in keys), "the weights the probes cycled through: part of the key"


def _versus(layer: FastLinear) -> str:
    return " vs-onednn" if layer.onednn is not None else ""


@pytest.mark.parametrize("content", ["{not json", '{"64x64 float32 bias threads=2": 8}', "[1, 2]"])
def test_an_unreadable_or_older_calibration_file_is_measured_over(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str) -> None:
    """Not JSON, or an older build's row count instead of timings: measured again and replaced."""
    path = tmp_path / "linear_calibration.json"
    path.write_text(content.replace("threads=2", f"threads={torch.get_num_threads()} set=0MiB"))
    monkeypatch.setattr(fast_linear, "calibration_path", lambda: path)
    monkeypatch.setattr(fast_linear, "probe_times", lambda *args: _winning_up_to(4))
    model = torch.nn.Sequential(FastLinear(64, 64))
    assert calibrate(model) == {(64, 64, "float32"): 4}
    key = f"64x64 float32 bias threads={torch.get_num_threads()}{_versus(model[0])} set=0MiB"  # 16 KiB of weights
    assert json.loads(path.read_text())[key] == [list(t) for t in _winning_up_to(4)]


def test_an_inflated_probe_is_measured_again_and_the_best_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise at start-up only adds time: a GEMM probe far slower than the next larger one's is
    measured again, once here, and the faster of the two looks kept."""
    looks: list[int] = []

    def fake_best_times(fns: tuple, copies: int) -> list[float]:
        rows = PROBE_ROWS[len(looks)] if len(looks) < len(PROBE_ROWS) else 8  # then the second looks
        looks.append(rows)
        spiked = len(looks) == 4  # the first look at 8 rows shared the CPU with something
        return [rows * 1e-6, (100e-6 if spiked else rows * 2e-6)]

    monkeypatch.setattr(fast_linear, "_best_times", fake_best_times)
    times = probe_times(torch.zeros(8, 8), None)
    assert looks == [*PROBE_ROWS, 8], "only the inflated probe is looked at again"
    assert times[PROBE_ROWS.index(8)] == (8e-6, 16e-6)
    assert times == tuple((r * 1e-6, r * 2e-6) for r in PROBE_ROWS)


def test_inflated_probes_are_the_ones_slower_than_more_rows() -> None:
    steady = [(r * 1e-6, r * 2e-6) for r in PROBE_ROWS]
    assert inflated_probes(steady) == []
    one_row_gemm = [(1e-6, 2e-3)] + steady[1:]  # oneDNN at one row: really slow, looked at again
    assert inflated_probes(one_row_gemm) == [0]
    kernel_spike = steady[:5] + [(90e-6, steady[5][1])] + steady[6:]  # 32 rows' kernel above 64 rows'
    assert inflated_probes(kernel_spike) == [5]


def test_rows_where_the_kernel_wins() -> None:
    times = tuple((k, 1.0) for k in (0.5, 0.9, 1.1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5))
    assert rows_within(times) == 2, "the first probe the kernel loses ends it, however it does later"
    assert rows_within(((1.0, 1.0),) * len(PROBE_ROWS)) == 0, "a tie is not a win"


def test_round_rows_come_from_the_layers_summed_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Summed over the layers, the kernel may take up to 30 us a row more than the GEMM."""
    fast, slow = FastLinear(8, 8), FastLinear(8, 8)
    fast.probe_s = tuple((1e-3, 3e-3) for _ in PROBE_ROWS)
    slow.probe_s = tuple((3e-3 if r >= 64 else 0.5e-3, 1e-3) for r in PROBE_ROWS)  # 2 ms behind from 64 rows
    assert round_max_rows([fast, slow]) == PROBE_ROWS[-1], "summed: a tie, within the allowance"
    assert round_max_rows([slow]) == 32, "2 ms behind at 64 rows: more than 64 x 30 us"
    monkeypatch.setenv(fast_linear.ROUND_ALLOWANCE_ENV, "40")
    assert round_max_rows([slow]) == PROBE_ROWS[-1], "2 ms within 64 x 40 us"
    monkeypatch.setenv(fast_linear.ROUND_ALLOWANCE_ENV, "0")
    assert round_max_rows([fast, slow]) == 32, "without the allowance a tie is not a win"
    assert round_max_rows([fast, FastLinear(8, 8)]) == 0, "a layer without timings: no round rows"


@pytest.mark.parametrize("value", ["ten", "-5", "nan"])
def test_a_malformed_round_allowance_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(fast_linear.ROUND_ALLOWANCE_ENV, value)
    with pytest.raises(ValueError, match=fast_linear.ROUND_ALLOWANCE_ENV):
        fast_linear.round_allowance_s()


@needs_onednn
def test_rows_past_the_kernel_run_on_the_onednn_copy_and_follow_weight_changes() -> None:
    layer = FastLinear(48, 24)
    assert fast_linear.prepack([layer]) == 48 * 24 * 4 and layer.onednn is not None
    layer.kernel_max_rows = 2
    x = torch.randn(5, 48)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        packed = layer.onednn.packed
        with torch.no_grad():
            layer.weight.mul_(-2.0)  # the copy must follow (packed again), never serve the old weight
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert layer.onednn.packed is not packed


@needs_onednn
def test_bf16_weights_past_the_kernel_run_on_a_float32_onednn_copy() -> None:
    """Batched steps of a --weight-dtype bfloat16 model: the widened weight, packed once, not a slice per call."""
    layer = FastLinear(48, 24)
    store_weights_as(layer, torch.bfloat16)
    assert fast_linear.prepack([layer]) == 48 * 24 * 4 and layer.onednn is not None
    assert layer.onednn.packed is not None and layer.weight.dtype == torch.bfloat16  # the weight itself stays narrow
    layer.kernel_max_rows = 2
    x = torch.randn(7, 48)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight.float(), layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_bf16_activations_take_the_kernel_and_a_bf16_onednn_copy(rows: int) -> None:
    """--dtype bfloat16: few rows through the kernel (x widened, y rounded back), more through a bf16
    packed copy (native bf16 dot products where the CPU has them); both as F.linear in bf16 rounds."""
    torch.manual_seed(rows)
    layer = FastLinear(96, 40).to(torch.bfloat16)
    assert fast_linear.prepack([layer], torch.bfloat16) == 96 * 40 * 2 and layer.onednn is not None
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    with torch.inference_mode():
        for kernel_rows in (0, 64):
            layer.kernel_max_rows = kernel_rows
            got = layer(x)
            assert got.dtype == torch.bfloat16 and layer.onednn.packed.dtype == torch.bfloat16
            # fp32 sums rounded once: within a bf16 rounding (2^-8 relative) of the exact result
            torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-2)


@needs_onednn
def test_bf16_activations_keep_the_kernel_and_f_linear_where_onednn_refuses_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU: oneDNN's bf16 reorder raises, so no copy is made (and none counted), and
    rows past the kernel run F.linear in bf16, with the same values."""
    def refuse(*_: object) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    torch.manual_seed(0)
    layer = FastLinear(96, 40).to(torch.bfloat16)
    assert fast_linear.prepack([layer], torch.bfloat16) == 0 and layer.onednn is None
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        for kernel_rows in (0, 64):
            layer.kernel_max_rows = kernel_rows
            got = layer(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), F.linear(x, layer.weight, layer.bias).float(),
                                       rtol=2**-7, atol=2e-2)


@needs_onednn
def test_prepack_skips_when_disabled_or_short_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fast_linear.DISABLE_ONEDNN_ENV, "1")
    layer = FastLinear(48, 24)
    assert fast_linear.prepack([layer]) == 0 and layer.onednn is None
    monkeypatch.delenv(fast_linear.DISABLE_ONEDNN_ENV)
    monkeypatch.setattr(fast_linear, "_available_memory", lambda: 8 * 1024)  # a copy would take over half
    assert fast_linear.prepack([layer]) == 0 and layer.onednn is None
    bf16 = FastLinear(48, 24)
    store_weights_as(bf16, torch.bfloat16)
    # Half of 6,000 bytes holds the bf16 weight (2,304) but not its float32 copy (4,608).
    monkeypatch.setattr(fast_linear, "_available_memory", lambda: 6000)
    assert fast_linear.prepack([bf16]) == 0 and bf16.onednn is None
    monkeypatch.setattr(fast_linear, "_available_memory", lambda: None)  # unknown: pack
    assert fast_linear.prepack([layer, bf16]) == 2 * 48 * 24 * 4
    assert layer.onednn is not None and bf16.onednn is not None


@pytest.mark.parametrize("slice_bytes", [1 << 30, 64 * 4 * 7])
def test_blas_path_widens_bf16_weights_in_slices(monkeypatch: pytest.MonkeyPatch, slice_bytes: int) -> None:
    """Past the kernel's rows, bf16 weights reach the BLAS widened (whole, or 7 features at a time)."""
    monkeypatch.setattr(fast_linear, "_WIDEN_SLICE_BYTES", slice_bytes)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 64, generator=gen)
    weight = torch.randn(30, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(30, generator=gen)
    got = fast_linear.blas_linear(x, weight, bias)
    torch.testing.assert_close(got, F.linear(x, weight.float(), bias), rtol=1e-5, atol=1e-5)


def test_store_weights_as_bf16_keeps_a_tied_embedding_float32() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(40, 16)
            self.proj = FastLinear(16, 16)
            self.head = FastLinear(16, 40, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    before = model.embed.weight.detach().clone()
    stored = store_weights_as(model, torch.bfloat16)
    assert model.proj.weight.dtype == model.head.weight.dtype == torch.bfloat16
    assert model.proj.bias.dtype == torch.float32 and model.embed.weight.dtype == torch.float32
    assert torch.equal(model.embed.weight, before)
    torch.testing.assert_close(model.head.weight.float(), before, rtol=1e-2, atol=1e-2)
    assert stored == 2 * (16 * 16 + 40 * 16)
    chosen = calibrate(model)
    assert set(chosen) == {(16, 16, "bfloat16"), (40, 16, "bfloat16")}
    with torch.inference_mode():
        for rows in (1, 3, 300):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(model.head(x), F.linear(x, model.head.weight.float()), rtol=1e-5, atol=1e-5)
