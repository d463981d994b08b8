"""The LM head's int8 screen (kernels/csrc/head_screen.cpp, models/greedy_step.py `head_screen`)
picks the full float32 head's greedy tokens, answers nothing where it cannot decide, and is what
a greedy step of up to four rows reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_greedy_step import GREEDY, _generate, _runner

from services.worker.models.greedy_step import DISABLE_SCREEN_ENV, head_screen

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _screen(head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    screen, scales, errors, max_abs, max_row_l1 = head_screen(head, None,
                                                              SimpleNamespace(weights=[torch.ones(head.shape[1])]))
    assert screen is not None and scales is not None and errors is not None
    return screen, scales, errors, max_abs, max_row_l1


def _full_head_tokens(x: torch.Tensor, head: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a one-row step without the screen picks for each row of x (linear_small_m at one row,
    its logits rounded to x's dtype, then argmax)."""
    return torch.cat([torch.ops.spindle.argmax_rows(torch.ops.spindle.linear_small_m(x[m : m + 1], head, bias, True))
                      for m in range(x.shape[0])])


@pytest.mark.parametrize(("vocab", "hidden"), [(8192, 256), (1000, 100), (37, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
def test_screen_picks_the_full_heads_tokens(vocab: int, hidden: int, with_bias: bool, head_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab + hidden)
    for trial in range(12):
        head = (torch.randn(vocab, hidden, generator=gen) * 0.2).to(head_dtype)
        bias = torch.randn(vocab, generator=gen) if with_bias else None
        rows = 1 + trial % 4
        x = torch.randn(rows, hidden, generator=gen) * (1 + trial)
        if trial % 3 == 0:  # a cluster of near-ties at the top: several candidates to tell apart
            head[1:40] = head[0] + torch.randn(min(39, vocab - 1), hidden, generator=gen).to(head_dtype) * 1e-3
            x[:] = head[0].float() * 3
        tokens = torch.ops.spindle.screened_argmax(x, head, *_screen(head), bias)
        assert tokens is not None
        assert torch.equal(tokens, _full_head_tokens(x, head, bias))


@pytest.mark.parametrize("one_row_pairs", [False, True])
@pytest.mark.parametrize(("vocab", "hidden"), [(8192, 256), (1000, 100), (37, 64)])
def test_screen_picks_the_full_heads_tokens_for_bf16_activations(vocab: int, hidden: int, one_row_pairs: bool) -> None:
    """bfloat16 x: the full head's logits are rounded to bfloat16, so near-ties become ties, and
    the first of them must win; its one-row kernel (k pairs or row_dot) decides each sum's rounding."""
    torch.ops.spindle.set_one_row_pairs(one_row_pairs)
    try:
        gen = torch.Generator().manual_seed(vocab * hidden)
        for trial in range(12):
            head = (torch.randn(vocab, hidden, generator=gen) * 0.2).bfloat16()
            x = (torch.randn(1 + trial % 4, hidden, generator=gen) * (1 + trial)).bfloat16()
            if trial % 3 == 0:  # rows whose logits round to the same bfloat16 value
                head[1:40] = head[0] + (torch.randn(min(39, vocab - 1), hidden, generator=gen) * 1e-2).bfloat16()
                x[:] = head[0] * 3
            tokens = torch.ops.spindle.screened_argmax(x, head, *_screen(head), None)
            assert tokens is not None
            assert torch.equal(tokens, _full_head_tokens(x, head, None))
    finally:
        torch.ops.spindle.set_one_row_pairs(False)  # as the library loads; a model's loader sets its own


def test_any_number_of_rows() -> None:
    """The op takes x's rows in groups (four at a time on VNNI): 5-9 rows and none answer as each
    row alone would, though greedy steps pass it at most four."""
    gen = torch.Generator().manual_seed(4)
    head = torch.randn(1000, 96, generator=gen) * 0.2
    screen = _screen(head)
    for rows in (5, 8, 9):
        x = torch.randn(rows, 96, generator=gen)
        tokens = torch.ops.spindle.screened_argmax(x, head, *screen, None)
        assert tokens is not None and torch.equal(tokens, _full_head_tokens(x, head, None))
    empty = torch.ops.spindle.screened_argmax(torch.zeros(0, 96), head, *screen, None)
    assert empty is not None and empty.shape == (0,)


def test_exact_ties_go_to_the_first_index() -> None:
    head = torch.randn(500, 64, generator=torch.Generator().manual_seed(1))
    head[300] = head[120]
    head[450] = head[120]
    x = (head[120] * 5).unsqueeze(0)
    assert torch.ops.spindle.screened_argmax(x, head, *_screen(head), None).tolist() == [120]


def test_undecided_steps_answer_nothing() -> None:
    head = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    screen = _screen(head)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 64)
        x[1, 5] = bad
        assert torch.ops.spindle.screened_argmax(x, head, *screen, None) is None
    flat = torch.ones(300, 64)  # every row ties: more candidates than the screen resolves
    assert torch.ops.spindle.screened_argmax(torch.ones(1, 64), flat, *_screen(flat), None) is None


def test_the_screen_decides_which_rows_are_computed() -> None:
    """A float32 row the screen rules out is never read: changing it leaves the token."""
    gen = torch.Generator().manual_seed(3)
    head = torch.randn(2000, 128, generator=gen) * 0.2
    x = torch.randn(1, 128, generator=gen)
    screen = _screen(head)
    token = torch.ops.spindle.screened_argmax(x, head, *screen, None)
    assert token is not None and torch.equal(token, _full_head_tokens(x, head, None))
    loser = int(torch.argmin(x @ head.T))
    head[loser] = x[0] * 100  # the full head would now pick it; the screen still sees the old row
    assert torch.ops.spindle.screened_argmax(x, head, *screen, None).tolist() == token.tolist()


def test_head_screen_built_only_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    head = torch.randn(1000, 64)
    small_stack = SimpleNamespace(weights=[torch.zeros(64, 64)])
    screen, scales, errors, max_abs, max_row_l1 = head_screen(head, None, small_stack)
    assert screen is not None and screen.dtype == torch.int8 and scales is not None and errors is not None
    assert int(screen.abs().amax(dim=1).min()) == 127, "each row's largest weight is +-127"
    rounding = screen.double() * scales.double()[:, None] - head.double()
    assert torch.all(rounding.abs() <= scales[:, None] / 2 * 1.0001)
    assert torch.all(rounding.norm(dim=1) <= errors.double()), "errors bound each row's rounding"
    assert torch.all(errors.double() <= rounding.norm(dim=1) * 1.00001)
    assert max_abs == float(head.abs().max())
    assert max_row_l1 == pytest.approx(float(head.abs().sum(dim=1).max()), rel=1e-6)
    assert head_screen(head.bfloat16(), None, small_stack)[0] is not None, "bfloat16 weights under float32 activations"
    assert head_screen(head.half(), None, small_stack)[0] is None, "float16"
    assert head_screen(head.T, None, small_stack)[0] is None, "a strided head"
    big_stack = SimpleNamespace(weights=[torch.zeros(64, 64 * 1000 * 20)])
    assert head_screen(head, None, big_stack)[0] is None, "a small share"
    # The medium benchmark model's shares: a float32 head saves 6.4 % of a step's bytes, a bf16 one 4.3 %.
    assert head_screen(head, None, SimpleNamespace(weights=[torch.zeros(64, 11000)]))[0] is not None, "6.2 %"
    medium_bf16 = SimpleNamespace(weights=[torch.zeros(64, 11000, dtype=torch.bfloat16)])
    assert head_screen(head.bfloat16(), None, medium_bf16)[0] is None, "4.2 %"
    bf16_stack = SimpleNamespace(weights=[torch.zeros(64, 64, dtype=torch.bfloat16)])
    assert head_screen(head.bfloat16(), None, bf16_stack)[0] is not None, "bfloat16 activations and head"
    assert head_screen(head, None, bf16_stack)[0] is None, "bfloat16 activations, float32 head"
    assert head_screen(head.bfloat16(), torch.zeros(1000).bfloat16(), bf16_stack)[0] is None, "... with a bias"
    assert head_screen(head.half(), None, SimpleNamespace(weights=[torch.zeros(64).half()]))[0] is None, "float16"
    assert head_screen(head, torch.zeros(1000), small_stack)[0] is not None, "a float32 bias"
    assert head_screen(head, torch.zeros(1000).bfloat16(), small_stack)[0] is None, "a bfloat16 bias"
    assert head_screen(head, torch.zeros(2000)[::2], small_stack)[0] is None, "a strided bias"
    monkeypatch.setenv(DISABLE_SCREEN_ENV, "1")
    assert head_screen(head, None, small_stack)[0] is None


def test_greedy_steps_of_up_to_four_rows_read_the_screen(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of one to four rows are decided by the screen, steps of more by the full head,
    and both sample the Python path's tokens."""
    runner = _runner(llama_dir)
    step = runner.model.greedy_step
    assert step is not None and step.screen is not None
    for rows, most_screened in ((1, 19), (4, 4 * 19), (5, 0)):
        requests = {f"r{i}": ([3 + i, 17, 42, 5 + i], GREEDY) for i in range(rows)}
        python, _ = _generate(runner, False, requests, monkeypatch)
        before = torch.ops.spindle.head_screen_counts()
        screened, calls = _generate(runner, True, requests, monkeypatch)
        decided, undecided = (a - b for a, b in zip(torch.ops.spindle.head_screen_counts(), before, strict=True))
        assert screened == python
        assert decided + undecided == (rows * calls if rows <= 4 else 0)
        assert decided >= most_screened * 3 // 4, "the screen left most steps to the full head"
