"""Per-request sampling state (options as numeric columns, seeded generators, penalty slots) and
the per-round `SamplingMetadata` built from it: one host -> device copy per round, reused by
every step of the round. Holds no model and runs no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker.input_builder import TransferPack
from services.worker.penalties import PenaltyBatch, PenaltyTables
from shared.execute import NewRequestData

_FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")
_INT_COLUMNS = ("top_k", "min_tokens", "num_logprobs", "num_output", "penalty_slot")
_BOOL_COLUMNS = ("wants_logprobs", "has_penalties", "has_min_tokens", "seeded", "has_logit_bias")


@dataclass(slots=True)
class MinTokensBatch:
    """Rows that may not stop yet: EOS and stop tokens masked while generated < min_tokens."""

    batch_rows: torch.Tensor  # [M]
    stop_ids: torch.Tensor  # [M, K] (a row's list padded by repeating its first id)
    num_generated: torch.Tensor  # [M] output tokens before step 0 of this round
    min_tokens: torch.Tensor  # [M]


@dataclass(slots=True)
class LogitBiasBatch:
    """Every (row, token, bias) of the batch's rows that carry a logit_bias, flattened.

    Sparse, because a bias names a few tokens of a large vocabulary: one index_put per step
    adds them all, and rows without a bias cost nothing.
    """

    batch_rows: torch.Tensor  # [B] int64
    token_ids: torch.Tensor  # [B] int64
    values: torch.Tensor  # [B] float32


@dataclass(slots=True)
class SamplingMetadata:
    """Sampling parameters of one round's sampling rows, on the device."""

    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor  # [S] bool
    temperature: torch.Tensor  # [S] float32, 1.0 on greedy rows
    top_k: torch.Tensor | None  # [S] int64, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [S] float32
    min_p: torch.Tensor | None  # [S] float32
    seeded: list[tuple[int, torch.Generator]]  # (sampling row, its generator)
    penalties: PenaltyBatch | None
    min_tokens: MinTokensBatch | None
    logit_bias: LogitBiasBatch | None
    num_logprobs: np.ndarray | None  # [S] host: top-N per row; None when no row asked for logprobs
    wants_logprobs: np.ndarray | None  # [S] host bool

    @property
    def argmax_only(self) -> bool:
        """Every row takes the argmax of the model's logits: greedy, with no logprobs to report and
        nothing that changes the logits first (logit_bias, penalties, min_tokens masking)."""
        return (self.all_greedy and self.num_logprobs is None and self.logit_bias is None
                and self.penalties is None and self.min_tokens is None)


