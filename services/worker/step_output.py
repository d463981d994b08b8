"""`SampledStep` / `PooledStep`: one step's results on their way to the host, and their conversion.

On CUDA the device -> host copy runs on a side stream into pinned memory and is awaited only
after the next step has been launched; on CPU the tensors are the host values already. A step
may cover only some of the round's sampling requests (`live`: the others stopped earlier, see
round_stops.py); its `StepOutput` still lists them all, with placeholder values for the rest.
`to_step_output` (the .tolist() work) is meant to run on the asyncio side, off the compute thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.sampler import SamplerOutput
from shared.execute import StepOutput


@dataclass(slots=True)
class SampledStep:
    """What one forward pass sampled, as host tensors (valid once the copy event completed)."""

    round_id: int
    step_index: int
    is_last_step: bool
    request_ids: list[str]  # every sampling request of the round, in batch order
    rows: np.ndarray | None = None  # [S] RequestStates rows of the computed entries (worker-internal)
    # [S] indices into request_ids of the entries this step computed; None: all of them.
    live: np.ndarray | None = None
    token_ids: torch.Tensor | None = None  # [S] int64, host
    logprobs: torch.Tensor | None = None  # [S] float32, host
    top_token_ids: torch.Tensor | None = None  # [S, N] host
    top_logprobs: torch.Tensor | None = None  # [S, N] host
    num_top_logprobs: np.ndarray | None = None  # [S] entries of the top-N each request asked for
    copied: torch.cuda.Event | None = None
    sampled_unix_ns: int = 0  # when its tokens were on the host (set by wait)

    def wait(self) -> None:
        """Block until the host tensors hold the step's values (no-op on CPU); note the time."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        self.sampled_unix_ns = time.time_ns()

    def to_step_output(self) -> StepOutput:
        out = StepOutput(
            round_id=self.round_id,
            step_index=self.step_index,
            request_ids=self.request_ids,
            is_last_step=self.is_last_step,
            sampled_unix_ns=self.sampled_unix_ns,
        )
        if not self.request_ids:
            return out
        n, live = len(self.request_ids), self.live
        if live is not None and len(live) == n:
            live = None  # every entry computed (live is ascending): no placeholders
        tokens = self.token_ids.numpy() if self.token_ids is not None else np.zeros(0, np.int64)
        out.token_ids = _spread(tokens, live, n).tolist()
        if self.logprobs is not None:
            out.logprobs = _spread(self.logprobs.numpy(), live, n).tolist()
        if (
            self.top_token_ids is not None
            and self.top_logprobs is not None
            and self.num_top_logprobs is not None
        ):
            keep = np.arange(self.top_token_ids.shape[1])[None, :] < self.num_top_logprobs[:, None]
            out.num_top_logprobs = _spread(self.num_top_logprobs, live, n).tolist()  # 0 for placeholders
            out.top_token_ids = self.top_token_ids.numpy()[keep].tolist()
            out.top_logprobs = self.top_logprobs.numpy()[keep].tolist()
        return out


def _spread(values: np.ndarray, live: np.ndarray | None, n: int) -> np.ndarray:
    """`values` of the computed entries at their places among `n`; 0 (a placeholder) elsewhere.

    The scheduler discards the placeholders: those requests finished at an earlier step.
    """
    if live is None:
        return values
    full = np.zeros(n, values.dtype)
    full[live] = values
    return full


@dataclass(slots=True)
class PooledStep:
    """A pooling round's step: one host vector per pooling request (step 0), or nothing."""

    round_id: int
    step_index: int
    is_last_step: bool
    request_ids: list[str] = field(default_factory=list)  # pooling requests, in batch order
    values: torch.Tensor | None = None  # [num_reqs, pooled_size] float32, host

    def wait(self) -> None:
        """No-op: the runner copies pooled values to the host before handing the step on."""

    def to_step_output(self) -> StepOutput:
        out = StepOutput(round_id=self.round_id, step_index=self.step_index, is_last_step=self.is_last_step)
        if self.values is not None:
            out.pooled = dict(zip(self.request_ids, self.values.tolist(), strict=True))
        return out


# What a runner hands to `on_step`.
StepResult = SampledStep | PooledStep


class HostCopier:
    """Starts device -> host copies of sampler outputs without blocking the compute stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def is_async(self) -> bool:
        """Whether a copy completes later (CUDA): worth launching the next step before waiting."""
        return self.stream is not None

    def start(
        self, out: SamplerOutput, step: SampledStep, num_top_logprobs: np.ndarray | None
    ) -> SampledStep:
        """Fill `step` with (soon-to-be) host copies of `out`; `step.wait()` completes them."""
        tensors = [out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs]
        if self.stream is None:
            step.token_ids, step.logprobs, step.top_token_ids, step.top_logprobs = tensors
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host = [None if t is None else _to_pinned(t, self.stream) for t in tensors]
                step.copied = torch.cuda.Event()
                step.copied.record(self.stream)
            step.token_ids, step.logprobs, step.top_token_ids, step.top_logprobs = host
        step.num_top_logprobs = num_top_logprobs if out.top_token_ids is not None else None
        return step


def _to_pinned(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    tensor.record_stream(stream)  # keep the device memory alive until the side stream has read it
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
