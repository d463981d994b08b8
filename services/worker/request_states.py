"""Persistent per-request state of the worker, in preallocated numpy tables indexed by row.

A request gets a row when it arrives (`NewRequestData`) and keeps it until it is finished;
rounds then carry only diffs. Tables are numpy so the input builder can gather a whole batch
with fancy indexing. This module validates what the scheduler sends (typed errors) and never
touches the device.
"""

from __future__ import annotations

import numpy as np

from shared.errors import InvalidArgumentError
from shared.execute import CachedRequestData, ExecuteRound, NewRequestData
from shared.sampling import SamplingOptions


class RequestStates:
    """Token ids, progress, block tables and sampling options of every live request.

    Attributes (row-indexed numpy arrays, int64 unless noted):
        token_ids: [rows, max_model_len + 1] prompt then sampled tokens.
        num_tokens / num_prompt_tokens / num_computed_tokens: [rows] counts; invariant
            num_computed_tokens <= num_tokens.
        block_table: [rows, max_blocks] KV block ids; num_blocks: [rows] valid entries.
        sampling: per-row `SamplingOptions` (None for a free row) and its numeric columns.
    """

    def __init__(self, max_model_len: int, block_size: int, initial_rows: int = 64) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        # Positions stay < max_model_len, but the token sampled at the last position is stored
        # too (+1), and a scheduler may hold one lookahead block beyond the last position (+1).
        self.max_blocks = -(-max_model_len // block_size) + 1
        self.row_of: dict[str, int] = {}
        self.request_ids: list[str | None] = []
        self.sampling: list[SamplingOptions | None] = []
        self._free: list[int] = []
        self.token_ids = np.zeros((0, max_model_len + 1), np.int64)
        self.block_table = np.zeros((0, self.max_blocks), np.int64)
        self.num_tokens = np.zeros(0, np.int64)
        self.num_prompt_tokens = np.zeros(0, np.int64)
        self.num_computed_tokens = np.zeros(0, np.int64)
        self.num_blocks = np.zeros(0, np.int64)
        self._grow(initial_rows)

    def __len__(self) -> int:
        return len(self.row_of)

    def _grow(self, rows: int) -> None:
        old = len(self.request_ids)
        for name in (
            "token_ids",
            "block_table",
            "num_tokens",
            "num_prompt_tokens",
            "num_computed_tokens",
            "num_blocks",
        ):
            table = getattr(self, name)
            grown = np.zeros((rows, *table.shape[1:]), table.dtype)
            grown[:old] = table
            setattr(self, name, grown)
        self.request_ids.extend([None] * (rows - old))
        self.sampling.extend([None] * (rows - old))
        self._free.extend(range(rows - 1, old - 1, -1))  # pop() hands out low rows first

    def remove(self, request_ids: list[str]) -> list[int]:
        """Forget finished/preempted requests; unknown ids are ignored (never scheduled here)."""
        rows = []
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self.request_ids[row] = None
                self.sampling[row] = None
                self._free.append(row)
                rows.append(row)
        return rows

    def add(self, new: NewRequestData) -> int:
        n = len(new.token_ids)
        if new.request_id in self.row_of:
            raise InvalidArgumentError(f"new request {new.request_id!r} is already running on this worker")
        if not 0 < n <= self.max_model_len:
            raise InvalidArgumentError(
                f"request {new.request_id!r} has {n} tokens; must be 1..{self.max_model_len}"
            )
        if not 0 <= new.num_computed_tokens < n or not 0 < new.num_prompt_tokens <= n:
            raise InvalidArgumentError(
                f"request {new.request_id!r}: {new.num_computed_tokens=} / {new.num_prompt_tokens=} "
                f"out of range for {n} tokens"
            )
        if len(new.block_ids) > self.max_blocks:
            raise InvalidArgumentError(f"request {new.request_id!r} has more than {self.max_blocks} blocks")
        if not self._free:
            self._grow(2 * len(self.request_ids))
        row = self._free.pop()
        self.row_of[new.request_id] = row
        self.request_ids[row] = new.request_id
        self.sampling[row] = new.sampling
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = len(new.block_ids)
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        return row

    def append_blocks(self, cached: CachedRequestData) -> np.ndarray:
        """Extend block tables; returns the cached requests' rows in order."""
        rows = np.empty(len(cached.request_ids), np.int64)
        for i, request_id in enumerate(cached.request_ids):
            row = self.row_of.get(request_id)
            if row is None:
                raise InvalidArgumentError(f"unknown request id {request_id!r} in cached_requests")
            rows[i] = row
            blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else []
            start = int(self.num_blocks[row])
            if start + len(blocks) > self.max_blocks:
                raise InvalidArgumentError(f"request {request_id!r} would exceed {self.max_blocks} blocks")
            self.block_table[row, start : start + len(blocks)] = blocks
            self.num_blocks[row] = start + len(blocks)
        return rows

    def add_and_extend(self, round_: ExecuteRound) -> tuple[np.ndarray, np.ndarray]:
        """Protocol steps (2)-(3), after `remove`; returns (rows, num_scheduled_tokens) in batch order.

        New requests' rows come first in `rows` (`len(round_.new_requests)` of them).
        """
        new_rows = np.asarray([self.add(new) for new in round_.new_requests], np.int64)
        rows = np.concatenate([new_rows, self.append_blocks(round_.cached_requests)])
        num_scheduled = np.asarray(round_.num_scheduled_tokens, np.int64)
        if len(num_scheduled) != len(rows):
            raise InvalidArgumentError(
                f"round {round_.round_id}: {len(num_scheduled)} num_scheduled_tokens for {len(rows)} requests"
            )
        if len(np.unique(rows)) != len(rows):
            raise InvalidArgumentError(f"round {round_.round_id} schedules a request twice")
        self._check_capacity(round_.round_id, rows, num_scheduled, max(round_.num_steps, 1))
        return rows, num_scheduled

    def _check_capacity(
        self, round_id: int, rows: np.ndarray, num_scheduled: np.ndarray, num_steps: int
    ) -> None:
        """Every position this round touches must be a known token and have a KV slot."""
        end = self.num_computed_tokens[rows] + num_scheduled
        samples = end == self.num_tokens[rows]
        # A sampling request decodes num_steps - 1 more tokens after step 0.
        last_pos = end - 1 + np.where(samples, num_steps - 1, 0)
        bad = (num_scheduled < 1) | (end > self.num_tokens[rows])
        bad |= last_pos >= np.minimum(self.num_blocks[rows] * self.block_size, self.max_model_len)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            row = int(rows[i])
            raise InvalidArgumentError(
                f"round {round_id}: request {self.request_ids[row]!r} cannot compute {int(num_scheduled[i])} "
                f"tokens from {int(self.num_computed_tokens[row])} ({int(self.num_tokens[row])} known, "
                f"{int(self.num_blocks[row])} blocks of {self.block_size}, {num_steps} steps, "
                f"max_model_len {self.max_model_len})"
            )

    def num_output(self, rows: np.ndarray) -> np.ndarray:
        """Output tokens of `rows` so far (what the scheduler's stop rule counts)."""
        return self.num_tokens[rows] - self.num_prompt_tokens[rows]

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Record one sampled token for each of `rows` (distinct rows)."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1
