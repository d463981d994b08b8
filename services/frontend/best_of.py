"""best_of: generate more candidates than choices and return the n most likely.

"Most likely" is OpenAI's definition: the highest log probability per token (the mean of the
chosen tokens' raw logprobs), ties to the earlier candidate. Candidates are buffered until all
finish, so best_of > n cannot be streamed (the HTTP layer refuses that, as OpenAI does). Every
candidate's tokens count in the usage: they were generated.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from services.frontend.messages import GenerateChunk, GenerateComplete, GenerateEvent


def _score(complete: GenerateComplete) -> float:
    tokens = complete.usage.completion_tokens
    return (complete.cumulative_logprob or 0.0) / tokens if tokens else float("-inf")


async def pick_best(events: AsyncIterator[GenerateEvent], n: int, keep_logprobs: bool) -> AsyncIterator[GenerateEvent]:
    """The events of the n best candidates, re-indexed 0..n-1 best first; logprobs dropped unless
    the client asked for them (they were requested only to rank)."""
    chunks: dict[int, list[GenerateChunk]] = {}
    completes: list[GenerateComplete] = []
    total = None
    async with contextlib.aclosing(events):  # type: ignore[type-var]  # closing this aborts the candidates now
        async for event in events:
            if isinstance(event, GenerateChunk):
                chunks.setdefault(event.index, []).append(event)
            else:
                completes.append(event)
                total = event.total_usage or total
    ranked = sorted(completes, key=lambda c: (-_score(c), c.index))[:n]
    for new_index, complete in enumerate(ranked):
        for chunk in chunks.get(complete.index, ()):
            yield dataclasses.replace(chunk, index=new_index, logprobs=chunk.logprobs if keep_logprobs else None)
        yield dataclasses.replace(complete, index=new_index,
                                  total_usage=total if new_index == len(ranked) - 1 else None)
