"""Packed encoder attention: equal to the padded backends, and no padding anywhere in the pass."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from services.worker.attention import AttentionType, CommonAttentionMetadata, LayerAttentionSpec, create_backend
from services.worker.attention.packed_encoder import (
    EncoderAttention,
    PackedEncoderMetadata,
    PackedEncoderMetadataBuilder,
)
from services.worker.config import WorkerConfig
from services.worker.kernels.build import kernels_error
from services.worker.models.bert import EncoderNorm
from services.worker.models.prepacked_linear import PrepackedLinear, gemm_rows
from services.worker.worker import Worker
from shared.types import RequestKind
from tests.worker.pooling_cases import LENS, pooled_vectors, pooling_requests

HEADS, DIM = 4, 8
SPEC = LayerAttentionSpec(HEADS, HEADS, DIM, DIM**-0.5)


def _common(lens: list[int]) -> CommonAttentionMetadata:
    host = np.asarray(lens, np.int64)
    starts = np.concatenate(([0], np.cumsum(host)))
    return CommonAttentionMetadata(
        attn_type=AttentionType.ENCODER_ONLY,
        num_reqs=len(lens),
        num_tokens=int(host.sum()),
        max_query_len=int(host.max()),
        max_seq_len=int(host.max()),
        query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(host),
        query_lens_host=host,
        seq_lens_host=host,
    )


def _padded_metadata(attention: EncoderAttention, lens: list[int]) -> object:
    """The backend's own (padded) encoder layout for `lens`, the reference."""
    builder = attention.backend.metadata_builder()
    host = np.asarray(lens, np.int64)
    extra = builder.prepare(host, host, AttentionType.ENCODER_ONLY)
    return builder.build(_common(lens), [torch.from_numpy(a) for a in extra])


def _qkv(lens: list[int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(sum(lens), HEADS, DIM, generator=gen) * 2 for _ in range(3))


def test_builder_gives_each_sequence_its_token_range() -> None:
    meta = PackedEncoderMetadataBuilder().build(_common(LENS), [])
    assert meta.bounds == ((0, 1), (1, 201), (201, 204), (204, 268), (268, 285), (285, 287))
    assert meta.num_tokens == sum(LENS)
    with pytest.raises(ValueError, match="encoder-only"):
        PackedEncoderMetadataBuilder().prepare(np.array([3]), np.array([3]), AttentionType.DECODER)


@pytest.mark.parametrize("backend", ["sdpa", "naive", "paged"])
def test_packed_attention_equals_the_padded_backend(backend: str) -> None:
    if backend == "paged" and kernels_error() is not None:
        pytest.skip(f"paged kernels unavailable: {kernels_error()}")
    attention = EncoderAttention(create_backend(backend, 16))
    q, k, v = _qkv(LENS)
    packed = attention.forward(SPEC, q, k, v, attention.metadata_builder(torch.device("cpu")).build(_common(LENS), []))
    padded = attention.forward(SPEC, q, k, v, _padded_metadata(attention, LENS))
    assert packed.shape == (sum(LENS), HEADS, DIM)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)


