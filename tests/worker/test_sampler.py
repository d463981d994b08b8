"""Sampler: greedy, seeded sampling, truncation masks, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.worker.sampler import Sampler, apply_min_p, apply_top_k_top_p
from services.worker.sampling_state import SamplingState
from services.worker.step_output import HostCopier, SampledStep
from shared.execute import NewRequestData
from shared.sampling import SamplingOptions

V = 64
EOS = 1
CPU = torch.device("cpu")


def _state(
    options: list[SamplingOptions],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> tuple[SamplingState, Sampler, np.ndarray]:
    state = SamplingState(V, (EOS,), CPU)
    for row, opts in enumerate(options):
        prompt = prompts[row] if prompts else [5, 6, 7]
        output = outputs[row] if outputs else []
        state.add(row, NewRequestData(f"r{row}", prompt + output, len(prompt), 0, [0], opts))
    generator = torch.Generator().manual_seed(1234)
    return state, Sampler(state.penalty_tables, generator), np.arange(len(options))


def test_greedy_is_exactly_argmax_of_logits() -> None:
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(0))
    state, sampler, rows = _state([SamplingOptions(temperature=0.0)] * 8)
    out = sampler(logits.clone(), state.build(rows), step=0)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    options = [SamplingOptions(temperature=0.0 if i % 2 else 1.0, top_k=5) for i in range(6)]
    state, sampler, rows = _state(options)
    out = sampler(logits.clone(), state.build(rows), step=0)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))


def _seeded_tokens(
    batch: list[SamplingOptions], logits_row: torch.Tensor, seeded_row: int, steps: int
) -> list[int]:
    state, sampler, rows = _state(batch)
    md = state.build(rows)
    generator_logits = torch.Generator().manual_seed(99)
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(batch), V, generator=generator_logits)
        logits[seeded_row] = logits_row
        tokens.append(int(sampler(logits, md, step).token_ids[seeded_row]))
    return tokens


def test_seeded_sampling_is_reproducible_and_independent_of_batch() -> None:
    logits_row = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 0.5  # flat: many candidates
    seeded = SamplingOptions(temperature=1.0, seed=42)
    alone = _seeded_tokens([seeded], logits_row, 0, 12)
    again = _seeded_tokens([seeded], logits_row, 0, 12)
    crowded = _seeded_tokens(
        [SamplingOptions(temperature=0.7), seeded, SamplingOptions(temperature=1.0, seed=7)],
        logits_row,
        1,
        12,
    )
    assert alone == again == crowded
    assert len(set(alone)) > 3  # it really samples
    other_seed = _seeded_tokens([SamplingOptions(temperature=1.0, seed=43)], logits_row, 0, 12)
    assert other_seed != alone


def test_seeded_request_resumed_after_preemption_continues_the_same_stream() -> None:
    logits_row = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 0.5
    seeded = SamplingOptions(temperature=1.0, seed=42)
    full = _seeded_tokens([seeded], logits_row, 0, 6)
    state = SamplingState(V, (EOS,), CPU)  # re-added with 3 outputs already generated
    state.add(0, NewRequestData("r", [5, 6, 7, *full[:3]], 3, 0, [0], seeded))
    sampler = Sampler(state.penalty_tables, torch.Generator().manual_seed(0))
    md = state.build(np.arange(1))
    resumed = [int(sampler(logits_row[None].clone(), md, s).token_ids[0]) for s in range(3)]
    assert resumed == full[3:]


PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(~torch.isinf(row)).flatten().tolist() for row in logits]


def test_top_k_keeps_exactly_k_most_likely_tokens() -> None:
    logits = PROBS.log().repeat(3, 1)
    assert _kept(apply_top_k_top_p(logits, torch.tensor([1, 2, 5]), None)) == [[0], [0, 1], [0, 1, 2, 3, 4]]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = PROBS.log().repeat(3, 1)
    kept = _kept(apply_top_k_top_p(logits, None, torch.tensor([0.35, 0.6, 0.8])))
    assert kept == [[0], [0, 1], [0, 1, 2]]


def test_top_k_then_top_p_renormalises_over_the_kept_tokens() -> None:
    logits = PROBS.log()[None]
    # top-k 2 leaves 0.4/0.7 and 0.3/0.7; top-p 0.5 then needs only the first.
    assert _kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))) == [[0]]


def test_min_p_drops_tokens_below_fraction_of_the_top_probability() -> None:
    logits = PROBS.log().repeat(2, 1)
    assert _kept(apply_min_p(logits, torch.tensor([0.3, 0.5]))) == [[0, 1, 2], [0, 1]]


def test_sampling_with_top_k_only_draws_kept_tokens() -> None:
    logits = torch.zeros(1, V)
    logits[0, :4] = torch.tensor([3.0, 2.9, 2.8, 2.7])
    state, sampler, rows = _state([SamplingOptions(temperature=1.0, top_k=3)])
    md = state.build(rows)
    drawn = {int(sampler(logits.clone(), md, 0).token_ids[0]) for _ in range(200)}
    assert drawn == {0, 1, 2}


def _reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    out = list(logits)
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    for tok in set(output):
        out[tok] -= freq * output.count(tok) + pres
    return out


def test_penalties_match_reference_formula_and_update_incrementally() -> None:
    prompt, output = [2, 3, 3, 9], [3, 4, 4, 10]
    options = SamplingOptions(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25
    )
    state, sampler, rows = _state([SamplingOptions(temperature=0.0), options], [[5], prompt], [[], output])
    md = state.build(rows)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    logits[:, [2, 3, 9]] *= -1 * torch.sign(logits[:, [2, 3, 9]])  # some negative ...
    logits[:, [4, 10]] = logits[:, [4, 10]].abs()  # ... and some positive penalised logits
    penalised = logits.clone()
    state.penalty_tables.apply(penalised, md.penalties)
    expected = _reference_penalties(logits[1].tolist(), prompt, output, 1.3, 0.5, 0.25)
    assert penalised[1].tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(penalised[0], logits[0])  # the unpenalised row is untouched
    # Sampling records the chosen token on the device: the next step penalises it as output.
    logits_step = torch.full((2, V), -5.0)
    logits_step[:, 20] = 5.0
    assert sampler(logits_step.clone(), md, 0).token_ids.tolist() == [20, 20]
    again = torch.full((2, V), -5.0)
    again[:, 20] = 5.0
    state.penalty_tables.apply(again, md.penalties)
    assert again[1, 20].item() == pytest.approx(5.0 / 1.3 - 0.25 - 0.5)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.full((2, V), 0.0)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 8] = 8.0
    options = [
        SamplingOptions(temperature=0.0, min_tokens=3, stop_token_ids=(7,)),
        SamplingOptions(temperature=0.0),
    ]
    state, sampler, rows = _state(options, outputs=[[30], []])  # row 0 already generated 1 token
    md = state.build(rows)
    tokens = [sampler(logits.clone(), md, step).token_ids.tolist() for step in range(3)]
    # Row 0 has 1, 2, 3 outputs before steps 0, 1, 2: EOS and stop id 7 masked while < 3.
    assert tokens == [[8, EOS], [8, EOS], [EOS, EOS]]


def test_logprobs_of_chosen_and_top_n_per_request() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(8))
    options = [
        SamplingOptions(temperature=0.0, logprobs=2),
        SamplingOptions(temperature=0.0, logprobs=0),
        SamplingOptions(temperature=0.0),
    ]
    state, sampler, rows = _state(options)
    md = state.build(rows)
    out = sampler(logits.clone(), md, 0)
    reference = logits.log_softmax(-1)
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs, reference.gather(1, logits.argmax(-1)[:, None])[:, 0])
    step = (
        HostCopier(CPU).start(out, SampledStep(0, 0, True, ["a", "b", "c"]), md.num_logprobs).to_step_output()
    )
    assert step.num_top_logprobs == [2, 0, 0]
    top = reference[0].topk(2)
    assert step.top_token_ids == top.indices.tolist()
    assert step.top_logprobs == pytest.approx(top.values.tolist())
    assert step.logprobs[0] == pytest.approx(top.values[0].item())
    assert math.isfinite(step.logprobs[2])


def test_logit_bias_steers_greedy_and_random_rows_only_where_given() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(11))
    options = [
        SamplingOptions(temperature=0.0, logit_bias=((17, 100.0),)),
        SamplingOptions(temperature=1.0, seed=3, logit_bias=((5, 100.0), (int(logits[1].argmax()), -100.0))),
        SamplingOptions(temperature=0.0),
    ]
    state, sampler, rows = _state(options)
    out = sampler(logits.clone(), state.build(rows), step=0)
    assert out.token_ids.tolist() == [17, 5, int(logits[2].argmax())]


def test_logit_bias_minus_100_bans_a_token_under_sampling() -> None:
    logits = torch.zeros(1, V)
    logits[0, 9] = 5.0  # by far the most likely
    state, sampler, rows = _state([SamplingOptions(temperature=1.0, logit_bias=((9, -100.0),))])
    md = state.build(rows)
    tokens = {int(sampler(logits.clone(), md, step=0).token_ids[0]) for _ in range(50)}
    assert 9 not in tokens


def test_logprobs_are_raw_model_logprobs_before_bias_penalties_and_temperature() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(12))
    options = [
        SamplingOptions(temperature=0.0, logprobs=1, logit_bias=((3, 50.0),), repetition_penalty=1.5),
        SamplingOptions(temperature=0.5, seed=1, logprobs=1, presence_penalty=1.0),
    ]
    state, sampler, rows = _state(options, prompts=[[3, 4], [5, 6]])
    out = sampler(logits.clone(), state.build(rows), step=0)
    raw = logits.log_softmax(-1)
    assert out.token_ids[0] == 3  # the bias decided the token...
    assert out.logprobs is not None
    # ...but the reported logprob is the model's own
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_token_ids is not None
    assert torch.equal(out.top_token_ids[:, 0], logits.argmax(-1))
