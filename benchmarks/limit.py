"""The LIMIT: the same model's plain batched greedy decode loop with no serving around it.

Loads the checkpoint with transformers (float32, eval, inference mode) and runs a workload in
batches of `batch_size` (= the served concurrency): one batched prefill, then one forward per
output token with `past_key_values`. spindle's throughput divided by this loop's is the overhead
ratio (DESIGN.md, "Performance yardsticks"). `transformers generate` on the same batches is a
peer. Per-request figures are measured from the start of the request's batch:
TTFT = prefill, ITL = each decode step, E2E = the whole batch.

    python -m benchmarks.limit --model DIR --mode limit --batch-size 16 --num-requests 32
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.metrics import LoadSummary, RequestResult, summarize
from benchmarks.workload import WORKLOADS, BenchRequest, WorkloadSpec, build_workload

logger = logging.getLogger(__name__)


def machine_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the host's total)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_model(model_dir: str, num_threads: int | None = None) -> torch.nn.Module:
    """The checkpoint in float32, eval mode, with torch using `num_threads` (default: every core)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(num_threads or machine_cores())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    logger.info("loaded %s (%.1fM params) with %d torch threads", model_dir,
                sum(p.numel() for p in model.parameters()) / 1e6, torch.get_num_threads())
    return model


@dataclass(slots=True)
class _Padded:
    """A batch of prompts left-padded to one length; mask and positions only when lengths differ."""

    input_ids: torch.Tensor  # [batch, max_prompt_len]
    attention_mask: torch.Tensor | None  # [batch, max_prompt_len]
    position_ids: torch.Tensor | None  # [batch, max_prompt_len]


def _left_pad(prompts: Sequence[tuple[int, ...]], pad_id: int) -> _Padded:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    if all(len(p) == width for p in prompts):
        # The yardstick workload: equal lengths need no mask, the fastest plain path.
        return _Padded(ids, None, None)
    return _Padded(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))


def _pad_id(model: torch.nn.Module) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _timed_results(batch: Sequence[BenchRequest], stamps: Sequence[float], start: float) -> list[RequestResult]:
    """Per-request results from one timestamp per generated token (stamps[0] = after prefill)."""
    results = []
    for request in batch:
        own = stamps[: request.max_tokens]
        results.append(RequestResult(
            prompt_len=request.prompt_len, expected_output_tokens=request.max_tokens,
            output_tokens=len(own), ttft_s=own[0] - start,
            itls_s=[b - a for a, b in zip(own, own[1:], strict=False)], e2e_s=own[-1] - start))
    return results


def greedy_batch(model: torch.nn.Module, batch: Sequence[BenchRequest]) -> list[RequestResult]:
    """One batched prefill, then greedy decode steps with the KV cache until the longest request is done."""
    padded = _left_pad([r.prompt_token_ids for r in batch], _pad_id(model))
    mask, positions = padded.attention_mask, padded.position_ids
    num_steps = max(r.max_tokens for r in batch)
    stamps: list[float] = []
    start = time.perf_counter()
    out = model(input_ids=padded.input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    next_ids = out.logits[:, -1].argmax(-1)
    stamps.append(time.perf_counter())
    for _ in range(num_steps - 1):
        if mask is not None and positions is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            positions = positions[:, -1:] + 1
        out = model(input_ids=next_ids[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1)
        stamps.append(time.perf_counter())
    return _timed_results(batch, stamps, start)


class _StepClock:
    """A `generate` streamer that only notes when each step's tokens arrive (the first put is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.stamps.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        return None


def generate_batch(model: torch.nn.Module, batch: Sequence[BenchRequest]) -> list[RequestResult]:
    """`model.generate` greedy on the same padded batch, exactly max_tokens of the longest request."""
    padded = _left_pad([r.prompt_token_ids for r in batch], _pad_id(model))
    mask = padded.attention_mask if padded.attention_mask is not None else torch.ones_like(padded.input_ids)
    num_steps = max(r.max_tokens for r in batch)
    clock = _StepClock()
    start = time.perf_counter()
    model.generate(input_ids=padded.input_ids, attention_mask=mask, do_sample=False, min_new_tokens=num_steps,
                   max_new_tokens=num_steps, pad_token_id=_pad_id(model), streamer=clock)
    if len(clock.stamps) != num_steps:
        raise RuntimeError(f"generate produced {len(clock.stamps)} steps, expected {num_steps}")
    return _timed_results(batch, clock.stamps, start)


BatchRunner = Callable[[torch.nn.Module, Sequence[BenchRequest]], list[RequestResult]]
RUNNERS: dict[str, BatchRunner] = {"limit": greedy_batch, "generate": generate_batch}


@dataclass(frozen=True, slots=True)
class LimitRun:
    """Per-request results in workload order and their summary over the whole wall time."""

    results: list[RequestResult]
    summary: LoadSummary


def run_batches(model: torch.nn.Module, requests: Sequence[BenchRequest], batch_size: int, mode: str = "limit",
                warmup: Sequence[BenchRequest] = ()) -> LimitRun:
    """Run `requests` in consecutive batches of `batch_size` with the `mode` runner; wall time includes prefill."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if mode not in RUNNERS:
        raise ValueError(f"mode={mode!r} is not one of {sorted(RUNNERS)}")
    runner = RUNNERS[mode]
    results: list[RequestResult] = []
    with torch.inference_mode():
        if warmup:
            runner(model, warmup)
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            results += runner(model, requests[i : i + batch_size])
        duration = time.perf_counter() - start
    return LimitRun(results, summarize(results, duration))


def main(argv: Sequence[str] | None = None) -> None:
    from benchmarks.load_client import format_summary, warmup_spec

    p = argparse.ArgumentParser(prog="python -m benchmarks.limit", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--mode", default="limit", choices=sorted(RUNNERS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workload", default="random", choices=sorted(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = load_model(args.model, args.threads)
    spec = WorkloadSpec(kind=args.workload, num_requests=args.num_requests, input_len=args.input_len,
                        output_len=args.output_len, vocab_high=model.config.vocab_size, seed=args.seed)
    warmup = build_workload(warmup_spec(spec, min(args.batch_size, 8)))
    run = run_batches(model, build_workload(spec), args.batch_size, args.mode, warmup)
    sys.stdout.write(format_summary(run.summary))


if __name__ == "__main__":
    main()
