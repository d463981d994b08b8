"""The fused CPU kernels against the unfused torch code they replace.

- residual add + RMSNorm (`rms_norm`, `add_rms_norm`) against `RMSNorm`'s torch path: Llama's
  and Gemma's unit-offset weights, fp32 and bf16 weights, odd widths, 1-64 rows;
- act(gate) * up (`act_and_mul`) against `F.silu(gate) * up` and tanh-GELU;
- the same on bf16 activations (`--dtype bfloat16`), rounded where torch's bf16 ops round;
- rotary inside paged attention (`forward_rotary`) against `RotaryEmbedding` then `forward`:
  the same cache contents and outputs, bit for bit, for full and partial rotary dims;
- the decoder with the fused path on equals it off (hidden states, greedy tokens), and
  SPINDLE_DISABLE_FUSED_KERNELS=1 turns it off;
- the encoder's residual add + LayerNorm (`add_layer_norm`) against torch's add and
  `F.layer_norm`, with its bf16 copy, and a MiniLM worker's vectors with it on and off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker.attention import create_backend
from services.worker.attention.base import AttentionType, CommonAttentionMetadata, LayerAttentionSpec
from services.worker.attention.paged import create
from services.worker.config import WorkerConfig
from services.worker.kernels.build import kernel_instruction_sets
from services.worker.kv_cache import allocate_kv_caches
from services.worker.models.bert import EncoderModel, EncoderNorm
from services.worker.models.decoder import RMSNorm
from services.worker.models.fused import DISABLE_ENV, fused_kernels_error
from services.worker.models.loader import load_model
from services.worker.models.rope import RotaryEmbedding
from services.worker.models.rope_scaling import RopeConfig
from services.worker.worker import Worker
from shared.types import RequestKind
from tests.worker.attention_cases import ROWS, paged_case
from tests.worker.pooling_cases import pooled_vectors, pooling_requests

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _norm(hidden: int, unit_offset: bool, weight_dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-6, unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    norm.weight.data = norm.weight.data.to(weight_dtype)
    return norm


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1024), (16, 1024), (64, 1024), (3, 37), (5, 8)])
def test_add_rms_norm_equals_torch(rows: int, hidden: int, unit_offset: bool, weight_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + hidden)
    x, residual = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(rows, hidden, generator=gen)
    norm = _norm(hidden, unit_offset, weight_dtype, rows)
    want_sum = residual + x
    want = norm._torch_forward(want_sum)
    got_sum, got = torch.ops.spindle.add_rms_norm(x, residual, norm.weight, norm.eps, unit_offset)
    assert torch.equal(got_sum, want_sum)  # the residual stream itself: one fp32 add, exact
    # the mean of squares sums in another order than torch's reduction: last-bit differences
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(torch.ops.spindle.rms_norm(x, norm.weight, norm.eps, unit_offset),
                               norm._torch_forward(x), rtol=2e-6, atol=1e-6)


def _within_a_bf16_rounding(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    """bf16 outputs of one computation summed in two orders: equal but for a rounding flipped here and there."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=atol)
    assert (got == want).float().mean() >= 0.98


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1024), (64, 1024), (3, 37)])
def test_add_rms_norm_on_bf16_activations_rounds_as_torch(rows: int, hidden: int, unit_offset: bool) -> None:
    """--dtype bfloat16: the residual add rounds to bf16, the norm in fp32, rounded where
    RMSNorm's torch path (HF's) rounds."""
    gen = torch.Generator().manual_seed(rows * 100 + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16()
    norm = _norm(hidden, unit_offset, torch.bfloat16, rows)
    want_sum = residual + x
    got_sum, got = torch.ops.spindle.add_rms_norm(x, residual, norm.weight, norm.eps, unit_offset)
    assert torch.equal(got_sum, want_sum)
    _within_a_bf16_rounding(got, norm._torch_forward(want_sum))
    _within_a_bf16_rounding(torch.ops.spindle.rms_norm(x, norm.weight, norm.eps, unit_offset), norm._torch_forward(x))


def _gelu_atol(gate: torch.Tensor, up: torch.Tensor) -> float:
    """How far tanh-GELU(gate) * up may be from torch's. Builds with AVX2 take tanh from SLEEF, as
    torch does: 1e-6. A build without (the portable loops, std::tanh) may differ by an ulp of 1 in
    1 + tanh(z), which cancels where z is far below 0, so by up to |gate * up| x 2^-23 there."""
    if "avx2" in kernel_instruction_sets():
        return 1e-6
    return 1e-6 + float((gate.float() * up.float()).abs().max()) * 2**-22


@pytest.mark.parametrize(("rows", "intermediate"), [(1, 2816), (64, 2816), (3, 13)])
def test_act_and_mul_on_bf16_activations_rounds_as_torch(rows: int, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(rows + intermediate)
    gate_up = (torch.randn(rows, 2 * intermediate, generator=gen) * 4).bfloat16()
    gate, up = gate_up.split(intermediate, dim=-1)
    # act(gate) rounds to bf16, then the product: exactly torch's two bf16 ops (SLEEF's exp as torch's)
    _within_a_bf16_rounding(torch.ops.spindle.act_and_mul(gate_up, 0), F.silu(gate) * up)
    _within_a_bf16_rounding(torch.ops.spindle.act_and_mul(gate_up, 1), F.gelu(gate, approximate="tanh") * up,
                            atol=_gelu_atol(gate, up))


def test_rms_norm_module_routes_only_what_the_kernel_rounds_alike() -> None:
    norm = _norm(64, False, torch.float32, 0)
    x, residual = torch.randn(3, 2, 64), torch.randn(3, 2, 64)  # 3-d inputs keep their shape
    norm.fused = True
    s, h = norm.add_forward(x, residual)
    assert s.shape == h.shape == x.shape
    torch.testing.assert_close(h, norm._torch_forward(residual + x), rtol=2e-6, atol=1e-6)
    assert norm.add_forward(x, None)[0] is x
    bf16 = x.bfloat16()
    assert torch.equal(norm(bf16), norm._torch_forward(bf16))  # bf16 times a float32 weight: torch's ops
    half = x.half()
    assert torch.equal(norm(half), norm._torch_forward(half))  # other dtypes: torch's ops


@pytest.mark.parametrize(("rows", "intermediate"), [(1, 2816), (16, 2816), (64, 2816), (3, 13), (2, 8)])
def test_act_and_mul_equals_torch(rows: int, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(rows + intermediate)
    gate_up = torch.randn(rows, 2 * intermediate, generator=gen) * 4
    gate, up = gate_up.split(intermediate, dim=-1)
    # SiLU uses torch's own vector exp (SLEEF) in torch's form: equal where the CPU has AVX2,
    # within an ulp through the scalar fallback
    torch.testing.assert_close(torch.ops.spindle.act_and_mul(gate_up, 0), F.silu(gate) * up, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.ops.spindle.act_and_mul(gate_up, 1), F.gelu(gate, approximate="tanh") * up,
                               rtol=2e-6, atol=_gelu_atol(gate, up))


def test_act_and_mul_keeps_leading_dims() -> None:
    gate_up = torch.randn(2, 3, 10)
    out = torch.ops.spindle.act_and_mul(gate_up, 0)
    assert out.shape == (2, 3, 5)
    torch.testing.assert_close(out, F.silu(gate_up[..., :5]) * gate_up[..., 5:], rtol=1e-6, atol=1e-7)


def _rope(head_dim: int, rotary_dim: int, positions: int) -> RopeConfig:
    return RopeConfig("default", 10000.0, head_dim, rotary_dim, positions)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary_dim", "window"),
                         [(16, 4, 64, 64, None), (4, 2, 32, 16, 7), (6, 1, 16, 16, None)])
def test_rotary_in_paged_attention_equals_rope_then_attention(
    heads: int, kv_heads: int, head_dim: int, rotary_dim: int, window: int | None, dtype: torch.dtype,
    cache_dtype: torch.dtype
) -> None:
    """float32 q/k, and bf16 ones (--dtype bfloat16: RotaryEmbedding's bf16 ops round each product
    and sum, and so does the kernel): the same cache contents and outputs, bit for bit."""
    cache, common, query, key, value, _, _ = paged_case(5, heads, kv_heads, head_dim, 16, cache_dtype)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    positions = torch.cat([torch.arange(n - q, n) for n, q in ROWS])
    rope = RotaryEmbedding(_rope(head_dim, rotary_dim, 256))
    backend = create(16)
    spec = LayerAttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
    meta = backend.metadata_builder().build(common, [])
    unfused_cache, fused_cache = cache.clone(), cache.clone()
    q_rot, k_rot = rope(positions, query, key)
    want = backend.forward(spec, q_rot, k_rot, value, unfused_cache, meta)
    got = backend.forward_rotary(spec, query, key, value, fused_cache, meta, positions, rope.cos, rope.sin)
    # Bit for bit; rows no pass wrote hold NaN in both (attention_cases.paged_case).
    torch.testing.assert_close(fused_cache, unfused_cache, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got, want)


def test_rotary_rejects_positions_past_the_table() -> None:
    cache, common, query, key, value, _, _ = paged_case(6, 4, 2, 32, 16, torch.float32)
    rope = RotaryEmbedding(_rope(32, 32, 64))  # rows reach position 129
    backend = create(16)
    meta = backend.metadata_builder().build(common, [])
    positions = torch.cat([torch.arange(n - q, n) for n, q in ROWS])
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        backend.forward_rotary(LayerAttentionSpec(4, 2, 32, 32**-0.5), query, key, value, cache, meta, positions,
                               rope.cos, rope.sin)


def _greedy(model: torch.nn.Module, backend, prompt: list[int], steps: int,
            dtype: torch.dtype = torch.float32) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from prefill + decode steps through the paged cache, and the prefill's hidden states."""
    config = model.config
    block_size, blocks = 16, 8
    caches = allocate_kv_caches(config, blocks, block_size, dtype, torch.device("cpu"), backend.head_major_cache)
    tokens, first_hidden = list(prompt), None
    builder = backend.metadata_builder()
    done = 0
    with torch.inference_mode():
        for _ in range(steps):
            new = tokens[done:]
            n = len(tokens)
            positions = torch.arange(done, n)
            common = CommonAttentionMetadata(
                attn_type=AttentionType.DECODER, num_reqs=1, num_tokens=len(new), max_query_len=len(new),
                max_seq_len=n, query_start_loc=torch.tensor([0, len(new)]), seq_lens=torch.tensor([n]),
                query_lens_host=torch.tensor([len(new)]).numpy(), seq_lens_host=torch.tensor([n]).numpy(),
                block_tables=torch.arange(blocks)[None, :], slot_mapping=positions.clone(),
            )
            hidden = model(torch.tensor(new), positions, caches, builder.build(common, []))
            first_hidden = hidden if first_hidden is None else first_hidden
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
            done = n
    return tokens[len(prompt):], first_hidden


def test_decoder_fused_path_equals_unfused(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = create_backend("paged", 16)
    model = load_model(llama_dir, backend, torch.float32, torch.device("cpu"))
    assert model.layers[0].mlp.fused and model.layers[0].self_attn.fused_rotary and model.norm.fused
    prompt = [3, 17, 42, 5, 9, 88, 21]
    fused_tokens, fused_hidden = _greedy(model, backend, prompt, 12)
    model.use_fused_kernels(False)
    tokens, hidden = _greedy(model, backend, prompt, 12)
    assert fused_tokens == tokens
    torch.testing.assert_close(fused_hidden, hidden, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert fused_kernels_error(torch.device("cpu")) == f"disabled by {DISABLE_ENV}"
    assert not load_model(llama_dir, backend, torch.float32, torch.device("cpu")).layers[0].mlp.fused


def test_decoder_fused_path_on_bf16_activations_equals_unfused(llama_dir: Path) -> None:
    """--dtype bfloat16: the fused kernels round where torch's bf16 ops do; only the norm's sum of
    squares runs in another order, so hidden states agree to bf16's rounding and tokens match."""
    backend = create_backend("paged", 16)
    model = load_model(llama_dir, backend, torch.bfloat16, torch.device("cpu"))
    assert model.layers[0].mlp.fused and model.layers[0].self_attn.fused_rotary and model.norm.fused
    prompt = [3, 17, 42, 5, 9, 88, 21]
    fused_tokens, fused_hidden = _greedy(model, backend, prompt, 12, torch.bfloat16)
    model.use_fused_kernels(False)
    tokens, hidden = _greedy(model, backend, prompt, 12, torch.bfloat16)
    assert fused_tokens == tokens
    torch.testing.assert_close(fused_hidden.float(), hidden.float(), rtol=2**-6, atol=2**-6)


def test_sdpa_backend_keeps_rotary_in_torch(llama_dir: Path) -> None:
    model = load_model(llama_dir, create_backend("sdpa", 16), torch.float32, torch.device("cpu"))
    assert model.layers[0].mlp.fused and not model.layers[0].self_attn.fused_rotary


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 384), (116, 384), (700, 384), (3, 37), (2, 8)])
def test_add_layer_norm_equals_torch(rows: int, hidden: int, x_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 10 + hidden)
    x, residual = (torch.randn(rows, hidden, generator=gen) * 3).to(x_dtype), torch.randn(rows, hidden, generator=gen)
    weight, bias = torch.randn(hidden, generator=gen), torch.randn(hidden, generator=gen)
    want = F.layer_norm(x.float() + residual, (hidden,), weight, bias, 1e-12)
    got, narrow = torch.ops.spindle.add_layer_norm(x, residual, weight, bias, 1e-12, True)
    # the variance sums in another order than torch's Welford: last-bit differences
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, got.to(torch.bfloat16))
    (alone,) = torch.ops.spindle.add_layer_norm(x, residual, weight, bias, 1e-12, False)
    assert torch.equal(alone, got)


