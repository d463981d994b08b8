"""`PrepackedLinear`: an `nn.Linear` whose CPU float32 GEMM runs on weights oneDNN reordered once.

Why: an encoder round is a few large GEMMs per layer, and on the CPU their speed is the
worker's speed. torch's `F.linear` goes to MKL with the plain [out, in] weight every call;
oneDNN with the weight reordered once into its blocked layout measured 5-10 % more FLOP/s at
BERT's shapes (384x1152, 384x1536, 1536x384; 300-4096 rows: 72-86 vs 66-80 GFLOP/s on 2 AMD
EPYC cores) and 1.5x at 10 rows, with float32 accumulation like MKL (results differ only in
summation order).

The copy is packed in the activations' dtype: float32 (a bfloat16 weight widened), or bfloat16
for bfloat16 activations, where oneDNN runs the CPU's native bf16 dot products (AVX512-BF16,
AMX): at the medium model's shapes on a 2-core AMD Zen 5, 770-850 GFLOP/s at 64 rows against
F.linear's 610-700 on the plain bf16 weight, and 180-215 against 100-125 at 4 rows.

The reorder happens at the first forward (after the loader filled the weight) and again
whenever the weight changes (its storage or version counter). Anything else (no oneDNN, another
dtype or device, a build whose packed result does not reproduce `F.linear` on a probe) keeps
`F.linear`, logged once per layer. Parameter names are `nn.Linear`'s, so checkpoints load unchanged.

`bf16_inputs` (an embedding model's layers on a CPU with bf16 math: `--encoder-matmul`, resolved
in worker.py): float32 activations are rounded to bfloat16 at the GEMM's input and its output
widened back, against a bfloat16 packed copy of the weight, with float32 accumulation; the
residual stream, layer norms and pooling stay float32, and attention computes in float32. The GEMMs are ~80 % of an
encoder round, and oneDNN's bf16 GEMM runs at ~2x its fp32 one on AVX512-BF16: all-MiniLM-L6-v2,
64-sentence rounds, in process on a 2-core AMD Zen 4, 6,700-7,689 -> 9,862-11,005 tokens/s, every vector
within cosine 0.99997 of float32 (`--dtype bfloat16`, the residual stream in bf16 too: 12,345-13,081
tokens/s, but only 0.99993). Where the next step would round a GEMM's output again, it stays bf16
(`widen=False`, bert.py: the GELU output into down_proj, and the qkv projection's into the
attention kernel, whose output is rounded as o_proj would round it; o_proj's and down_proj's
outputs are widened inside the residual add & LayerNorm kernel instead), and each layer's bias
is rounded once, not every call: bit-identical vectors, the worker's round 15.00 -> 14.10 ms for
one 116-token sentence and 352.0 -> 335.2 ms for 32 of 12-250 tokens (2-core AMD Zen 4, old and
new called in turn in one process, 2026-11-30).

oneDNN builds (JIT-compiles) a GEMM for each row count it is given and keeps the last 1,024 in
a cache, and each one holds 0.5-2.4 MB (more rows, more). Rows vary with every round (an embedding
request is its sentence's tokens, a decoder's prefill step its chunk plus its decodes), so left
alone a worker built a GEMM for most calls of a new size (0.6-1.6 ms for MiniLM's shapes at 20-240
rows, a forward pass's first layer 1.5-2.2x its others) and its memory grew by up to the cache's
1,024 of them: +650 MB for MiniLM's four shapes at 1-256 rows, 1-2.5 GB for a decoder's
prefill sizes (2-core AMD Zen 4, /tmp scripts, 2026-12-01). So rows are rounded up to a bucket
(`bucket_rows`: as they are up to 8, then multiples of 8 up to 256, of 32 up to 1,024, of 128 up
to 4,096 and of 512 beyond; half a step on average, at most one: 12.5 % just past 256, 1,024 and
4,096 rows) and the GEMM runs on zero-padded rows, of which only the real ones are returned: 95
sizes per weight over 1-8,192 rows, all of them cached.
SPINDLE_DISABLE_ONEDNN_ROW_BUCKETS=1 passes every row count as it is.

`PrepackedLinear(..., gelu=True)` returns exact (erf) GELU of the projection, applied by oneDNN
as a post-op on each output tile while it is in cache: at BERT's MLP shape (7,600 rows, 384 ->
1,536) the GEMM took 69-71 ms, with `F.gelu` after it 89-90 ms, fused 81-82 ms (2-core AMD EPYC;
max difference from `F.gelu` 4e-6).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from shared.switches import switch_on

logger = logging.getLogger(__name__)

PACK_ROWS_HINT = 2048  # rows oneDNN tunes the layout for (the default round budget); any row count runs
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)  # weights, and activations, a packed copy serves
# (rows up to this, rounded up to a multiple of this); beyond the last, multiples of LAST_ROW_STEP.
ROW_BUCKETS = ((8, 1), (256, 8), (1024, 32), (4096, 128))
LAST_ROW_STEP = 512
ROW_BUCKETS_ON = not switch_on("SPINDLE_DISABLE_ONEDNN_ROW_BUCKETS")
BUILD_MAX_ROWS = 512  # start-up builds buckets up to this many rows (an 8k-token model's would take long)


def bucket_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at: `rows` rounded up to its bucket's step (module
    docstring: one oneDNN GEMM is built and cached per row count)."""
    step = next((step for limit, step in ROW_BUCKETS if rows <= limit), LAST_ROW_STEP)
    return -(-rows // step) * step


def gemm_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at: its bucket, or `rows` with the buckets off. A
    caller that hands over activations of this many rows already saves every GEMM its padding."""
    return bucket_rows(rows) if ROW_BUCKETS_ON else rows


def _reorder(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight oneDNN-packed for `dtype` activations, or None (with the reason logged) where it
    cannot stand in for F.linear.

    For float32 activations a bfloat16 weight is widened first, as FastLinear's kernel widens it
    in registers (a bf16 GEMM on float32 inputs would round them)."""
    if (weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or dtype not in PACKABLE_DTYPES
            or not torch.backends.mkldnn.is_available()):
        return None
    weight = weight.detach().to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16 outputs round to 8 bits
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
        bias = None if bias is None else bias.detach().to(dtype)
        ok = torch.allclose(_packed_linear(probe, packed, bias).float(), F.linear(probe, weight, bias).float(),
                            rtol=tolerance, atol=tolerance)
    except (AttributeError, RuntimeError) as exc:  # an op missing or refusing this build
        logger.info("linear %s keeps F.linear: oneDNN reorder failed (%s)", tuple(weight.shape), exc)
        return None
    if not ok:
        logger.warning("linear %s keeps F.linear: the oneDNN result differs on a probe", tuple(weight.shape))
        return None
    return packed


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   gelu: bool = False) -> torch.Tensor:
    """oneDNN's GEMM on the packed weight; `gelu`: exact (erf, oneDNN's algorithm "none") GELU fused as a post-op."""
    attr, algorithm = ("gelu", "none") if gelu else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)


