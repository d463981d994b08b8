"""SamplingOptions: a request's sampling and stopping with every default resolved.

The frontend builds it (after validation), the scheduler reads the stopping fields, the
worker the sampling ones. It crosses services as common.proto SamplingOptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.grammar import Grammar


@dataclass(slots=True, frozen=True)
class SamplingOptions:
    """Resolved sampling and stopping parameters of one request."""

    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    min_p: float = 0.0  # 0 disables
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1.0 disables
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: chosen token plus top N
    # (token id, bias) pairs added to the logits before sampling; sorted by token id, ids unique.
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    # Structured output: the output must match this grammar (None: free text).
    grammar: Grammar | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