def test_add_layer_norm_takes_strided_and_batched_inputs() -> None:
    gen = torch.Generator().manual_seed(7)
    x, residual = torch.randn(3, 5, 24, generator=gen), torch.randn(3, 5, 24, generator=gen)
    weight, bias = torch.randn(24, generator=gen), torch.randn(24, generator=gen)
    want = F.layer_norm(x + residual, (24,), weight, bias, 1e-5)
    out, narrow = torch.ops.spindle.add_layer_norm(x, residual, weight, bias, 1e-5, True)
    assert out.shape == narrow.shape == x.shape
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, another layout
    assert not strided.is_contiguous()
    assert torch.equal(torch.ops.spindle.add_layer_norm(strided, residual, weight, bias, 1e-5, False)[0], out)


def test_add_layer_norm_rejects_what_it_does_not_compute() -> None:
    x, weight = torch.randn(4, 16), torch.randn(16)
    with pytest.raises(RuntimeError, match="residual must be float32"):
        torch.ops.spindle.add_layer_norm(x, x.bfloat16(), weight, weight, 1e-5, False)
    with pytest.raises(RuntimeError, match="one shape"):
        torch.ops.spindle.add_layer_norm(x, torch.randn(4, 8), weight, weight, 1e-5, False)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.spindle.add_layer_norm(x, x, weight.bfloat16(), weight, 1e-5, False)