def _bucketed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     gelu: bool = False) -> torch.Tensor:
    """`_packed_linear` of a 2-D `x`, run at `bucket_rows` rows (zero rows appended), real rows returned."""
    rows = x.shape[0]
    padded = gemm_rows(rows)
    if padded == rows:
        return _packed_linear(x, packed, bias, gelu)
    return _packed_linear(F.pad(x, (0, 0, 0, padded - rows)), packed, bias, gelu)[:rows]


class OneDnnWeight:
    """A weight's oneDNN-packed copy for one activation dtype, packed again whenever the weight
    changes (storage or version) or activations of another dtype arrive."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self._packed_for: tuple[int, int, torch.dtype] | None = None  # (data_ptr, version, dtype) packed
        # bf16_inputs: (the bias, its storage and version, the bias rounded), rounded once.
        self._bias16: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None

    def get(self, weight: torch.Tensor, bias: torch.Tensor | None,
            dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The copy of `weight` as it is now, packed for `dtype` activations; None where oneDNN
        cannot stand in for F.linear."""
        key = (*_identity(weight), dtype)
        if key != self._packed_for:
            with torch.no_grad():
                self.packed = _reorder(weight, bias, dtype)
            self._packed_for = key
        return self.packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               gelu: bool = False, bf16_inputs: bool = False, widen: bool = True) -> torch.Tensor:
        """F.linear(x, weight, bias) (then exact GELU where `gelu`), through oneDNN where the weight
        packs and x is CPU float32 or bfloat16; `bf16_inputs`: x (float32, or bfloat16 already)
        runs the bfloat16 GEMM (x, weight and bias rounded, float32 accumulation) and gets float32
        back, or the bfloat16 result as it is where not `widen` (for a next step that would round it
        again, or that widens it itself: the same values, two copies fewer)."""
        narrow = bf16_inputs and x.dtype in PACKABLE_DTYPES
        if narrow:
            x, bias = x.to(torch.bfloat16), self._rounded_bias(bias)
        packed = self.get(weight, bias, x.dtype) if x.device.type == "cpu" else None
        if packed is None:
            y = F.linear(x, weight.to(x.dtype), bias)  # the cast is a no-op unless the weight is stored narrower
            y = F.gelu(y) if gelu else y
        elif x.dim() == 2:
            y = _bucketed_linear(x, packed, bias, gelu)
        else:
            y = _bucketed_linear(x.reshape(-1, x.shape[-1]), packed, bias, gelu).view(*x.shape[:-1], weight.shape[0])
        return y.float() if narrow and widen else y

    def _rounded_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`bias` in bfloat16, rounded once (again only when it changes), not at every call."""
        if bias is None:
            return None
        key = _identity(bias)
        if self._bias16 is None or self._bias16[0] is not bias or self._bias16[1] != key:
            self._bias16 = (bias, key, bias.detach().to(torch.bfloat16))
        return self._bias16[2]


def _identity(t: torch.Tensor) -> tuple[int, int]:
    """(storage, version) of a parameter: a new value changes one of them. Inference tensors (made
    under inference_mode) keep no version counter: their storage decides."""
    return t.data_ptr(), -1 if t.is_inference() else t._version


class PrepackedLinear(nn.Linear):
    """nn.Linear (then exact GELU where `gelu`); CPU float32 inputs run through oneDNN on a weight
    reordered once, as a bfloat16 GEMM where `bf16_inputs` is set (`use_bf16_inputs`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gelu: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.onednn = OneDnnWeight()
        self.gelu = gelu
        self.bf16_inputs = False

    def forward(self, x: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """`widen=False`: under `bf16_inputs`, the bfloat16 result as it is, for a next step that would
        round it again or widens it itself (otherwise the activations' dtype, as always)."""
        return self.onednn.linear(x, self.weight, self.bias, self.gelu, self.bf16_inputs, widen)


def build_gemms(model: nn.Module, max_rows: int, dtype: torch.dtype) -> tuple[int, float]:
    """Has oneDNN build (and cache) the GEMM of every row bucket up to `max_rows` (at most
    BUILD_MAX_ROWS) for each distinct PrepackedLinear of `model`, through its own forward on
    `dtype` inputs (the activations'), so that no request of up to that many tokens waits for one
    (module docstring). Call after the weights are loaded. Layers that keep F.linear (their weight
    does not pack for these inputs) build nothing; nor does anything with the buckets switched off.
    Logs what it built; returns (GEMMs run, seconds)."""
    if not ROW_BUCKETS_ON or dtype not in PACKABLE_DTYPES:
        return 0, 0.0
    start = time.perf_counter()
    distinct: dict[tuple[int, int, bool, bool, bool], PrepackedLinear] = {}
    for m in model.modules():
        if isinstance(m, PrepackedLinear) and m.weight.device.type == "cpu":
            distinct.setdefault((m.in_features, m.out_features, m.gelu, m.bf16_inputs, m.bias is None), m)
    max_rows = min(max_rows, BUILD_MAX_ROWS)
    sizes = sorted({bucket_rows(rows) for rows in range(1, max_rows + 1)})
    num_gemms = 0
    with torch.inference_mode():
        for layer in distinct.values():
            layer(torch.zeros(sizes[0], layer.in_features, dtype=dtype))  # packs the weight, as the forward would
            if layer.onednn.packed is None:
                continue  # F.linear: no GEMM of oneDNN's to build
            for rows in sizes[1:]:
                layer(torch.zeros(rows, layer.in_features, dtype=dtype))
            num_gemms += len(sizes)
    seconds = time.perf_counter() - start
    if num_gemms:
        logger.info("oneDNN GEMMs built for one request's rows (up to %d): %d in %.2f s", max_rows, num_gemms, seconds)
    return num_gemms, seconds


def use_bf16_inputs(model: nn.Module) -> int:
    """Every PrepackedLinear of `model` runs its GEMM on bfloat16 inputs; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    for layer in layers:
        layer.bf16_inputs = True
    return len(layers)
