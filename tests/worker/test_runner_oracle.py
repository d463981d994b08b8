"""Runner oracle: greedy tokens from hand-built rounds equal transformers generate(do_sample=False).

A toy scheduler drives the runner in-process: chunked prefill of a long prompt across rounds,
a prefix-hit request sharing the first blocks of another, concurrent requests of different
lengths, a preempted request recomputed from prompt + output, num_steps 1 and 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from worker_harness import ToyScheduler, make_runner, run_round

from shared.execute import ExecuteRound, NewRequestData
from shared.sampling import SamplingOptions

MAX_TOKENS = 10


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1)
    long = torch.randint(4, 512, (40,), generator=gen).tolist()
    return {
        "long": long,  # 40 tokens: longer than mistral's window of 16, chunked by the token budget
        "shared": long[:35] + [7, 8, 9],  # same first blocks as "long": prefix-cache hit
        "short": torch.randint(4, 512, (5,), generator=gen).tolist(),
        "mid": torch.randint(4, 512, (17,), generator=gen).tolist(),
        "one": [42],
    }


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    out = {}
    for family, path in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out[family] = {
            name: model.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=3,
            )[0, len(p) :].tolist()
            for name, p in _prompts().items()
        }
    return out


@pytest.mark.parametrize("num_steps", [1, 4])
@pytest.mark.parametrize("backend", ["paged", "sdpa", "naive"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_greedy_tokens_match_transformers(
    tiny_models: dict[str, Path], references: dict, family: str, backend: str, num_steps: int
) -> None:
    runner = make_runner(tiny_models[family], backend, num_blocks=128)
    scheduler = ToyScheduler(runner, num_blocks=128, block_size=16, token_budget=24, num_steps=num_steps)
    for name, prompt in _prompts().items():
        scheduler.add(name, prompt, MAX_TOKENS)
    got = scheduler.run()
    assert scheduler.prefix_hit_tokens >= 16  # "shared" started from "long"'s first block
    assert got == references[family]


@pytest.mark.parametrize("backend", ["paged", "sdpa"])
def test_rounds_carrying_on_from_the_last_match_transformers(tiny_models: dict[str, Path], backend: str) -> None:
    """Decode rounds with the same rows as the round before start from its last step
    (ModelInputBuilder.resume), across block boundaries (block size 4, 4 steps a round)."""
    prompts = {name: _prompts()[name] for name in ("short", "mid")}
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    expected = {name: model.generate(torch.tensor([p]), max_new_tokens=26, do_sample=False, eos_token_id=None,
                                     pad_token_id=3)[0, len(p):].tolist() for name, p in prompts.items()}
    runner = make_runner(tiny_models["llama"], backend, num_blocks=64, block_size=4)
    scheduler = ToyScheduler(runner, num_blocks=64, block_size=4, token_budget=64, num_steps=4)
    for name, prompt in prompts.items():
        scheduler.add(name, prompt, 26)
    resumed = _count_resumed_rounds(runner)
    assert scheduler.run() == expected
    assert resumed[0] == 6  # every round after the prompts' (rounds 1-6 of 7)


def _count_resumed_rounds(runner) -> list[int]:  # type: ignore[no-untyped-def]
    count, resume = [0], runner.input_builder.resume

    def counting(*args):  # type: ignore[no-untyped-def]
        inputs = resume(*args)
        count[0] += inputs is not None
        return inputs

    runner.input_builder.resume = counting
    return count


def test_preempted_request_resumes_with_same_tokens(tiny_models: dict[str, Path], references: dict) -> None:
    runner = make_runner(tiny_models["llama"], "sdpa", num_blocks=128)
    scheduler = ToyScheduler(runner, num_blocks=128, block_size=16, token_budget=64, num_steps=2)
    prompts = _prompts()
    for name in ("mid", "short"):
        scheduler.add(name, prompts[name], MAX_TOKENS)
    for _ in range(3):
        scheduler.step()
    assert 0 < len(scheduler.requests[0].output) < MAX_TOKENS
    scheduler.preempt("mid")  # comes back as a new request with its output so far
    got = scheduler.run()
    assert got["mid"] == references["llama"]["mid"]
    assert got["short"] == references["llama"]["short"]


def test_multi_step_round_reaching_max_model_len(tiny_models: dict[str, Path]) -> None:
    runner = make_runner(tiny_models["llama"], "sdpa", num_blocks=8, max_model_len=16)
    prompt = _prompts()["long"][:12]
    round_ = ExecuteRound(
        round_id=0,
        num_steps=5,
        num_scheduled_tokens=[12],
        new_requests=[NewRequestData("x", prompt, 12, 0, [0, 1], SamplingOptions(temperature=0.0))],
    )
    tokens = [t for step in run_round(runner, round_) for t in step.token_ids]
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=3
    )[0, 12:].tolist()
    assert tokens == expected
