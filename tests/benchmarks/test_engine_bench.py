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


def test_engine_refuses_more_streams_than_the_cache_holds(tiny_llama: Path) -> None:
    worker = Worker(WorkerConfig(model=str(tiny_llama), kv_cache_bytes=1 << 20))
    assert isinstance(worker.runner, ModelRunner)
    with pytest.raises(SystemExit, match="KV blocks"):
        run_engine(worker.runner, worker.info.block_size, worker.info.vocab_size, concurrency=4096, input_len=64,
                   output_len=64, steps=8)


def test_engine_needs_decode_rounds_to_time(tiny_llama: Path) -> None:
    worker = Worker(WorkerConfig(model=str(tiny_llama), kv_cache_bytes=1 << 20))
    assert isinstance(worker.runner, ModelRunner)
    with pytest.raises(SystemExit, match="must exceed"):
        run_engine(worker.runner, worker.info.block_size, worker.info.vocab_size, concurrency=1, input_len=8,
                   output_len=4, steps=8)
