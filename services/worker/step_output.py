"""`SampledStep` / `PooledStep`: one step's results on their way to the host, and their conversion.

On CUDA the device -> host copy runs on a side stream into pinned memory and is awaited only
after the next step has been launched. `to_step_output` (the .tolist() work) is meant to run
on the asyncio side, off the compute thread.
"""

from __future__ import annotations

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
    request_ids: list[str]
    rows: np.ndarray | None = None  # [S] RequestStates rows of request_ids (worker-internal)
    token_ids: torch.Tensor | None = None  # [S] int64, host
    logprobs: torch.Tensor | None = None  # [S] float32, host
    top_token_ids: torch.Tensor | None = None  # [S, N] host
    top_logprobs: torch.Tensor | None = None  # [S, N] host
    num_top_logprobs: np.ndarray | None = None  # [S] entries of the top-N each request asked for
    copied: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Block until the host tensors hold the step's values (no-op on CPU)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def to_step_output(self) -> StepOutput:
        out = StepOutput(
            round_id=self.round_id,
            step_index=self.step_index,
            request_ids=self.request_ids,
            is_last_step=self.is_last_step,
        )
        if self.token_ids is None:
            return out
        out.token_ids = self.token_ids.tolist()
        if self.logprobs is not None:
            out.logprobs = self.logprobs.tolist()
        if (
            self.top_token_ids is not None
            and self.top_logprobs is not None
            and self.num_top_logprobs is not None
        ):
            keep = np.arange(self.top_token_ids.shape[1])[None, :] < self.num_top_logprobs[:, None]
            out.num_top_logprobs = self.num_top_logprobs.tolist()
            out.top_token_ids = self.top_token_ids.numpy()[keep].tolist()
            out.top_logprobs = self.top_logprobs.numpy()[keep].tolist()
        return out


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