def test_encoder_norm_routes_only_a_float32_residual_through_the_kernel() -> None:
    norm = EncoderNorm(64, eps=1e-12)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    x, residual = torch.randn(3, 64).bfloat16(), torch.randn(3, 64)
    want = F.layer_norm(x.float() + residual, (64,), norm.weight, norm.bias, 1e-12)
    kernel = torch.ops.spindle.add_layer_norm(x, residual, norm.weight, norm.bias, 1e-12, False)[0]
    for fused, exact in ((False, want), (True, kernel)):
        norm.fused = fused
        out, narrow = norm.add_forward(x, residual, True)
        assert torch.equal(out, exact)  # the kernel's result where fused, torch's otherwise
        assert narrow is not None and torch.equal(narrow, out.bfloat16())
        assert norm.add_forward(x, residual, False)[1] is None
    torch.testing.assert_close(kernel, want, rtol=1e-5, atol=1e-5)
    # --dtype bfloat16: a bf16 residual stream keeps torch's bf16 ops (the kernel would not round alike)
    x16, r16 = x, residual.bfloat16()
    out, _ = norm.add_forward(x16, r16, False)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.layer_norm(x16 + r16, (64,), norm.weight, norm.bias, 1e-12))


@pytest.mark.parametrize("encoder_matmul", ["float32", "bfloat16"])
def test_encoder_fused_path_keeps_the_vectors(minilm_dir: Path, encoder_matmul: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A MiniLM worker's vectors with the fused add & norm (and, under bf16 GEMM inputs, the norms'
    bf16 copies as the next GEMMs' inputs) against torch's ops."""
    worker = Worker(WorkerConfig(model=str(minilm_dir), num_threads=2, encoder_matmul=encoder_matmul))
    model = worker.model
    assert isinstance(model, EncoderModel) and all(
        m.fused for m in model.modules() if isinstance(m, EncoderNorm))
    calls: list[bool] = []  # the narrow flag of each kernel call
    kernel = torch.ops.spindle.add_layer_norm

    def counted(*args: object) -> list[torch.Tensor]:
        calls.append(bool(args[-1]))
        return kernel(*args)

    monkeypatch.setattr(torch.ops.spindle, "add_layer_norm", counted)
    requests = pooling_requests(RequestKind.EMBED)
    fused = pooled_vectors(worker, requests)
    assert calls == [encoder_matmul == "bfloat16"] * (2 * len(model.layers))  # both norms of every layer
    model.use_fused_kernels(False)
    unfused = pooled_vectors(worker, requests)
    assert len(calls) == 2 * len(model.layers)  # torch's ops now
    assert F.cosine_similarity(fused, unfused).min() > 0.99999
