"""Repetition, presence and frequency penalties with per-request token counts on the device.

Only requests that use a penalty get a slot: a row of `prompt_mask` (tokens in the prompt) and
`output_counts` (how often each token was generated). Counts are updated on the device after
every step, so multi-step decoding needs no host round trip. Semantics follow HF / vLLM:
repetition over prompt + output tokens, presence and frequency over output tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PenaltyBatch:
    """The penalised rows of one sampling batch."""

    batch_rows: torch.Tensor  # [P] rows of the sampling batch
    slots: torch.Tensor  # [P] slots in PenaltyTables
    repetition: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    frequency: torch.Tensor  # [P]


def apply_penalties(
    logits: torch.Tensor,  # [P, V] float32
    prompt_mask: torch.Tensor,  # [P, V] bool
    output_counts: torch.Tensor,  # [P, V] int
    repetition: torch.Tensor,  # [P]
    presence: torch.Tensor,  # [P]
    frequency: torch.Tensor,  # [P]
) -> torch.Tensor:
    """Penalised copy of `logits` (the reference formula the tests restate)."""
    generated = output_counts > 0
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | generated, penalised, logits)
    logits = logits - frequency[:, None] * output_counts.to(logits.dtype)
    return logits - presence[:, None] * generated.to(logits.dtype)


class PenaltyTables:
    """Device tables of prompt masks and output counts, one slot per penalised request."""

    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_mask = torch.zeros(initial_slots, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(initial_slots, vocab_size, dtype=torch.int32, device=device)
        self._free = list(range(initial_slots - 1, -1, -1))

    def add(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A slot holding this request's prompt tokens and output counts so far."""
        if not self._free:
            old = self.prompt_mask.shape[0]
            self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
            self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
            self._free.extend(range(2 * old - 1, old - 1, -1))
        slot = self._free.pop()
        self.prompt_mask[slot] = False
        self.output_counts[slot] = 0
        prompt = torch.tensor(prompt_ids, dtype=torch.int64, device=self.device)
        self.prompt_mask[slot, prompt] = True
        if output_ids:
            out = torch.tensor(output_ids, dtype=torch.int64, device=self.device)
            self.output_counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def apply(self, logits: torch.Tensor, batch: PenaltyBatch) -> None:
        """Penalise the batch's rows of `logits` in place."""
        rows = logits[batch.batch_rows]
        logits[batch.batch_rows] = apply_penalties(
            rows,
            self.prompt_mask[batch.slots],
            self.output_counts[batch.slots],
            batch.repetition,
            batch.presence,
            batch.frequency,
        )

    def record(self, batch: PenaltyBatch, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled ([S] for the whole sampling batch)."""
        ones = torch.ones(len(batch.slots), dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((batch.slots, token_ids[batch.batch_rows]), ones, accumulate=True)
