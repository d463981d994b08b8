"""spindle's claim-and-finish pool (kernels/csrc/work_pool.h): kernels called inside a
`work_pool_scope` split their work on it and compute exactly what they compute on torch's
OpenMP threads; scopes are per thread, and only decode rounds that run on the native stack
open one (models/native_stack.py). The stack on the pool, bit for bit, is in
test_native_stack.py; served greedy output against transformers in tests/e2e.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker import model_runner
from services.worker.attention import create_backend
from services.worker.models.fast_linear import FastLinear
from services.worker.models.loader import load_model
from services.worker.models.native_stack import fits_pool, work_pool_scope
from services.worker.step_output import SampledStep
from shared.execute import ExecuteRound, NewRequestData
from shared.sampling import SamplingOptions
from tests.worker.worker_harness import make_runner

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """The pool has a helper only with two or more torch threads (one: every call runs inline)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _calls() -> list[tuple[str, Callable[[], torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    x1, x5 = torch.randn(1, 384, generator=gen), torch.randn(5, 384, generator=gen)
    w, wb = torch.randn(1000, 384, generator=gen), torch.randn(1000, 384, generator=gen).bfloat16()
    gate_up = torch.randn(64, 2 * 1536, generator=gen)
    logits = torch.randn(48, 8192, generator=gen)
    return [
        ("linear, one row", lambda: torch.ops.spindle.linear_small_m(x1, w, None)),
        ("linear, five rows, bf16 weights", lambda: torch.ops.spindle.linear_small_m(x5, wb, None)),
        ("act_and_mul", lambda: torch.ops.spindle.act_and_mul(gate_up, 0)),
        ("argmax", lambda: torch.ops.spindle.argmax_rows(logits)),
    ]


def _pool_threads() -> list[str]:
    names = [p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")]
    return [n for n in names if n.startswith("spindle-pool")]


def _pool_thread_policies(settled: int, timeout_s: float = 5.0) -> list[int]:
    """The scheduling policy of each of this process's pool helpers, once there is one and all have
    `settled` (or at `timeout_s`: what they have then). A helper names itself and then sets its
    policy on its own thread as it starts, after the call that started it may have returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        policies = [os.sched_getscheduler(int(p.parent.name)) for p in Path("/proc/self/task").glob("*/comm")
                    if p.read_text().startswith("spindle-pool")]
        if (policies and all(p == settled for p in policies)) or time.monotonic() > deadline:
            return policies
        time.sleep(0.01)


def _after_openmp_spin() -> None:
    """Waits out OpenMP's spin after the calls outside a scope: until then the caller runs pool
    calls alone (work_pool.cpp, kOpenMpSpin)."""
    time.sleep(0.02)


def test_kernels_in_a_scope_compute_what_they_compute_outside() -> None:
    for name, call in _calls():
        want = call()
        _after_openmp_spin()
        with work_pool_scope():
            got = [call() for _ in range(20)]  # many jobs: helpers asleep, waking and spinning
        for g in got:
            assert torch.equal(g, want), name
    assert "spindle-pool-0" in _pool_threads(), "a helper beside the calling thread, named for top and py-spy"


def test_helpers_give_their_core_to_any_other_thread_at_once() -> None:
    """SCHED_IDLE (work_pool.cpp says why): the worker's event loop and the host services
    preempt a helper the moment they wake, and the caller takes the chunks it leaves."""
    _after_openmp_spin()
    with work_pool_scope():
        for _, call in _calls():
            call()
    policies = _pool_thread_policies(os.SCHED_IDLE)
    assert policies and all(p == os.SCHED_IDLE for p in policies)


def test_the_switch_keeps_helpers_at_the_default_policy() -> None:
    probe = """
import os, time, torch
from services.worker.kernels.build import load_kernels
from services.worker.models.native_stack import work_pool_scope
from tests.worker.test_work_pool import _pool_thread_policies
load_kernels()
torch.set_num_threads(2)
x, w = torch.randn(1, 384), torch.randn(1000, 384)
time.sleep(0.02)
with work_pool_scope():
    torch.ops.spindle.linear_small_m(x, w, None)
print(_pool_thread_policies(os.SCHED_OTHER))
"""
    env = {**os.environ, "SPINDLE_DISABLE_IDLE_HELPERS": "1"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], env=env,
                            capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip().splitlines()[-1] == f"[{os.SCHED_OTHER}]"


def test_scopes_on_two_threads_at_once_each_get_their_answers() -> None:
    calls = _calls()
    wants = [call() for _, call in calls]
    _after_openmp_spin()
    errors: list[str] = []

    def run() -> None:
        with work_pool_scope():
            for _ in range(30):
                for (name, call), want in zip(calls, wants, strict=True):
                    if not torch.equal(call(), want):  # the pool is busy half the time: OpenMP then
                        errors.append(name)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_closing_a_scope_that_is_not_open_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no work pool scope is open"):
        torch.ops.spindle.work_pool_exit()


def test_steps_whose_every_layer_runs_the_kernels_fit_the_pool(llama_dir: Path) -> None:
    model = load_model(llama_dir, create_backend("paged", 16), torch.float32, torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, FastLinear):
            module.kernel_max_rows = 8
            module.kernel_at = b""  # nor the calibration's bands past them
            module.probe_s = ()  # no round rows past them
    model.lm_head.kernel_max_rows = 4
    model.build_native_stack()

    def opens(num_scheduled: list[int]) -> bool:
        return fits_pool(model, np.array(num_scheduled))

    assert opens([1]) and opens([1, 1, 1, 1])
    assert opens([1, 3]) and opens([8]), "prefill tokens within the layers' kernel rows"
    assert not opens([1] * 5), "past the LM head's kernel rows: oneDNN's OpenMP threads would run in it"
    assert not opens([1, 8]), "past the layers' kernel rows: the prefill chunk runs on oneDNN"
    assert not opens([])
    model.native_stack = None
    assert not opens([1])


def test_a_prompts_round_runs_its_decode_steps_on_the_pool(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 0 is a prompt too big for the kernels (oneDNN, OpenMP); the steps after it decode one
    row each and go on the pool (model_runner.py says why), with the tokens they had on OpenMP."""

    def tokens_and_threads() -> tuple[list[int], list[int]]:
        runner = make_runner(llama_dir, backend="paged")
        for module in runner.model.modules():
            if isinstance(module, FastLinear):
                module.kernel_max_rows = 8
                module.kernel_at = b""
                module.probe_s = ()
        runner.model.build_native_stack()
        prompt = list(range(3, 15))  # 12 tokens: past the layers' kernel rows
        round_ = ExecuteRound(round_id=0, num_steps=4, num_scheduled_tokens=[len(prompt)], new_requests=[
            NewRequestData("a", prompt, len(prompt), 0, [0, 1], SamplingOptions(max_tokens=8, temperature=0.0))])
        threads: list[int] = []  # torch's thread count on the compute thread as each step is handed on
        steps: list[SampledStep] = []
        _after_openmp_spin()
        runner.execute_round(round_, lambda step: threads.append(torch.get_num_threads()) or steps.append(step))
        return [t for s in steps for t in s.to_step_output().token_ids], threads

    tokens, threads = tokens_and_threads()
    assert threads == [2, 1, 1, 1], "step 0 on OpenMP's two threads, then in a pool scope (OpenMP: 1 inside)"
    monkeypatch.setattr(model_runner, "work_pool_scope", nullcontext)
    openmp_tokens, openmp_threads = tokens_and_threads()
    assert openmp_threads == [2, 2, 2, 2]
    assert tokens == openmp_tokens
