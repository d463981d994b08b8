"""The one-call greedy decode step (models/greedy_step.py) samples exactly the Python path's tokens.

Rounds from the toy scheduler run twice on the same checkpoint, once with the greedy step and
once without (the layer stack, the LM head and the sampler called from Python), and the tokens
must be equal: multi-step rounds, rounds carrying on from the last (across block boundaries),
GQA, biases (Qwen2), a sliding window shorter than the contexts (Mistral), bf16 weights and
bf16 activations. Steps with a row that samples otherwise keep the Python path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from worker_harness import ToyScheduler, make_runner

from services.worker.attention.paged import PagedMetadata
from services.worker.model_runner import ModelRunner
from services.worker.models.decoder import DecoderForCausalLM
from services.worker.models.fast_linear import FastLinear, store_weights_as
from services.worker.models.greedy_step import DISABLE_ENV, GreedyStep, build_greedy_step
from shared.sampling import SamplingOptions

pytestmark = pytest.mark.usefixtures("cpu_kernels")

BLOCK_SIZE = 4  # decode rounds cross block boundaries often
KERNEL_ROWS = 8  # every linear layer and the LM head run the small-M kernel up to this many rows
step_call = GreedyStep.__call__  # the real call, which `_generate` wraps to count


def _runner(model_dir: Path, weight_dtype: torch.dtype = torch.float32,
            dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A paged-backend runner whose stack and greedy step cover up to KERNEL_ROWS rows (not the
    calibration's timing-dependent choice)."""
    runner = make_runner(model_dir, "paged", num_blocks=128, block_size=BLOCK_SIZE, dtype=dtype)
    model = runner.model
    assert isinstance(model, DecoderForCausalLM)
    if weight_dtype != dtype:
        store_weights_as(model, weight_dtype)
    for module in model.modules():
        if isinstance(module, FastLinear):
            module.kernel_max_rows, module.kernel_at, module.probe_s = KERNEL_ROWS, b"", ()
    model.build_native_stack()
    assert model.greedy_step is not None
    return runner


def _generate(runner: ModelRunner, greedy_step: bool, requests: dict[str, tuple[list[int], SamplingOptions]],
              monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[int]], int]:
    """Each request's tokens (20 each, 4 steps a round) and how many steps the greedy step ran."""
    model = runner.model
    step = model.greedy_step
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(GreedyStep, "__call__", lambda self, *args: calls.append(1) or step_call(self, *args))
        model.greedy_step = step if greedy_step else None
        try:
            runner.reset()
            scheduler = ToyScheduler(runner, num_blocks=128, block_size=BLOCK_SIZE, token_budget=64, num_steps=4)
            for name, (prompt, sampling) in requests.items():
                scheduler.add(name, prompt, 20, sampling)
            return scheduler.run(), len(calls)
        finally:
            model.greedy_step = step


PROMPTS = {"a": [3, 17, 42, 5, 9, 88, 21, 7, 11, 30, 2, 64], "b": [5, 6], "c": [40, 41, 42, 43, 44, 45, 46]}
GREEDY = SamplingOptions(temperature=0.0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize(("weight_dtype", "dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])
def test_greedy_step_samples_the_python_paths_tokens(
    tiny_models: dict[str, Path], family: str, weight_dtype: torch.dtype, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = _runner(tiny_models[family], weight_dtype, dtype)
    assert runner.model.greedy_step is not None and runner.model.greedy_step.screen is not None  # the int8 screen
    requests = {name: (prompt, GREEDY) for name, prompt in PROMPTS.items()}
    fused, fused_calls = _generate(runner, True, requests, monkeypatch)
    python, python_calls = _generate(runner, False, requests, monkeypatch)
    assert python_calls == 0
    # Every decode step after the prompts' round: 19 tokens a request, 3 of 4 steps in round 0.
    assert fused_calls >= 19 - 3
    assert fused == python
    assert all(len(tokens) == 20 for tokens in fused.values())


def test_steps_with_other_sampling_keep_the_python_path(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row with logprobs, a logit_bias or a temperature keeps its whole batch on the Python
    path (the kernel only takes the argmax); alone, greedy rows take the greedy step again."""
    runner = _runner(llama_dir)
    others = [SamplingOptions(temperature=0.0, logprobs=2), SamplingOptions(temperature=0.0, logit_bias=((7, 5.0),)),
              SamplingOptions(temperature=0.8, seed=1),
              SamplingOptions(temperature=0.0, min_tokens=30, stop_token_ids=(3,))]
    for other in others:
        requests = {"greedy": (PROMPTS["a"], GREEDY), "other": (PROMPTS["c"], other)}
        fused, calls = _generate(runner, True, requests, monkeypatch)
        python, _ = _generate(runner, False, requests, monkeypatch)
        assert calls == 0, other
        assert fused == python
    _, calls = _generate(runner, True, {"greedy": (PROMPTS["a"], GREEDY)}, monkeypatch)
    assert calls > 0


def test_greedy_step_not_built_where_it_would_differ(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _runner(llama_dir).model
    rotary = (model.rope.cos, model.rope.sin)
    args = (model.embed_tokens, None, rotary, model.lm_head)
    assert build_greedy_step(model.native_stack, *args, None) is not None
    assert build_greedy_step(None, *args, None) is None, "the stack runs from Python"
    assert build_greedy_step(model.native_stack, *args, 30.0) is None, "soft-capped logits"
    assert build_greedy_step(model.native_stack, model.embed_tokens, None, rotary, torch.nn.Linear(4, 4),
                             None) is None, "an LM head without the small-M kernel"
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert build_greedy_step(model.native_stack, *args, None) is None
    monkeypatch.delenv(DISABLE_ENV)
    model.use_fused_kernels(False)
    assert model.greedy_step is None


def test_greedy_step_takes_only_the_rows_its_kernels_cover(llama_dir: Path) -> None:
    model = _runner(llama_dir).model
    step = model.greedy_step
    assert step is not None
    meta = object.__new__(PagedMetadata)  # only its type is looked at
    caches = [torch.zeros(1)]
    assert step.accepts(torch.zeros(KERNEL_ROWS, dtype=torch.long), caches, meta)
    assert not step.accepts(torch.zeros(KERNEL_ROWS + 1, dtype=torch.long), caches, meta), "past the kernel"
    assert not step.accepts(torch.zeros(KERNEL_ROWS, dtype=torch.long), None, meta), "no KV cache"
    assert not step.accepts(torch.zeros(KERNEL_ROWS, dtype=torch.long), caches, object()), "another backend"
    model.lm_head.kernel_max_rows = 2
    assert not step.accepts(torch.zeros(3, dtype=torch.long), caches, meta), "the LM head leaves the kernel"
