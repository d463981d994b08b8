"""Multi-step rounds on CPU: each step leaves as soon as it is sampled, and finished rows leave the batch.

A counting wrapper around the model records, per forward pass, how many tokens it computed,
so the tests can see when a step was handed on (forward passes run by then) and which rows
the later steps still computed. `_LaggingCopier` makes the runner take its CUDA path (a
step's copy overlaps the next forward pass) on CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from worker_harness import make_runner

from services.worker.model_runner import ModelRunner
from services.worker.round_stops import StopTable
from services.worker.step_output import HostCopier, SampledStep
from shared.execute import CachedRequestData, ExecuteRound, NewRequestData, StepOutput
from shared.sampling import SamplingOptions

PROMPTS = {"a": [11, 12, 13, 14, 15], "b": [21, 22, 23, 24, 25, 26, 27]}
BLOCKS = {"a": [0], "b": [1]}


class _CountingModel:
    """The model, recording the number of tokens of every forward pass."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.num_tokens: list[int] = []

    def __call__(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        self.num_tokens.append(len(input_ids))
        return self.model(input_ids, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class _LaggingCopier(HostCopier):
    """CPU copies, but reported asynchronous: the runner overlaps them as on CUDA."""

    @property
    def is_async(self) -> bool:
        return True


def _counting_runner(model_dir: Path, lagging: bool = False) -> tuple[ModelRunner, _CountingModel]:
    runner = make_runner(model_dir)
    model = _CountingModel(runner.model)
    runner.model = model  # type: ignore[assignment]
    if lagging:
        runner.copier = _LaggingCopier(runner.device)
    return runner, model


def _new(request_id: str, **sampling: Any) -> NewRequestData:
    prompt = PROMPTS[request_id]
    return NewRequestData(
        request_id, prompt, len(prompt), 0, BLOCKS[request_id], SamplingOptions(temperature=0.0, **sampling)
    )


def _first_round(num_steps: int, **sampling_a: Any) -> ExecuteRound:
    return ExecuteRound(
        round_id=0,
        num_steps=num_steps,
        new_requests=[_new("a", **sampling_a), _new("b")],
        num_scheduled_tokens=[len(PROMPTS["a"]), len(PROMPTS["b"])],
    )


def _run(runner: ModelRunner, round_: ExecuteRound) -> list[StepOutput]:
    steps: list[SampledStep] = []
    runner.execute_round(round_, steps.append)
    return [s.to_step_output() for s in steps]


def _tokens(outputs: list[StepOutput], request_id: str) -> list[int]:
    return [out.token_ids[out.request_ids.index(request_id)] for out in outputs]


@pytest.fixture(scope="module")
def solo(llama_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens of each request alone, computed to the end of a 6-step round."""
    out = {}
    for request_id in PROMPTS:
        runner = make_runner(llama_dir)
        prompt = PROMPTS[request_id]
        new = NewRequestData(
            request_id, prompt, len(prompt), 0, [0], SamplingOptions(temperature=0.0, ignore_eos=True)
        )
        outputs = _run(runner, ExecuteRound(0, num_steps=6, new_requests=[new], num_scheduled_tokens=[len(prompt)]))
        out[request_id] = _tokens(outputs, request_id)
    return out


def _first_new_token_step(tokens: list[int]) -> int:
    """The first step whose token did not occur before (a stop id there stops exactly at it)."""
    return next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 1)


@pytest.mark.parametrize("num_steps", [1, 4])
def test_cpu_step_is_handed_on_before_the_next_forward(llama_dir: Path, num_steps: int) -> None:
    runner, model = _counting_runner(llama_dir)
    emitted: list[tuple[int, int]] = []
    stamps: list[int] = []  # when each step's tokens were on the host, as its StepOutput tells the scheduler

    def on_step(step: SampledStep) -> None:
        emitted.append((step.step_index, len(model.num_tokens)))
        stamps.append(step.to_step_output().sampled_unix_ns)

    started = time.time_ns()
    runner.execute_round(_first_round(num_steps), on_step)
    assert emitted == [(k, k + 1) for k in range(num_steps)]
    assert started < stamps[0] and stamps == sorted(stamps) and stamps[-1] <= time.time_ns()


def test_overlapped_path_hands_step_on_after_launching_the_next(llama_dir: Path) -> None:
    runner, model = _counting_runner(llama_dir, lagging=True)
    emitted: list[tuple[int, int]] = []
    runner.execute_round(_first_round(4), lambda step: emitted.append((step.step_index, len(model.num_tokens))))
    assert emitted == [(0, 2), (1, 3), (2, 4), (3, 4)]


def test_row_at_max_tokens_leaves_the_later_steps(llama_dir: Path, solo: dict[str, list[int]]) -> None:
    for lagging in (False, True):  # max_tokens is known in advance: no lag on the overlapped path
        runner, model = _counting_runner(llama_dir, lagging)
        outputs = _run(runner, _first_round(5, max_tokens=2))
        assert model.num_tokens == [12, 2, 1, 1, 1]
        assert all(out.request_ids == ["a", "b"] for out in outputs)
        assert _tokens(outputs, "a") == [*solo["a"][:2], 0, 0, 0]  # placeholders after its last token
        assert _tokens(outputs, "b") == solo["b"][:5]
        assert outputs[-1].is_last_step and [o.step_index for o in outputs] == list(range(5))


@pytest.mark.parametrize("lagging", [False, True])
def test_row_at_stop_token_leaves_the_later_steps(
    llama_dir: Path, solo: dict[str, list[int]], lagging: bool
) -> None:
    stop_step = _first_new_token_step(solo["a"])
    assert stop_step <= 3, "pick prompts whose greedy output repeats less"
    runner, model = _counting_runner(llama_dir, lagging)
    outputs = _run(runner, _first_round(6, stop_token_ids=(solo["a"][stop_step],)))
    # CPU: gone from the next step; overlapped: the next step was launched before the stop was seen.
    last_computed = stop_step + (1 if lagging else 0)
    assert model.num_tokens == [12] + [2] * last_computed + [1] * (5 - last_computed)
    assert _tokens(outputs, "a")[: stop_step + 1] == solo["a"][: stop_step + 1]
    assert _tokens(outputs, "b") == solo["b"]


def test_min_tokens_keeps_a_stop_token_row_in_the_batch(llama_dir: Path, solo: dict[str, list[int]]) -> None:
    runner, model = _counting_runner(llama_dir)
    _run(runner, _first_round(4, stop_token_ids=(solo["a"][0],), min_tokens=4))
    assert model.num_tokens == [12, 2, 2, 2]  # the stop id is masked until 4 tokens are out


def test_row_stopped_in_an_earlier_round_is_left_out_of_a_round_sent_before(
    llama_dir: Path, solo: dict[str, list[int]]
) -> None:
    runner, model = _counting_runner(llama_dir)
    _run(runner, _first_round(3, max_tokens=2))  # a finishes at step 1
    # The scheduler sent the next round before it saw a finish: a is in it, as a decode.
    second = ExecuteRound(
        round_id=1,
        num_steps=3,
        cached_requests=CachedRequestData(["a", "b"], [[], []]),
        num_scheduled_tokens=[1, 1],
    )
    model.num_tokens.clear()
    outputs = _run(runner, second)
    assert model.num_tokens == [1, 1, 1]
    assert all(out.request_ids == ["a", "b"] and out.token_ids[0] == 0 for out in outputs)
    assert _tokens(outputs, "b") == solo["b"][3:6]


def test_abort_before_a_new_rows_prefill_keeps_it_sampling_in_the_rounds_sent_before(
    llama_dir: Path, solo: dict[str, list[int]]
) -> None:
    """b is aborted before its first round starts: that round computes only a, and the round
    queued behind it (b as a decode, as the scheduler planned) still lists b with placeholders,
    instead of taking b's one token for a prefill chunk and leaving it out of the step."""
    runner, model = _counting_runner(llama_dir)
    runner.abort(["b"])
    first = _run(runner, _first_round(3, ignore_eos=True))
    second = _run(runner, ExecuteRound(round_id=1, num_steps=3, cached_requests=CachedRequestData(
        ["a", "b"], [[], []]), num_scheduled_tokens=[1, 1]))
    assert model.num_tokens == [len(PROMPTS["a"]), 1, 1, 1, 1, 1], "b computed nothing"
    assert all(out.request_ids == ["a", "b"] and out.token_ids[1] == 0 for out in first + second)
    assert _tokens(first + second, "a") == solo["a"]


def test_placeholders_carry_no_top_logprobs(llama_dir: Path) -> None:
    runner, _ = _counting_runner(llama_dir)
    round_ = _first_round(3, max_tokens=1, logprobs=2)
    round_.new_requests[1] = NewRequestData(
        "b", PROMPTS["b"], len(PROMPTS["b"]), 0, BLOCKS["b"], SamplingOptions(temperature=0.0, logprobs=1)
    )
    outputs = _run(runner, round_)
    assert [out.num_top_logprobs for out in outputs] == [[2, 1], [0, 1], [0, 1]]
    assert [len(out.top_token_ids) for out in outputs] == [3, 1, 1]
    assert all(len(out.logprobs) == 2 for out in outputs)


def test_all_rows_finished_gives_empty_steps(llama_dir: Path) -> None:
    runner, model = _counting_runner(llama_dir)
    round_ = _first_round(4, max_tokens=1)
    round_.new_requests[1] = NewRequestData(
        "b", PROMPTS["b"], len(PROMPTS["b"]), 0, BLOCKS["b"], SamplingOptions(temperature=0.0, max_tokens=2)
    )
    outputs = _run(runner, round_)
    assert model.num_tokens == [12, 1]
    assert [out.token_ids[0] for out in outputs[1:]] == [0, 0, 0]
    assert [len(out.token_ids) for out in outputs] == [2, 2, 2, 2] and outputs[-1].is_last_step


def test_stop_table_follows_the_scheduler_rule() -> None:
    table = StopTable(eos_token_ids=(2,), initial_rows=1)
    table.add(0, SamplingOptions(max_tokens=5))
    table.add(1, SamplingOptions(max_tokens=5, ignore_eos=True, stop_token_ids=(7, 8, 9)))
    table.add(2, SamplingOptions(max_tokens=5, min_tokens=2))
    rows = np.array([0, 1, 2])
    table.observe(rows, np.array([2, 2, 2]), np.array([1, 1, 2]))  # EOS: row 1 ignores it, row 2 is at min
    assert table.stopped.tolist()[:3] == [True, False, False]
    table.observe(rows[1:], np.array([9, 2]), np.array([2, 3]))
    assert table.stopped.tolist()[:3] == [True, True, True]
    table.add(1, SamplingOptions(max_tokens=3))  # a new request on a freed row starts afresh
    assert not table.stopped[1]
    table.observe(rows[1:2], np.array([5]), np.array([3]))  # max_tokens
    assert table.stopped[1]
