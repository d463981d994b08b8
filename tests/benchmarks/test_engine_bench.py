"""The engine bench drives the worker's runner the way served rounds do: its greedy tokens are
transformers' on the same weights, for every stream, and it times only the decode rounds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.engine_bench import run_engine
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.worker import Worker
from shared.tiny_models import TinyModelSpec, build_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("engine-bench") / "llama", TinyModelSpec(family="llama"))


def test_engine_matches_transformers_greedy(tiny_llama: Path) -> None:
    worker = Worker(WorkerConfig(model=str(tiny_llama), kv_cache_bytes=16 << 20))
    assert isinstance(worker.runner, ModelRunner)
    run = run_engine(worker.runner, worker.info.block_size, worker.info.vocab_size, concurrency=3, input_len=12,
                     output_len=10, steps=4)
    assert len(run.outputs) == 3 and all(len(out) == 10 for out in run.outputs)
    assert run.num_decode_steps == 8  # rounds 1 and 2 of 4 steps (round 0: prompt + 3 tokens); 4 + 8 >= 10
    assert run.tokens_per_s > 0 and run.decode_tokens_per_s > 0 and run.phase_ms["forward"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    for prompt, output in zip(run.prompts, run.outputs, strict=True):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert output == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize(("concurrency", "input_len", "output_len", "steps", "message"), [
    (4096, 64, 64, 8, "KV blocks"),  # more streams than the cache holds
    (1, 8, 4, 8, "must exceed"),  # round 0 alone would produce every token: no decode round to time
])
def test_engine_refuses_a_workload_it_cannot_run(tiny_llama: Path, concurrency: int, input_len: int,
                                                 output_len: int, steps: int, message: str) -> None:
    worker = Worker(WorkerConfig(model=str(tiny_llama), kv_cache_bytes=1 << 20))
    assert isinstance(worker.runner, ModelRunner)
    with pytest.raises(SystemExit, match=message):
        run_engine(worker.runner, worker.info.block_size, worker.info.vocab_size, concurrency=concurrency,
                   input_len=input_len, output_len=output_len, steps=steps)
