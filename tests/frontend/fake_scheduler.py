"""A fake SchedulerService for frontend tests: deterministic tokens, no model, honours aborts.

Each added request "generates" `script(prompt_token_ids)` cyclically (by default the
prompt's non-special tokens echoed back), `tokens_per_step` tokens per step, one StepUpdates
per step for all running requests. It stops on EOS / stop_token_ids (after min_tokens) and
max_tokens like the real scheduler, records every message it receives, and can fail
requests or break the stream on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from shared.pb.spindle.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

EOS = 1


def echo_script(prompt: list[int]) -> list[int]:
    """Echo the prompt's non-special tokens (ids >= 4), or token 5 for an all-special prompt."""
    return [t for t in prompt if t >= 4] or [5]


@dataclass
class FakeRequest:
    add: scheduler_pb2.AddRequest
    output: list[int]
    num_generated: int = 0
    num_updates: int = 0


@dataclass
class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Configure with attributes; inspect `added`, `aborted`, `add_batches`, `num_connects`.

    Embed and score requests finish in one step with `fake_pooled(add)`.
    """

    ready: bool = True
    task: int = common_pb2.REQUEST_KIND_GENERATE
    max_model_len: int = 128
    vocab_size: int = 512
    step_interval_s: float = 0.002
    tokens_per_step: int = 1
    num_cached_tokens: int = 0
    normalizes_embeddings: bool = True  # False: an older scheduler that drops AddRequest.normalize
    script: Callable[[list[int]], list[int]] = echo_script
    # Called for each new request; a RequestError returned fails it on its first step.
    error_for: Callable[[scheduler_pb2.AddRequest], common_pb2.RequestError | None] = lambda add: None
    added: list[scheduler_pb2.AddRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    add_batches: list[int] = field(default_factory=list)  # len of each AddRequests message
    num_connects: int = 0
    running: dict[str, FakeRequest] = field(default_factory=dict)
    _break: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for_abort(self, timeout_s: float = 5.0) -> list[str]:
        """The aborted ids once at least one abort arrived (aborts travel asynchronously)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.aborted and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return self.aborted

    async def GetSchedulerInfo(self, request: scheduler_pb2.GetSchedulerInfoRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> scheduler_pb2.GetSchedulerInfoResponse:
        return scheduler_pb2.GetSchedulerInfoResponse(
            ready=self.ready, model_id="fake", task=self.task,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size, num_workers=1,
            num_kv_blocks=64, block_size=16, max_request_tokens=self.max_model_len,
            normalizes_embeddings=self.normalizes_embeddings,
        )

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.ConnectResponse]:
        self.num_connects += 1
        self._break = asyncio.Event()
        wake = asyncio.Event()
        reader = asyncio.create_task(self._read(request_iterator, wake))
        try:
            while not reader.done() and not self._break.is_set():
                if not self.running:
                    wake.clear()
                    await _first(wake.wait(), self._break.wait(), reader)
                    continue
                await asyncio.sleep(self.step_interval_s)
                updates = [self._step(r) for r in list(self.running.values())]
                for update in updates:
                    if update.stop_reason or update.HasField("error"):
                        self.running.pop(update.request_id, None)
                yield scheduler_pb2.ConnectResponse(step=scheduler_pb2.StepUpdates(updates=updates))
            if self._break.is_set():
                self.running.clear()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake scheduler restarted")
        finally:
            reader.cancel()

    def break_stream(self) -> None:
        """End the current Connect stream with UNAVAILABLE (as a crashed scheduler would)."""
        self._break.set()

    async def _read(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                    wake: asyncio.Event) -> None:
        async for message in request_iterator:
            if message.WhichOneof("message") == "add":
                self.add_batches.append(len(message.add.requests))
                for add in message.add.requests:
                    self.added.append(add)
                    # A re-submission continues after the tokens its client already has.
                    self.running[add.request_id] = FakeRequest(add, self.script(list(add.prompt_token_ids)),
                                                               num_generated=len(add.output_token_ids))
            else:
                self.aborted.extend(message.abort.request_ids)
                for request_id in message.abort.request_ids:
                    self.running.pop(request_id, None)
            wake.set()

    def _step(self, req: FakeRequest) -> scheduler_pb2.RequestUpdate:
        add = req.add
        update = scheduler_pb2.RequestUpdate(request_id=add.request_id,
                                             num_prompt_tokens=len(add.prompt_token_ids),
                                             num_cached_tokens=self.num_cached_tokens)
        error = self.error_for(add) if req.num_updates == 0 else None
        req.num_updates += 1
        if error is not None:
            update.error.CopyFrom(error)
            return update
        if add.kind != common_pb2.REQUEST_KIND_GENERATE:
            update.pooled.extend(fake_pooled(add))
            update.stop_reason = common_pb2.STOP_REASON_POOLED
            return update
        sampling = add.sampling
        for _ in range(self.tokens_per_step):
            token = req.output[req.num_generated % len(req.output)]
            req.num_generated += 1
            update.token_ids.append(token)
            if sampling.HasField("logprobs"):
                _add_logprobs(update, token, req.num_generated, sampling.logprobs, self.vocab_size)
            can_stop = req.num_generated >= sampling.min_tokens
            if can_stop and ((token == EOS and not sampling.ignore_eos) or token in sampling.stop_token_ids):
                update.stop_reason = common_pb2.STOP_REASON_STOP_TOKEN
                update.stop_token_id = token
                break
            if req.num_generated >= sampling.max_tokens:
                update.stop_reason = common_pb2.STOP_REASON_LENGTH
                break
        return update


def fake_pooled(add: scheduler_pb2.AddRequest) -> list[float]:
    """Embed: [num tokens, sum of ids mod 97, 1]. Score: one logit, (second-segment tokens - 3) / 2."""
    ids = list(add.prompt_token_ids)
    if add.kind == common_pb2.REQUEST_KIND_EMBED:
        return [float(len(ids)), float(sum(ids) % 97), 1.0]
    return [(sum(add.token_type_ids) - 3) / 2]


def _add_logprobs(update: scheduler_pb2.RequestUpdate, token: int, position: int, num_top: int,
                  vocab_size: int) -> None:
    """Deterministic logprobs: the chosen token at -0.1 * position, alternatives below it."""
    update.logprobs.append(-0.1 * position)
    update.num_top_logprobs = num_top
    for j in range(num_top):
        update.top_token_ids.append((token + j) % vocab_size)
        update.top_logprobs.append(-0.1 * position - j)


async def _first(*awaitables: object) -> None:
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in awaitables]  # type: ignore[arg-type]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task, awaitable in zip(tasks, awaitables, strict=True):
            if task is not awaitable:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def start_fake_scheduler(fake: FakeScheduler) -> tuple[grpc.aio.Server, str]:
    """Serve `fake` on a free loopback port; returns the server and its address."""
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
