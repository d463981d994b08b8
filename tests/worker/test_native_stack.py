"""The one-call decoder stack (models/native_stack.py) computes exactly what the Python layer loop does.

Greedy agreement with transformers through the stack is tested by the family oracles
(test_model_families.py, test_runner_oracle.py: paged backend, multi-step decode); here the
stack's hidden states are compared bit for bit with the fused Python path's on the same cache
contents, for batched decode steps and small prefills, GQA, biases (Qwen2), a sliding window
shorter than the contexts (Mistral), bf16 weights and bf16 activations.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.attention import create_backend
from services.worker.attention.base import AttentionType, CommonAttentionMetadata
from services.worker.kv_cache import allocate_kv_caches
from services.worker.models.decoder import DecoderForCausalLM
from services.worker.models.fast_linear import PROBE_ROWS, FastLinear, store_weights_as
from services.worker.models.loader import load_model
from services.worker.models.native_stack import DISABLE_ENV, NativeStack, build_native_stack, work_pool_scope

pytestmark = pytest.mark.usefixtures("cpu_kernels")

BLOCK_SIZE = 16
BLOCKS_PER_ROW = 4
KERNEL_ROWS = 8  # every linear layer runs the small-M kernel up to this many rows (instead of the calibration's)


def _model(model_dir: Path, weight_dtype: torch.dtype = torch.float32,
           dtype: torch.dtype = torch.float32) -> DecoderForCausalLM:
    model = load_model(model_dir, create_backend("paged", BLOCK_SIZE), dtype, torch.device("cpu"))
    if weight_dtype != dtype:
        store_weights_as(model, weight_dtype)
    for module in model.modules():
        if isinstance(module, FastLinear):
            module.kernel_max_rows = KERNEL_ROWS
            module.kernel_at = b""  # nor the calibration's bands past them
            module.probe_s = ()  # no round rows past them
    model.build_native_stack()
    assert model.native_stack is not None and model.native_stack.max_rows == KERNEL_ROWS
    return model


def _metadata(model: DecoderForCausalLM, rows: list[int], starts: list[int], ends: list[int]):
    """Paged metadata for a pass where rows[i] computes positions [starts[i], ends[i]); cache row r
    owns blocks r * BLOCKS_PER_ROW onwards."""
    query_lens = np.array([e - s for s, e in zip(starts, ends, strict=True)])
    seq_lens = np.array(ends)
    positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    tables = torch.stack([torch.arange(r * BLOCKS_PER_ROW, (r + 1) * BLOCKS_PER_ROW) for r in rows])
    slots = torch.cat([r * BLOCKS_PER_ROW * BLOCK_SIZE + torch.arange(s, e)
                       for r, s, e in zip(rows, starts, ends, strict=True)])
    common = CommonAttentionMetadata(
        attn_type=AttentionType.DECODER, num_reqs=len(rows), num_tokens=int(query_lens.sum()),
        max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)])),
        seq_lens=torch.from_numpy(seq_lens), query_lens_host=query_lens, seq_lens_host=seq_lens,
        block_tables=tables, slot_mapping=slots,
    )
    meta = model.layers[0].self_attn.backend.metadata_builder().build(common, [])
    return positions, meta


def _run(model: DecoderForCausalLM, native: bool, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Hidden states of each row's prefill (chunks of at most KERNEL_ROWS tokens, one row at a
    time), then of `steps` greedy decode steps of all rows at once, on fresh caches."""
    config = model.config
    stack = model.native_stack
    model.native_stack = stack if native else None
    caches = allocate_kv_caches(config, len(prompts) * BLOCKS_PER_ROW, BLOCK_SIZE, model.norm.weight.dtype,
                                torch.device("cpu"), head_major=True)  # the paged backend's layout
    out = []
    tokens = [list(p) for p in prompts]
    try:
        with torch.inference_mode():
            for r, prompt in enumerate(prompts):
                for start in range(0, len(prompt), KERNEL_ROWS):
                    end = min(start + KERNEL_ROWS, len(prompt))
                    positions, meta = _metadata(model, [r], [start], [end])
                    out.append(model(torch.tensor(prompt[start:end]), positions, caches, meta))
                tokens[r].append(int(model.compute_logits(out[-1][-1:]).argmax(-1)))
            rows = list(range(len(prompts)))
            for _ in range(steps):
                ends = [len(t) for t in tokens]
                positions, meta = _metadata(model, rows, [e - 1 for e in ends], ends)
                hidden = model(torch.tensor([t[-1] for t in tokens]), positions, caches, meta)
                out.append(hidden)
                for r, token in enumerate(model.compute_logits(hidden).argmax(-1).tolist()):
                    tokens[r].append(token)
    finally:
        model.native_stack = stack
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize(("weight_dtype", "dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])
def test_stack_equals_python_layers(
    tiny_models: dict[str, Path], family: str, weight_dtype: torch.dtype, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 activations on fp32 or bf16 weights, and bf16 activations (--dtype bfloat16)."""
    model = _model(tiny_models[family], weight_dtype, dtype)
    calls = []
    run_stack = NativeStack.__call__
    monkeypatch.setattr(NativeStack, "__call__", lambda self, *args: calls.append(1) or run_stack(self, *args))
    # Mistral's window is 16: contexts of up to 38 tokens make it cut in.
    prompts = [[3, 17, 42, 5, 9, 88, 21, 7, 11, 30, 2, 64], [5, 6], [40, 41, 42, 43, 44, 45, 46]]
    native = _run(model, True, prompts, steps=26)
    assert len(calls) == 4 + 26, "every pass of at most KERNEL_ROWS tokens went through the stack"
    python = _run(model, False, prompts, steps=26)
    assert len(calls) == 4 + 26
    assert len(native) == len(python)
    for got, want in zip(native, python, strict=True):
        assert torch.equal(got, want)


def test_stack_on_the_work_pool_equals_the_stack_on_openmp(tiny_models: dict[str, Path]) -> None:
    """Decode rounds run the stack inside a work_pool_scope (model_runner.py): its kernels split
    their work on spindle's pool (kernels/csrc/work_pool.h), and each output element is computed
    as on OpenMP's threads."""
    model = _model(tiny_models["mistral"])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a helper beside the caller
    try:
        prompts = [[3, 17, 42, 5, 9, 88, 21, 7, 11, 30, 2, 64], [5, 6], [40, 41, 42, 43, 44, 45, 46]]
        openmp = _run(model, True, prompts, steps=26)
        time.sleep(0.02)  # OpenMP's threads stop spinning: until then the caller runs pool calls alone
        with work_pool_scope():
            pool = _run(model, True, prompts, steps=26)
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(pool, openmp, strict=True):
        assert torch.equal(got, want)


def test_stack_takes_only_what_it_covers(llama_dir: Path) -> None:
    model = _model(llama_dir)
    stack = model.native_stack
    assert stack is not None
    hidden = torch.zeros(KERNEL_ROWS, model.config.hidden_size)
    positions, meta = _metadata(model, [0], [0], [KERNEL_ROWS])
    caches = [torch.zeros(1)]
    assert stack.accepts(hidden, caches, meta)
    assert not stack.accepts(torch.zeros(KERNEL_ROWS + 1, model.config.hidden_size), caches, meta), "past the kernel"
    assert not stack.accepts(hidden, None, meta), "no KV cache (encoder-style pass)"
    assert not stack.accepts(hidden, caches, object()), "another backend's metadata"
    assert not stack.accepts(hidden.bfloat16(), caches, meta), "bf16 activations into a float32 model's stack"
    model.use_fused_kernels(False)
    assert model.native_stack is None


def test_stack_not_built_where_it_would_differ(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(llama_dir, create_backend("paged", BLOCK_SIZE), torch.float32, torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, FastLinear):
            module.kernel_max_rows = 0  # a CPU where the BLAS won every probe
            module.probe_s = tuple((2.0, 1.0) for _ in PROBE_ROWS)
    assert build_native_stack(model.config, model.layers, model.norm) is None
    model.layers[0].mlp.down_proj.kernel_max_rows = 4
    assert build_native_stack(model.config, model.layers, model.norm) is None, "one layer off the kernel"
    for module in model.modules():
        if isinstance(module, FastLinear):
            module.kernel_max_rows = 4
    assert build_native_stack(model.config, model.layers, model.norm) is not None
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert build_native_stack(model.config, model.layers, model.norm) is None
    monkeypatch.delenv(DISABLE_ENV)
    sdpa = load_model(llama_dir, create_backend("sdpa", BLOCK_SIZE), torch.float32, torch.device("cpu"))
    assert build_native_stack(sdpa.config, sdpa.layers, sdpa.norm) is None, "rotary stays in torch with sdpa"


def test_stack_takes_rows_where_the_summed_kernel_is_within_the_round_tolerance(llama_dir: Path) -> None:
    """Past the rows every layer wins, the stack (and the LM head) go as far as the layers' summed
    times allow: such a round runs on spindle's pool."""
    model = load_model(llama_dir, create_backend("paged", BLOCK_SIZE), torch.float32, torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, FastLinear):
            module.kernel_max_rows = 4
            module.probe_s = tuple((1e-5 if r <= 64 else 2e-3, 1e-3) for r in PROBE_ROWS)  # far behind past 64 rows
    model.lm_head.kernel_max_rows = 2
    model.build_native_stack()
    assert model.native_stack is not None and model.native_stack.max_rows == 64
    assert model.lm_head.kernel_max_rows == 64, "the LM head follows, or the round would leave the pool"
    assert model.layers[0].mlp.down_proj.kernel_max_rows == 4, "the Python path keeps each layer's own choice"
