"""Rows of a multi-step round that leave the batch once the scheduler will have finished them.

The scheduler decides token-level stops (`OutputProcessor.check_stop`) and discards what a
request samples after its stop, but it sees a round's tokens only as they stream back, while
the worker runs all n steps of the round. Computing a finished row to the end of the round
is wasted work, so the worker replays the part of that rule it can know itself: a stop token
id or EOS (unless ignore_eos) once more than min_tokens tokens are out, and max_tokens. A
row that met it is left out of the round's later forward passes, and out of rounds the
scheduler sent before it saw the stop (pipelined rounds). Every `StepOutput` still lists all
of the round's sampling requests (the protocol); the rows left out carry a placeholder token,
which the scheduler discards like any token past a stop. KV accounting is untouched: a row
left out only writes fewer of the slots the scheduler already allocated for it.

Not replayed: max_model_len (the scheduler cuts a round to the room of the request closest
to it), so such a row is computed to the end of its round.

Aborts (client gone, stop string, deadline) are decided by the frontend and scheduler, so
the worker cannot replay them; the scheduler sends them on the Execute stream as soon as it
decides them (`AbortRows`), apart from `finished_request_ids`, which also lists requests it
preempted while a round was in flight and whose tokens of that round it still appends
(worker_state.preempt). `Aborts` marks an aborted row stopped at the next step boundary, so
it leaves the round computing within one step and the rounds queued behind it at their step 0.
What that saves is at most the rest of the round and one queued round per aborted request:
end to end it did not show (medium model, 2 cores, 16 streams of 128 + 64 tokens, half of them
disconnecting after 4 tokens, one server per run: 9.52 s with early aborts, 9.34 s with
SPINDLE_DISABLE_EARLY_ABORTS=1): at 16 rows a decode step costs about the same with 8 fewer.
It counts where rows are costly (long contexts, large batches, GPUs): an abort then wastes at
most one step instead of up to two rounds of n steps.

On CUDA a step's tokens reach the host while the next step computes, so a stop token seen at
step k removes the row from step k + 2; max_tokens is known in advance and needs no wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from services.worker.request_states import RequestStates
from shared.sampling import SamplingOptions


class StopTable:
    """Per `RequestStates` row: its stop rule as numeric columns, and whether it has stopped."""

    def __init__(self, eos_token_ids: tuple[int, ...], initial_rows: int = 64) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_tokens = np.zeros(initial_rows, np.int64)
        self.min_tokens = np.zeros(initial_rows, np.int64)
        self.stop_ids = np.full((initial_rows, 1), -1, np.int64)  # padded with -1 (never a token)
        self.stopped = np.zeros(initial_rows, bool)
        self.aborted = np.zeros(initial_rows, bool)  # stopped by an abort: drop prefill chunks too

    def add(self, row: int, sampling: SamplingOptions) -> None:
        """A (re-)added request on `row`: it has not stopped."""
        ids = (*sampling.stop_token_ids, *(() if sampling.ignore_eos else self.eos_token_ids))
        self._fit(row + 1, len(ids))
        self.max_tokens[row] = sampling.max_tokens
        self.min_tokens[row] = sampling.min_tokens
        self.stop_ids[row] = -1
        self.stop_ids[row, : len(ids)] = ids
        self.stopped[row] = False
        self.aborted[row] = False

    def abort(self, rows: list[int]) -> None:
        self.stopped[rows] = True
        self.aborted[rows] = True

    def observe(self, rows: np.ndarray, tokens: np.ndarray, num_output: np.ndarray) -> None:
        """`rows` sampled `tokens` and now have `num_output` output tokens: mark those that stop."""
        is_stop = (self.stop_ids[rows] == tokens[:, None]).any(axis=1) & (num_output > self.min_tokens[rows])
        self.stopped[rows[is_stop | (num_output >= self.max_tokens[rows])]] = True

    def _fit(self, num_rows: int, width: int) -> None:
        """Grow the columns to hold `num_rows` rows and `width` stop ids per row."""
        rows = max(len(self.stopped), num_rows)
        if rows > len(self.stopped):
            rows = max(rows, 2 * len(self.stopped))
            for name in ("max_tokens", "min_tokens", "stopped", "aborted"):
                old = getattr(self, name)
                grown = np.zeros(rows, old.dtype)
                grown[: len(old)] = old
                setattr(self, name, grown)
        old_ids = self.stop_ids
        if rows > old_ids.shape[0] or width > old_ids.shape[1]:
            self.stop_ids = np.full((rows, max(width, old_ids.shape[1])), -1, np.int64)
            self.stop_ids[: old_ids.shape[0], : old_ids.shape[1]] = old_ids


class RoundRows:
    """The sampling rows of one round, and which of them each step still computes.

    `live` holds indices into `rows` (the round's sampling rows, in batch order), ascending;
    a step's sampled tensors cover exactly the `live` rows of that step.
    """

    def __init__(self, table: StopTable, rows: np.ndarray, num_output: np.ndarray) -> None:
        self.table = table
        self.rows = rows
        self.budget = table.max_tokens[rows] - num_output  # steps each row may still sample in
        self.live = np.flatnonzero(~table.stopped[rows] & (self.budget > 0))
        self.num_sampled = np.zeros(len(rows), np.int64)

    def narrow(self, step: int) -> np.ndarray | None:
        """Leave out the rows stopped by now before `step`; the kept ones as indices into the
        previous `live` (what `ModelInputBuilder.advance` takes), or None when all stay."""
        keep = ~self.table.stopped[self.rows[self.live]] & (self.budget[self.live] > step)
        if keep.all():
            return None
        self.live = self.live[keep]
        return np.flatnonzero(keep)

    def sampled(self) -> None:
        """The `live` rows sampled one more token this round."""
        self.num_sampled[self.live] += 1


class Aborts:
    """Requests the scheduler aborted, on their way from the event loop to the compute thread.

    `receive` may run on any thread while a round computes: ids wait in a deque (append and
    popleft are atomic under the GIL), and only the compute thread maps them to rows (`apply`,
    at every step boundary), since it alone adds and removes rows. An id stays until a round's
    finished_request_ids forgets it, so a queued round that still carries the request (new or
    cached) has it marked at its start. The scheduler sends an abort only for a request on the
    worker, before the round whose finished_request_ids lists it, so an id never outlives the
    incarnation it meant.
    """

    def __init__(self) -> None:
        self._inbox: deque[str] = deque()
        self.ids: set[str] = set()

    def receive(self, request_ids: Iterable[str]) -> None:
        self._inbox.extend(request_ids)

    def apply(self, states: RequestStates, table: StopTable) -> None:
        """Mark the rows of every aborted request the worker holds as stopped."""
        while self._inbox:
            self.ids.add(self._inbox.popleft())
        if self.ids:
            rows = [row for request_id in self.ids if (row := states.row_of.get(request_id)) is not None]
            table.abort(rows)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Removed from the worker: their ids may name a new incarnation from now on."""
        if self.ids:
            self.ids.difference_update(request_ids)
