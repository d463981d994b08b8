"""n > 1: one API request as several scheduler requests (samples), and their merged events.

Why separate requests: the scheduler batches, preempts and places each sample on its own,
exactly like a single request, so streaming, multi-step, preemption and several workers need
nothing new. The prompt is still computed once: every later sample names the first in
`shares_prompt_with`, and the scheduler holds it until the first has put the prompt's full
blocks in the prefix cache, then shares them (services/scheduler/held_samples.py).

Seeds follow vLLM: sample i draws with seed + i, so the samples differ and each is
reproducible on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from services.frontend.messages import AddRequest, GenerateComplete, GenerateEvent, Usage

T = TypeVar("T")
_SEED_MODULUS = 2**64  # the seed is a uint64 on the wire


def sample_requests(add: AddRequest, num_samples: int) -> list[AddRequest]:
    """`add` as `num_samples` requests: ids `<id>-<i>`, seeds seed + i, later ones sharing the first's prompt.

    One sample keeps the request as it is (its id included).
    """
    if num_samples == 1:
        return [add]
    first_id = f"{add.request_id}-0"
    samples = []
    for i in range(num_samples):
        seed = add.sampling.seed
        sampling = add.sampling if seed is None else dataclasses.replace(add.sampling, seed=(seed + i) % _SEED_MODULUS)
        samples.append(dataclasses.replace(add, request_id=f"{add.request_id}-{i}", sampling=sampling,
                                           shares_prompt_with=first_id if i else ""))
    return samples


def total_usage(usages: Sequence[Usage]) -> Usage:
    """A request's usage from its samples': the prompt once (and its cache hit as the first sample
    saw it), the outputs summed."""
    first = usages[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages), first.cached_prompt_tokens)


async def with_total_usage(events: AsyncIterator[GenerateEvent], num_samples: int) -> AsyncIterator[GenerateEvent]:
    """`events`, with `total_usage` set on the GenerateComplete of the sample that finishes last.

    Closing it closes `events` at once (so their requests are aborted now, not when collected).
    """
    usages: dict[int, Usage] = {}
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for event in events:
            if isinstance(event, GenerateComplete):
                usages[event.index] = event.usage
                if len(usages) == num_samples:
                    event.total_usage = total_usage([usages[i] for i in sorted(usages)])
            yield event


class _Done:
    """A merged stream ended."""


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators in the order they come.

    The first error ends the merge and is raised; leaving early (or an error) closes every
    stream, which aborts their requests.
    """
    queue: asyncio.Queue[T | _Done | BaseException] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    queue.put_nowait(item)
            queue.put_nowait(_Done())
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, _Done):
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
