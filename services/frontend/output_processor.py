"""Per-request output processing: scheduler updates in, client chunks out.

Owns one request's incremental detokenizer and stop-string matcher, counts tokens for usage,
and turns the scheduler's flat logprob arrays into per-position entries. Decides the finish
reason: the scheduler's stop reason, or a stop string matched here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.frontend.detokenizer import Decode, make_detokenizer
from services.frontend.messages import (
    FinishReason,
    GenerateChunk,
    GenerateComplete,
    PositionLogprobs,
    RequestUpdate,
    TokenLogprob,
    Usage,
)
from services.frontend.stop_strings import StopStringMatcher
from services.frontend.token_bytes import TokenBytes
from shared.sampling import SamplingOptions
from shared.types import StopReason

FINISH_REASONS: dict[StopReason, FinishReason] = {
    StopReason.STOP_TOKEN: FinishReason.STOP,
    StopReason.LENGTH: FinishReason.LENGTH,
    StopReason.ABORTED: FinishReason.ABORT,
    StopReason.POOLED: FinishReason.STOP,
}


class OutputProcessor:
    """Turns one request's scheduler updates into `GenerateChunk`s and a `GenerateComplete`.

    Args:
        request_id: echoed in every chunk.
        decode: the tokenizer's `(token_ids, skip_special_tokens) -> str`.
        token_text: the text of a single token (for a matched stop token).
        prompt_token_ids: the prompt (context for the detokenizer, and the usage count).
        options: the resolved sampling options (max_tokens, stop_token_ids, logprobs).
        stop: stop strings matched on the output text.
        skip_special_tokens: leave special tokens out of the text.
        token_bytes: the tokenizer's byte table, when it has one (no decode call per step).
    """

    def __init__(self, request_id: str, decode: Decode, token_text: Callable[[int], str],
                 prompt_token_ids: Sequence[int], options: SamplingOptions, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, token_bytes: TokenBytes | None = None) -> None:
        self.request_id = request_id
        self._token_text = token_text
        self._options = options
        self._detokenizer = make_detokenizer(decode, token_bytes, prompt_token_ids, skip_special_tokens)
        self._stops = StopStringMatcher(stop)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.matched_stop: str | None = None
        # Sum of the chosen tokens' logprobs (when the request has logprobs): best_of ranks by it.
        self.cumulative_logprob: float | None = 0.0 if options.logprobs is not None else None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, updates: Sequence[RequestUpdate]) -> GenerateChunk | None:
        """Fold a batch of updates into one chunk (None when it adds nothing visible).

        Raises the update's typed error when the scheduler failed the request.
        """
        token_ids: list[int] = []
        logprobs: list[PositionLogprobs] = []
        hide_last = False  # the stop token's own text is not part of the output
        for update in updates:
            if update.error is not None:
                raise update.error
            new_ids = update.token_ids
            room = self._options.max_tokens - self.num_output_tokens - len(token_ids)
            if len(new_ids) >= room:  # defensive: never return more than max_tokens
                new_ids = new_ids[:room]
                self.finish_reason = FinishReason.LENGTH
            token_ids.extend(new_ids)
            if self._options.logprobs is not None:
                logprobs.extend(_position_logprobs(update, len(new_ids)))
            if update.num_prompt_tokens:
                self.num_prompt_tokens = update.num_prompt_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
            if update.stop_reason is not None:
                self.finish_reason = FINISH_REASONS[update.stop_reason]
                if update.stop_token_id is not None and new_ids and new_ids[-1] == update.stop_token_id:
                    hide_last = True
                    if update.stop_token_id in self._options.stop_token_ids:
                        self.matched_stop = self._token_text(update.stop_token_id)
            if self.finish_reason is not None:
                break
        self.num_output_tokens += len(token_ids)
        can_match = self.num_output_tokens >= self._options.min_tokens
        text = self._stops.feed(self._detokenizer.step(token_ids[:-1] if hide_last else token_ids), can_match)
        if self.finish_reason is not None and self._stops.matched is None:
            text += self._flush(can_match)
        if self._stops.matched is not None:
            self.finish_reason = FinishReason.STOP
            self.matched_stop = self._stops.matched
        if self.cumulative_logprob is not None:
            self.cumulative_logprob += sum(p.chosen.logprob for p in logprobs)
        if not token_ids and not text:
            return None
        return GenerateChunk(self.request_id, token_ids, text, logprobs if self._options.logprobs is not None
                             else None)

    def abort(self) -> GenerateChunk | None:
        """Finish now (deadline): release whatever text was held back."""
        self.finish_reason = FinishReason.ABORT
        text = self._flush()
        return GenerateChunk(self.request_id, [], text) if text else None

    def abort_complete(self) -> GenerateComplete:
        """The `GenerateComplete` of a request abandoned early (the client left)."""
        if self.finish_reason is None:
            self.finish_reason = FinishReason.ABORT
        return self.complete()

    def complete(self) -> GenerateComplete:
        assert self.finish_reason is not None, "complete() before the request finished"
        return GenerateComplete(
            request_id=self.request_id,
            finish_reason=self.finish_reason,
            usage=Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens),
            matched_stop=self.matched_stop,
            cumulative_logprob=self.cumulative_logprob,
        )

    def _flush(self, can_match: bool = True) -> str:
        """The detokenizer's and the stop matcher's held-back text (a stop string may still match)."""
        text = self._stops.feed(self._detokenizer.flush(), can_match)
        if self._stops.matched is None:
            text += self._stops.flush()
        return text


def _position_logprobs(update: RequestUpdate, num_tokens: int) -> list[PositionLogprobs]:
    """Split the update's flat arrays into one entry per token (empty if the scheduler sent none)."""
    if len(update.logprobs) < num_tokens:
        return []
    k = update.num_top_logprobs
    out = []
    for i in range(num_tokens):
        top = [TokenLogprob(update.top_token_ids[j], update.top_logprobs[j]) for j in range(i * k, (i + 1) * k)]
        out.append(PositionLogprobs(TokenLogprob(update.token_ids[i], update.logprobs[i]), top))
    return out
