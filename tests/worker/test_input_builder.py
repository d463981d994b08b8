"""ModelInputBuilder: a mixed batch (fresh prefill, prefix-hit prefill, decodes) vs hand-computed inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.attention.padded import PaddedMetadataBuilder
from services.worker.attention.paged import PagedMetadataBuilder
from services.worker.input_builder import ModelInputBuilder, TransferPack
from services.worker.request_states import RequestStates
from shared.errors import InvalidArgumentError
from shared.execute import CachedRequestData, ExecuteRound, NewRequestData
from shared.sampling import SamplingOptions

BS = 4
GREEDY = SamplingOptions(temperature=0.0)


def _new(request_id: str, tokens: list[int], computed: int, blocks: list[int]) -> NewRequestData:
    return NewRequestData(request_id, tokens, len(tokens), computed, blocks, GREEDY)


def _mixed_batch() -> tuple[RequestStates, ModelInputBuilder, np.ndarray, np.ndarray]:
    states = RequestStates(max_model_len=64, block_size=BS, initial_rows=2)  # forces growth
    # Running requests from earlier rounds: C has 6 tokens (5 computed), D has 4 (3 computed).
    states.add(_new("C", [60, 61, 62, 63, 64, 65], 5, [8, 2]))
    states.add(_new("D", [70, 71, 72, 73], 3, [11]))
    round_ = ExecuteRound(
        round_id=1,
        new_requests=[
            _new("A", list(range(10, 20)), 0, [3, 7, 9]),  # chunk of 6 from 0: no sample
            _new("B", [10, 11, 12, 13, 40, 41, 42, 43, 44], 4, [3, 5, 6]),  # prefix hit: block 3 shared
        ],
        cached_requests=CachedRequestData(["C", "D"], [[], [12]]),
        num_scheduled_tokens=[6, 5, 1, 1],
    )
    rows, num_scheduled = states.add_and_extend(round_)
    builder = ModelInputBuilder(states, PaddedMetadataBuilder(BS), torch.device("cpu"))
    return states, builder, rows, num_scheduled


def test_mixed_batch_inputs_match_hand_computed_layout() -> None:
    states, builder, rows, num_scheduled = _mixed_batch()
    inp = builder.build(rows, num_scheduled)
    assert inp.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 65, 73]
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 5, 3]
    assert inp.common.query_start_loc.tolist() == [0, 6, 11, 12, 13]
    assert inp.common.seq_lens.tolist() == [6, 9, 6, 4]
    # A: block 3 then 7; B: block 5 then 6; C: position 5 -> block 2; D: position 3 -> block 11.
    assert inp.common.slot_mapping.tolist() == [12, 13, 14, 15, 28, 29, 20, 21, 22, 23, 24, 9, 47]
    assert inp.common.block_tables.tolist() == [[3, 7, 9], [3, 5, 6], [8, 2, 0], [11, 12, 0]]
    assert inp.logits_indices.tolist() == [10, 11, 12]  # last token of B, C, D; A is a partial chunk
    assert [states.request_ids[r] for r in inp.sample_rows] == ["B", "C", "D"]
    assert inp.common.max_query_len == 6 and inp.common.max_seq_len == 9
    assert states.num_computed_tokens[rows].tolist() == [6, 9, 6, 4]


def test_multi_step_advance_on_device_matches_hand_computed_slots() -> None:
    states, builder, rows, num_scheduled = _mixed_batch()
    step0 = builder.build(rows, num_scheduled)
    step1 = builder.advance(step0, torch.tensor([100, 101, 102]))
    assert step1.input_ids.tolist() == [100, 101, 102]
    assert step1.positions.tolist() == [9, 6, 4]
    assert step1.common.seq_lens.tolist() == [10, 7, 5]
    assert step1.common.seq_lens_host.tolist() == [10, 7, 5]
    # B: position 9 -> block 6 (slot 24 + 1); C: 6 -> block 2 (8 + 2); D: 4 -> block 12 (48 + 0).
    assert step1.common.slot_mapping.tolist() == [25, 10, 48]
    assert step1.common.query_start_loc.tolist() == [0, 1, 2, 3]
    assert step1.logits_indices.tolist() == [0, 1, 2]
    step2 = builder.advance(step1, torch.tensor([103, 104, 105]))
    assert step2.positions.tolist() == [10, 7, 5]
    assert step2.common.slot_mapping.tolist() == [26, 11, 49]
    assert step2.common.max_seq_len == 11
    assert states.num_computed_tokens[step2.sample_rows].tolist() == [11, 8, 6]


def test_decode_steps_across_block_boundaries_keep_slots_and_work_items_right() -> None:
    """The decode-only steady state moves slots on by one and keeps the work items; where a row
    starts a new block its slot comes from the block table, and the order stays longest first."""
    states = RequestStates(max_model_len=64, block_size=BS)
    states.add(_new("E", [1, 2, 3], 2, [5, 9, 4]))  # decoding from position 2
    states.add(_new("F", [1, 2, 3, 4, 5, 6], 5, [7, 3, 6]))  # decoding from position 5
    rows, num_scheduled = states.add_and_extend(
        ExecuteRound(round_id=1, new_requests=[], cached_requests=CachedRequestData(["E", "F"], [[], []]),
                     num_scheduled_tokens=[1, 1])
    )
    builder = ModelInputBuilder(states, PagedMetadataBuilder(BS), torch.device("cpu"))
    step = builder.build(rows, num_scheduled)
    tables = {0: [5, 9, 4], 1: [7, 3, 6]}
    for k in range(1, 7):
        step = builder.advance(step, torch.tensor([100 + k, 200 + k]))
        positions = [2 + k, 5 + k]
        assert step.positions.tolist() == positions
        assert step.common.slot_mapping.tolist() == [tables[i][p // BS] * BS + p % BS for i, p in enumerate(positions)]
        assert step.common.seq_lens.tolist() == step.common.seq_lens_host.tolist() == [p + 1 for p in positions]
        fresh = PagedMetadataBuilder(BS).build(step.common, [])
        assert step.attn_metadata.work_items.tolist() == fresh.work_items.tolist() == [[1, 0, 1], [0, 0, 1]]
    assert states.num_computed_tokens[rows].tolist() == [9, 12]


def test_round_beyond_allocated_blocks_is_rejected() -> None:
    states = RequestStates(max_model_len=64, block_size=BS)
    round_ = ExecuteRound(
        round_id=3, num_steps=4, new_requests=[_new("X", [1, 2, 3], 0, [0])], num_scheduled_tokens=[3]
    )
    with pytest.raises(InvalidArgumentError, match="'X' cannot compute 3 tokens"):
        states.add_and_extend(round_)  # 3 tokens + 3 more decode steps need 2 blocks


def test_unknown_cached_request_is_rejected() -> None:
    states = RequestStates(max_model_len=64, block_size=BS)
    round_ = ExecuteRound(
        round_id=0, cached_requests=CachedRequestData(["ghost"], [[]]), num_scheduled_tokens=[1]
    )
    with pytest.raises(InvalidArgumentError, match="unknown request id 'ghost'"):
        states.add_and_extend(round_)


def test_round_may_compute_up_to_the_last_position_below_max_model_len() -> None:
    states = RequestStates(max_model_len=16, block_size=BS)
    ok = ExecuteRound(
        round_id=0,
        num_steps=5,
        new_requests=[_new("X", list(range(12)), 0, [0, 1, 2, 3])],
        num_scheduled_tokens=[12],
    )
    rows, _ = states.add_and_extend(ok)  # positions 0..15; the 17th token is stored, never computed
    states.remove(["X"])
    too_far = ExecuteRound(
        round_id=1,
        num_steps=6,
        new_requests=[_new("Y", list(range(12)), 0, [0, 1, 2, 3, 4])],
        num_scheduled_tokens=[12],
    )
    with pytest.raises(InvalidArgumentError, match="max_model_len 16"):
        states.add_and_extend(too_far)


def _decoding() -> tuple[RequestStates, np.ndarray, np.ndarray]:
    """E and F decoding, one token each a round; F's next position needs a block it lacks."""
    states = RequestStates(max_model_len=64, block_size=BS)
    states.add(_new("E", [1, 2, 3], 2, [5, 9, 4]))
    states.add(_new("F", [1, 2, 3, 4, 5, 6, 7, 8], 7, [7, 3]))  # position 7: block 3 ends there
    rows, num_scheduled = states.add_and_extend(
        ExecuteRound(round_id=1, new_requests=[], cached_requests=CachedRequestData(["E", "F"], [[], []]),
                     num_scheduled_tokens=[1, 1]))
    return states, rows, num_scheduled