def test_packed_attention_computes_no_padding() -> None:
    attention = EncoderAttention(create_backend("sdpa", 16))
    seen: list[tuple[int, ...]] = []
    kernel = attention.kernel

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        seen.append(tuple(q.shape))
        return kernel(q, k, v, scale)

    attention.kernel = spy
    attention.batch_kernel = False  # the per-sequence loop (the batch kernel is tested below)
    q, k, v = _qkv(LENS)
    attention.forward(SPEC, q, k, v, PackedEncoderMetadataBuilder().build(_common(LENS), []))
    assert seen == [(1, HEADS, n, DIM) for n in LENS]  # each sequence alone: sum of lengths, no padded rows


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """float64 softmax(q k^T) v within each sequence."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].double().transpose(0, 1) for t in (q, k, v))
        out.append(((qs @ ks.transpose(1, 2)) * scale).softmax(-1).matmul(vs).transpose(0, 1))
        start += n
    return torch.cat(out).float()


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(("heads", "dim"), [(12, 32), (4, 64), (3, 8), (2, 20)])
def test_batch_kernel_equals_float64_attention_on_qkv_views(heads: int, dim: int) -> None:
    lens = [1, 7, 8, 9, 250, 33, 2]  # vector bodies, tails, a lone token, a long sentence
    gen = torch.Generator().manual_seed(heads * dim)
    qkv = torch.randn(sum(lens), 3 * heads * dim, generator=gen) * 2  # the fused projection's output
    q, k, v = (t.view(-1, heads, dim) for t in qkv.split(heads * dim, -1))
    assert q.stride(0) == 3 * heads * dim  # views, as EncoderLayer passes them
    starts = torch.tensor(np.concatenate(([0], np.cumsum(lens))), dtype=torch.int64)
    out = torch.ops.spindle.encoder_attention(q, k, v, starts, dim**-0.5)
    assert out.shape == (sum(lens), heads, dim) and out.is_contiguous()
    torch.testing.assert_close(out, _reference(q, k, v, lens, dim**-0.5), atol=2e-5, rtol=1e-5)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(("heads", "dim"), [(12, 32), (2, 20)])
def test_batch_kernel_on_bf16_computes_in_float32_and_rounds_only_its_output(heads: int, dim: int) -> None:
    """bf16 query/key/value give what float32 ones holding the same values give, rounded to bf16."""
    lens = [1, 9, 250, 33]
    qkv = torch.randn(sum(lens), 3 * heads * dim, generator=torch.Generator().manual_seed(dim)).to(torch.bfloat16)
    q, k, v = (t.view(-1, heads, dim) for t in qkv.split(heads * dim, -1))
    starts = torch.tensor(np.concatenate(([0], np.cumsum(lens))), dtype=torch.int64)
    out = torch.ops.spindle.encoder_attention(q, k, v, starts, dim**-0.5)
    wide = torch.ops.spindle.encoder_attention(q.float(), k.float(), v.float(), starts, dim**-0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="of query's dtype"):
        torch.ops.spindle.encoder_attention(q, k.float(), v, starts, dim**-0.5)


@pytest.mark.usefixtures("cpu_kernels")
def test_bf16_gemm_layers_hand_qkv_over_in_bf16_with_the_same_vectors(minilm_dir: Path) -> None:
    """Under bf16 GEMM inputs the qkv projection's bf16 result goes to the kernel as it is: the
    vectors are bit for bit those of widening it to float32 first."""
    worker = Worker(WorkerConfig(model=str(minilm_dir), num_threads=2, encoder_matmul="bfloat16"))
    requests = pooling_requests(RequestKind.EMBED)
    attention = worker.model.layers[0].attention
    assert worker.model.layers[0].qkv_proj.bf16_inputs and attention.batch_kernel is not False
    seen: list[torch.dtype] = []  # what attention hands to o_proj: bf16 when qkv went in as bf16
    hook = worker.model.layers[0].o_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    narrow = pooled_vectors(worker, requests)
    for layer in worker.model.layers:  # qkv widened to float32 whatever the layer asks: the same kernel after it
        layer.qkv_proj.forward = partial(_widened, layer.qkv_proj)  # type: ignore[method-assign]
    widened = pooled_vectors(worker, requests)
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32]
    assert torch.equal(narrow, widened)


def _widened(layer: PrepackedLinear, x: torch.Tensor, widen: bool = True) -> torch.Tensor:
    return PrepackedLinear.forward(layer, x)


@pytest.mark.usefixtures("cpu_kernels")
def test_batch_kernel_equals_the_sdpa_loop() -> None:
    attention = EncoderAttention(create_backend("sdpa", 16))
    q, k, v = _qkv(LENS)
    meta = PackedEncoderMetadataBuilder().build(_common(LENS), [])
    by_kernel = attention.forward(SPEC, q, k, v, meta)
    assert attention.batch_kernel is True
    attention.batch_kernel = False
    torch.testing.assert_close(by_kernel, attention.forward(SPEC, q, k, v, meta), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("batch_kernel", [True, False])
def test_rows_after_the_last_sequence_are_padding_and_come_out_zero(batch_kernel: bool) -> None:
    """Rows past the last sequence (EncoderModel pads a batch to its GEMMs' row bucket) attend to
    nothing, come out zero and leave the real rows as they are without them."""
    attention = EncoderAttention(create_backend("sdpa", 16))
    attention.batch_kernel = batch_kernel
    q, k, v = _qkv([*LENS, 5])  # 5 more rows of random values; the metadata knows only LENS
    meta = PackedEncoderMetadataBuilder().build(_common(LENS), [])
    out = attention.forward(SPEC, q, k, v, meta)
    n = sum(LENS)
    assert out.shape == q.shape and torch.equal(out[n:], torch.zeros_like(out[n:]))
    torch.testing.assert_close(out[:n], attention.forward(SPEC, q[:n], k[:n], v[:n], meta), atol=0, rtol=0)


@pytest.mark.usefixtures("cpu_kernels")
def test_batch_kernel_rejects_bad_boundaries_and_layouts() -> None:
    q, k, v = _qkv([3, 4])
    with pytest.raises(RuntimeError, match="run from 0 to at most 7"):
        torch.ops.spindle.encoder_attention(q, k, v, torch.tensor([0, 3, 8]), 1.0)
    with pytest.raises(RuntimeError, match="empty or out of order"):
        torch.ops.spindle.encoder_attention(q, k, v, torch.tensor([0, 3, 3, 7]), 1.0)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        torch.ops.spindle.encoder_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v,
                                            torch.tensor([0, 3, 7]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.spindle.encoder_attention(q.double(), k, v, torch.tensor([0, 3, 7]), 1.0)


def test_naive_backend_keeps_the_reference_loop() -> None:
    assert EncoderAttention(create_backend("naive", 16)).batch_kernel is False


def test_attention_outside_the_cpu_uses_the_backend_layout() -> None:
    attention = EncoderAttention(create_backend("sdpa", 16))
    assert isinstance(attention.metadata_builder(torch.device("cpu")), PackedEncoderMetadataBuilder)
    assert not isinstance(attention.metadata_builder(torch.device("meta")), PackedEncoderMetadataBuilder)


@pytest.mark.parametrize(("model_fixture", "kind"), [("minilm_dir", RequestKind.EMBED),
                                                      ("cross_encoder_dir", RequestKind.SCORE)])
def test_encoder_round_is_packed_end_to_end_and_equals_the_padded_layout(
    request: pytest.FixtureRequest, model_fixture: str, kind: RequestKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir: Path = request.getfixturevalue(model_fixture)
    # float32 GEMMs: packed and padded rounds give oneDNN other row counts, so other summation
    # orders, and bf16 inputs (auto, on a CPU with bf16 math) would turn those into 1e-3 differences.
    worker = Worker(WorkerConfig(model=str(model_dir), attention_backend="sdpa", num_threads=2,
                                 encoder_matmul="float32"))
    rows: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
             for name, m in worker.model.named_modules()
             if isinstance(m, nn.Linear | nn.LayerNorm) and not name.startswith("classifier")]
    add_forward = EncoderNorm.add_forward  # the layers' norms, called through it (no module hooks)

    def counted(norm: EncoderNorm, x: torch.Tensor, *args: object) -> object:
        rows.append(x.shape[0])
        return add_forward(norm, x, *args)

    monkeypatch.setattr(EncoderNorm, "add_forward", counted)
    metas: list[object] = []
    layer = worker.model.layers[0]
    hooks.append(layer.register_forward_pre_hook(lambda _m, args: metas.append(args[2])))  # (x, x16, meta)
    requests = pooling_requests(kind)
    packed = pooled_vectors(worker, requests)
    for hook in hooks:
        hook.remove()
    assert isinstance(metas[0], PackedEncoderMetadata)
    # every linear layer and LayerNorm of the trunk saw the sum of the lengths, rounded up once to the
    # GEMMs' row bucket (287 -> 288): nothing padded to the longest sequence
    assert rows == [gemm_rows(sum(LENS))] * (1 + 6 * len(worker.model.layers)) and gemm_rows(sum(LENS)) == 288

    runner = worker.runner
    runner.metadata_builder = worker.backend.metadata_builder()  # the padded layout, as before packing
    padded = pooled_vectors(worker, requests)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
