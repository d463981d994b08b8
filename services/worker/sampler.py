"""Sampling on the device, vectorised over the batch.

Order (vLLM V1's): [logprobs taken here], logit_bias, penalties, min_tokens masking, the
structured-output grammar mask (rows with a grammar only), then for
random rows temperature, min-p, top-k, top-p, and an exponential race (argmax of probs /
Exp(1) noise), which equals sampling from probs. Greedy rows take the argmax of the processed
logits: with no bias or penalty that is exactly the argmax of the model's logits.

Greedy picks (and the race's winner) on a CPU go through spindle's argmax kernel
(kernels/csrc/argmax.cpp: the same index as torch.argmax, ~7x faster at 64 rows x 8,192
logits) when the kernels are built; elsewhere torch.argmax.

Logprobs convention: log_softmax of the model's raw logits, before logit_bias, penalties,
min_tokens masking, temperature and truncation, which is what vLLM reports by default
(`logprobs_mode="raw_logprobs"`): a client sees how likely the model found each token, not
how its own sampling settings reshaped the distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.grammar_state import TokenMask, apply_token_mask
from services.worker.penalties import PenaltyTables
from services.worker.sampling_state import SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] float32, logprob of each sampled token
    top_token_ids: torch.Tensor | None = None  # [S, N] int64, N = largest requested top count
    top_logprobs: torch.Tensor | None = None  # [S, N] float32


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (probability of the most likely token)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's `top_k` most likely tokens, then the smallest set reaching mass `top_p`."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Picks one token per row; `generator` serves every unseeded random row."""

    def __init__(self, penalty_tables: PenaltyTables, generator: torch.Generator | None = None,
                 argmax_kernel: bool = False) -> None:
        self.penalty_tables = penalty_tables
        self.generator = generator
        self.argmax_kernel = argmax_kernel  # torch.ops.spindle.argmax_rows for CPU float32 rows

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(dim=-1) for [S, V]: the kernel where it applies, else torch's."""
        if self.argmax_kernel and x.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.spindle.argmax_rows(x)
        return x.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata, step: int,
                 grammar_mask: TokenMask | None = None) -> SamplerOutput:
        """Sample from float32 `logits` [S, V]; `step` is the step index within the round.

        `grammar_mask` holds this step's allowed tokens of the rows with structured output.
        """
        logprobs = logits.log_softmax(dim=-1) if md.num_logprobs is not None else None
        if md.logit_bias is not None:
            bias = md.logit_bias
            logits.index_put_((bias.batch_rows, bias.token_ids), bias.values, accumulate=True)
        if md.penalties is not None:
            self.penalty_tables.apply(logits, md.penalties)
        if md.min_tokens is not None:
            mt = md.min_tokens
            active = (mt.num_generated + step) < mt.min_tokens  # step s has generated s tokens this round
            rows = mt.batch_rows[:, None]
            logits[rows, mt.stop_ids] = torch.where(active[:, None], float("-inf"), logits[rows, mt.stop_ids])
        if grammar_mask is not None:
            apply_token_mask(logits, grammar_mask)
        token_ids = self.argmax(logits) if md.all_greedy else self._sample(logits, md)
        out = SamplerOutput(token_ids)
        if logprobs is not None and md.num_logprobs is not None:
            out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
            top_n = int(md.num_logprobs.max())
            if top_n > 0:
                out.top_logprobs, out.top_token_ids = logprobs.topk(top_n, dim=-1)
        if md.penalties is not None:
            self.penalty_tables.record(md.penalties, token_ids)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy_ids = self.argmax(logits)
        x = logits / md.temperature[:, None]
        if md.min_p is not None:
            x = apply_min_p(x, md.min_p)
        x = apply_top_k_top_p(x, md.top_k, md.top_p)
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in md.seeded:  # a seeded row draws from its own stream only
            noise[row].exponential_(generator=generator)
        sampled = self.argmax(probs / noise)
        return torch.where(md.greedy, greedy_ids, sampled)
