"""The step replay times the very step the engine ran: its captured layer-stack call computes the
captured output again, and each replay is timed."""

from __future__ import annotations

import pytest

from benchmarks.step_replay import capture_step, replay
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.worker import Worker
from shared.tiny_models import TinyModelSpec, build_model


@pytest.fixture(scope="module")
def runner_info(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelRunner, int, int]:
    model = build_model(tmp_path_factory.mktemp("step-replay") / "llama", TinyModelSpec(family="llama"))
    worker = Worker(WorkerConfig(model=str(model), kv_cache_bytes=16 << 20))
    assert isinstance(worker.runner, ModelRunner)
    if worker.runner.model.native_stack is None:
        pytest.skip("no native layer stack here (the CPU kernels did not load)")
    return worker.runner, worker.info.block_size, worker.info.vocab_size


def test_replay_recomputes_the_captured_step_and_times_each_part(runner_info: tuple[ModelRunner, int, int]) -> None:
    runner, block_size, vocab_size = runner_info
    stack = runner.model.native_stack
    step = capture_step(runner, block_size, vocab_size, input_len=12, output_len=10, steps=4)
    assert runner.model.native_stack is stack  # the recorder is gone again
    assert step.output.shape == (1, runner.model.config.hidden_size)  # one stream: one decode row
    times = replay(step, repeats=5, gap_us=50.0)
    assert list(times) == ["stack alone", "LM head alone", "stack + LM head", "stack + LM head, 50 us gap"]
    assert all(us > 0 for us in times.values())


def test_replay_notices_a_step_that_computes_something_else(runner_info: tuple[ModelRunner, int, int]) -> None:
    runner, block_size, vocab_size = runner_info
    step = capture_step(runner, block_size, vocab_size, input_len=12, output_len=10, steps=4)
    step.output.add_(1.0)
    with pytest.raises(AssertionError, match="does not compute"):
        replay(step, repeats=1, gap_us=0.0)