class SamplingState:
    """Sampling options of every live request, by `RequestStates` row."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.penalty_tables = PenaltyTables(vocab_size, device)
        self.columns: dict[str, np.ndarray] = {}
        self.stop_ids: dict[int, list[int]] = {}  # rows with min_tokens > 0
        self.logit_bias: dict[int, tuple[tuple[int, float], ...]] = {}  # rows with a logit_bias
        self.generators: dict[int, torch.Generator] = {}
        self._pack = TransferPack(device)
        self._resize(64)

    def _resize(self, rows: int) -> None:
        for name in (*_FLOAT_COLUMNS, *_INT_COLUMNS, *_BOOL_COLUMNS):
            dtype = np.float64 if name in _FLOAT_COLUMNS else bool if name in _BOOL_COLUMNS else np.int64
            grown = np.zeros(rows, dtype)
            old = self.columns.get(name)
            if old is not None:
                grown[: len(old)] = old
            self.columns[name] = grown

    def add(self, row: int, new: NewRequestData) -> None:
        if row >= len(self.columns["temperature"]):
            self._resize(2 * row + 2)
        s, c = new.sampling, self.columns
        c["temperature"][row] = s.temperature
        c["top_p"][row] = s.top_p
        c["min_p"][row] = s.min_p
        c["repetition"][row] = s.repetition_penalty
        c["presence"][row] = s.presence_penalty
        c["frequency"][row] = s.frequency_penalty
        c["top_k"][row] = s.top_k if 0 < s.top_k < self.vocab_size else self.vocab_size
        c["min_tokens"][row] = s.min_tokens
        c["wants_logprobs"][row] = s.logprobs is not None
        c["num_logprobs"][row] = s.logprobs or 0
        c["has_penalties"][row] = s.has_penalties
        num_output = len(new.token_ids) - new.num_prompt_tokens
        c["num_output"][row] = num_output
        stops = [
            t
            for t in (*s.stop_token_ids, *(() if s.ignore_eos else self.eos_token_ids))
            if 0 <= t < self.vocab_size
        ]
        c["has_min_tokens"][row] = s.min_tokens > 0 and bool(stops)
        if c["has_min_tokens"][row]:
            self.stop_ids[row] = stops
        c["has_logit_bias"][row] = bool(s.logit_bias)
        if s.logit_bias:
            self.logit_bias[row] = s.logit_bias
        c["seeded"][row] = s.seed is not None and not s.is_greedy
        if c["seeded"][row]:
            self.generators[row] = self._seeded_generator(s.seed, num_output)
        if s.has_penalties:
            prompt, output = new.token_ids[: new.num_prompt_tokens], new.token_ids[new.num_prompt_tokens :]
            c["penalty_slot"][row] = self.penalty_tables.add(prompt, output)

    def _seeded_generator(self, seed: int, num_output: int) -> torch.Generator:
        """A generator in the state it would have after `num_output` draws (resumed after preemption)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        scratch = torch.empty(self.vocab_size, device=self.device)
        for _ in range(num_output):
            scratch.exponential_(generator=generator)
        return generator

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self.stop_ids.pop(row, None)
            self.logit_bias.pop(row, None)
            self.generators.pop(row, None)
            if self.columns["has_penalties"][row]:
                self.penalty_tables.release(int(self.columns["penalty_slot"][row]))
            for name in _BOOL_COLUMNS:
                self.columns[name][row] = False

    def record_round(self, rows: np.ndarray, num_steps_sampled: np.ndarray | int) -> None:
        """Host bookkeeping after a round: each sampling row generated `num_steps_sampled` tokens
        (per row: a row that finished early left the round's later steps)."""
        self.columns["num_output"][rows] += num_steps_sampled

    def build(self, rows: np.ndarray) -> SamplingMetadata:
        """Metadata for the sampling rows of a round (RequestStates rows, in sampling order)."""
        c = {name: col[rows] for name, col in self.columns.items()}
        greedy = c["temperature"] == 0.0
        temperature = np.where(greedy, 1.0, c["temperature"])
        uses_top_k = bool((c["top_k"] < self.vocab_size).any())
        uses_top_p = bool((c["top_p"] < 1.0).any())
        uses_min_p = bool((c["min_p"] > 0.0).any())
        pen_rows = np.flatnonzero(c["has_penalties"])
        min_rows = np.flatnonzero(c["has_min_tokens"])
        if len(min_rows):  # a loop over the few min_tokens rows only: their stop lists vary in length
            lists = [self.stop_ids[int(r)] for r in rows[min_rows]]
            width = max(map(len, lists))
            stop_ids = np.asarray([ids + [ids[0]] * (width - len(ids)) for ids in lists], np.int64)
        else:
            stop_ids = np.zeros((0, 1), np.int64)
        floats = np.stack(
            [temperature, c["top_p"], c["min_p"], c["repetition"], c["presence"], c["frequency"]]
        )
        (greedy_d, floats_d, top_k_d, pen_rows_d, slots_d, min_rows_d, stop_d, gen_d, min_d) = (
            self._pack.transfer(
                [
                    greedy,
                    floats,
                    c["top_k"],
                    pen_rows,
                    c["penalty_slot"][pen_rows],
                    min_rows,
                    stop_ids,
                    c["num_output"][min_rows],
                    c["min_tokens"][min_rows],
                ]
            )
        )
        wants = c["wants_logprobs"]
        bias_rows = np.flatnonzero(c["has_logit_bias"])
        return SamplingMetadata(
            num_rows=len(rows),
            all_greedy=bool(greedy.all()),
            greedy=greedy_d.bool(),
            temperature=floats_d[0],
            top_k=top_k_d if uses_top_k else None,
            top_p=floats_d[1] if uses_top_p else None,
            min_p=floats_d[2] if uses_min_p else None,
            seeded=[(int(i), self.generators[int(rows[i])]) for i in np.flatnonzero(c["seeded"])],
            penalties=PenaltyBatch(
                pen_rows_d, slots_d, floats_d[3][pen_rows_d], floats_d[4][pen_rows_d], floats_d[5][pen_rows_d]
            )
            if len(pen_rows)
            else None,
            min_tokens=MinTokensBatch(min_rows_d, stop_d, gen_d, min_d) if len(min_rows) else None,
            logit_bias=self._logit_bias_batch(rows, bias_rows) if len(bias_rows) else None,
            num_logprobs=c["num_logprobs"] if wants.any() else None,
            wants_logprobs=wants if wants.any() else None,
        )

    def _logit_bias_batch(self, rows: np.ndarray, bias_rows: np.ndarray) -> LogitBiasBatch:
        """The biases of `bias_rows` (sampling rows) as flat device tensors (a loop over those rows only)."""
        batch_rows: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for i in bias_rows:
            pairs = self.logit_bias[int(rows[i])]
            batch_rows.extend([int(i)] * len(pairs))
            token_ids.extend(t for t, _ in pairs)
            values.extend(b for _, b in pairs)
        return LogitBiasBatch(
            torch.tensor(batch_rows, dtype=torch.int64).to(self.device, non_blocking=True),
            torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True),
            torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True),
        )