def _next_round(states: RequestStates, f_blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return states.add_and_extend(ExecuteRound(
        round_id=2, new_requests=[], cached_requests=CachedRequestData(["E", "F"], [[], f_blocks]),
        num_scheduled_tokens=[1, 1]))


def test_next_rounds_step_zero_carries_on_from_the_last_step_as_build_would() -> None:
    """`resume` gives step 0 of a decode round what `build` gives, the new block tables included."""
    states, rows, num_scheduled = _decoding()
    builder = ModelInputBuilder(states, PagedMetadataBuilder(BS), torch.device("cpu"))
    last = builder.build(rows, num_scheduled)  # the previous round's only step: E at 2, F at 7
    sampled = torch.tensor([100, 200])
    states.append_tokens(last.sample_rows, sampled.numpy())  # what the runner's deliver records
    rows, num_scheduled = _next_round(states, [6])  # F's position 8 needs a third block
    resumed = builder.resume(last, sampled, rows, num_scheduled)
    assert resumed is not None
    computed = states.num_computed_tokens[rows].copy()
    states.num_computed_tokens[rows] -= 1  # undo resume's bookkeeping, then build the same step
    built = ModelInputBuilder(states, PagedMetadataBuilder(BS), torch.device("cpu")).build(rows, num_scheduled)
    assert states.num_computed_tokens[rows].tolist() == computed.tolist() == [4, 9]
    assert resumed.input_ids.tolist() == built.input_ids.tolist() == [100, 200]
    assert resumed.positions.tolist() == built.positions.tolist() == [3, 8]
    assert resumed.common.slot_mapping.tolist() == built.common.slot_mapping.tolist() == [5 * BS + 3, 6 * BS]
    assert resumed.common.block_tables.tolist() == built.common.block_tables.tolist()
    assert resumed.common.seq_lens.tolist() == built.common.seq_lens.tolist() == [4, 9]
    assert resumed.common.seq_lens_host.tolist() == [4, 9] and resumed.common.max_seq_len == 9
    assert resumed.logits_indices.tolist() == built.logits_indices.tolist()
    assert resumed.sample_rows.tolist() == built.sample_rows.tolist()
    assert resumed.attn_metadata.work_items.tolist() == built.attn_metadata.work_items.tolist()


def test_step_zero_is_built_when_the_round_does_not_carry_on() -> None:
    states, rows, num_scheduled = _decoding()
    builder = ModelInputBuilder(states, PagedMetadataBuilder(BS), torch.device("cpu"))
    last = builder.build(rows, num_scheduled)
    sampled = torch.tensor([100, 200])
    assert builder.resume(None, None, rows, num_scheduled) is None  # nothing to carry on from
    states.append_tokens(last.sample_rows, sampled.numpy())
    rows, num_scheduled = _next_round(states, [6])
    states.num_computed_tokens[rows[0]] -= 1  # E recomputes a token (as after a preemption): no
    assert builder.resume(last, sampled, rows, num_scheduled) is None
    states.num_computed_tokens[rows[0]] += 1
    assert builder.resume(last, sampled, rows[::-1], num_scheduled) is None  # another order
    assert builder.resume(last, sampled, rows[:1], num_scheduled[:1]) is None  # a row left
    assert builder.resume(last, sampled, rows, np.array([2, 1])) is None  # not one token each
    assert builder.resume(last, sampled, rows, num_scheduled) is not None


def test_cpu_transfer_copies_each_array_as_int64_or_float32() -> None:
    ids, table = np.arange(5, dtype=np.int32), np.arange(6).reshape(2, 3)
    flags, temps = np.array([True, False]), np.array([0.5, 1.25], dtype=np.float64)
    got = TransferPack(torch.device("cpu")).transfer([ids, table, flags, temps])
    assert [t.dtype for t in got] == [torch.int64, torch.int64, torch.int64, torch.float32]
    assert [tuple(t.shape) for t in got] == [(5,), (2, 3), (2,), (2,)]
    assert got[1].tolist() == table.tolist() and got[2].tolist() == [1, 0] and got[3].tolist() == [0.5, 1.25]
    table[0, 0] = 99  # a host buffer written after the transfer: the tensor keeps what it was given
    assert got[1][0, 0] == 0
