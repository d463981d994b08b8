"""`ModelInputBuilder`: every per-step model input of a round, built on the host once.

Step 0 of a round is built with numpy from `RequestStates` (no loop over tokens or requests)
and copied to the device in ONE transfer; steps 1.. are derived on the device from step 0 and
the sampled tokens (`advance`), with no host round trip. It never runs the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.worker.attention import AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from services.worker.request_states import RequestStates


class TransferPack:
    """Concatenates host arrays so they reach the device in one (pinned, async) copy (CUDA; for
    CPU tensors each array is simply copied into a tensor of its own).

    Integer arrays arrive as int64; float arrays as float32 (carried bit-exact in the int64
    buffer as their float32 bit patterns).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: torch.Tensor | None = None  # pinned, reused on CUDA
        self._copied: torch.cuda.Event | None = None

    def transfer(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the arrays' shapes, in order."""
        if self.device.type != "cuda":
            # No device copy to batch: each array becomes its own contiguous tensor, copied (so
            # later writes to a host buffer cannot reach it). Concatenating and slicing as for a
            # device copy took 26 against 7 us for a pooling round's 7 small arrays in isolation,
            # and 0.18 ms in a served embedding worker (2-core AMD EPYC).
            return [torch.from_numpy(np.array(a, dtype=np.float32 if a.dtype.kind == "f" else np.int64, order="C"))
                    for a in arrays]
        is_float = [a.dtype.kind == "f" for a in arrays]
        arrays = [
            a.astype(np.float32).view(np.int32).astype(np.int64) if f else a.astype(np.int64, copy=False)
            for a, f in zip(arrays, is_float, strict=True)
        ]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()  # NOTE: the previous copy must finish before the buffer is reused
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(max(total, 4096), dtype=torch.int64, pin_memory=True)
        host = self._staging[:total]
        np.concatenate([a.ravel() for a in arrays], out=host.numpy())
        flat = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        out, offset = [], 0
        for array, size, f in zip(arrays, sizes, is_float, strict=True):
            tensor = flat[offset : offset + size].view(array.shape)
            out.append(tensor.to(torch.int32).view(torch.float32) if f else tensor)
            offset += size
        return out


@dataclass(slots=True)
class ModelInput:
    """Inputs of one forward pass; device tensors plus the host facts the runner needs."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # [num_sampling] token whose logits are sampled, per sampling request
    sample_index: torch.Tensor  # [num_sampling] batch row of each sampling request
    sample_index_host: np.ndarray  # [num_sampling] the same, on the host
    sample_rows: np.ndarray  # [num_sampling] RequestStates row of each sampling request (host)
    common: CommonAttentionMetadata
    attn_metadata: Any


class ModelInputBuilder:
    """Owns the per-step input data of a round (tokens, positions, seq lens, slots, block tables)."""

    def __init__(
        self, states: RequestStates, metadata_builder: AttentionMetadataBuilder, device: torch.device
    ):
        self.states = states
        self.metadata_builder = metadata_builder
        self.device = device
        self.block_size = states.block_size
        self._pack = TransferPack(device)

    def build(self, rows: np.ndarray, num_scheduled: np.ndarray) -> ModelInput:
        """Step 0 of a round: `num_scheduled[i]` tokens of request row `rows[i]` from its computed count.

        Also marks those tokens computed in `RequestStates` (the pass built here computes them).
        """
        st, bs = self.states, self.block_size
        num_reqs = len(rows)
        start = st.num_computed_tokens[rows]
        query_start_loc = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        positions = start[req_of_token] + np.arange(num_tokens) - query_start_loc[req_of_token]
        input_ids = st.token_ids[rows[req_of_token], positions]
        seq_lens = start + num_scheduled
        # Wide enough for every position of the round (multi-step decodes included).
        block_tables = st.block_table[rows, : max(int(st.num_blocks[rows].max(initial=1)), 1)]
        slot_mapping = block_tables[req_of_token, positions // bs] * bs + positions % bs
        samples = seq_lens == st.num_tokens[rows]
        sample_index = np.flatnonzero(samples)
        logits_indices = query_start_loc[1:][samples] - 1
        extra = self.metadata_builder.prepare(num_scheduled, seq_lens, AttentionType.DECODER)
        (ids_d, pos_d, qsl_d, seq_d, bt_d, slot_d, logit_d, sample_d, *extra_d) = self._pack.transfer(
            [
                input_ids,
                positions,
                query_start_loc,
                seq_lens,
                block_tables,
                slot_mapping,
                logits_indices,
                sample_index,
                *extra,
            ]
        )
        st.num_computed_tokens[rows] = seq_lens
        common = CommonAttentionMetadata(
            attn_type=AttentionType.DECODER,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=int(num_scheduled.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            query_start_loc=qsl_d,
            seq_lens=seq_d,
            query_lens_host=num_scheduled,
            seq_lens_host=seq_lens,
            block_tables=bt_d,
            slot_mapping=slot_d,
        )
        return ModelInput(
            input_ids=ids_d,
            positions=pos_d,
            logits_indices=logit_d,
            sample_index=sample_d,
            sample_index_host=sample_index,
            sample_rows=rows[sample_index],
            common=common,
            attn_metadata=self.metadata_builder.build(common, extra_d),
        )

    def advance(self, prev: ModelInput, sampled: torch.Tensor, keep: np.ndarray | None = None) -> ModelInput:
        """Next decode step of the requests that sampled in `prev`, computed on the device.

        `keep` (indices into `prev.sample_rows`, ascending) leaves the other requests out: they
        finished, and computing them further would be wasted. `sampled` covers all of `prev`'s.
        token = the sampled token, position + 1, seq_len + 1,
        slot = block_table[row, pos // block_size] * block_size + pos % block_size.
        """
        common = prev.common
        if keep is None and common.num_reqs == len(prev.sample_rows) and common.max_query_len == 1:
            return self._advance_all(prev, sampled)
        logits_indices, sample_index = prev.logits_indices, prev.sample_index
        sample_index_host, sample_rows = prev.sample_index_host, prev.sample_rows
        if keep is not None:
            keep_d = torch.from_numpy(keep).to(self.device, non_blocking=True)
            sampled, logits_indices, sample_index = sampled[keep_d], logits_indices[keep_d], sample_index[keep_d]
            sample_index_host, sample_rows = sample_index_host[keep], sample_rows[keep]
        num = len(sample_rows)
        positions = prev.positions[logits_indices] + 1
        assert common.block_tables is not None
        block_tables = common.block_tables[sample_index]
        seq_lens_host = common.seq_lens_host[sample_index_host] + 1
        arange = torch.arange(num + 1, device=self.device)
        new_common = CommonAttentionMetadata(
            attn_type=AttentionType.DECODER,
            num_reqs=num,
            num_tokens=num,
            max_query_len=1,
            max_seq_len=int(seq_lens_host.max(initial=0)),
            query_start_loc=arange,
            seq_lens=common.seq_lens[sample_index] + 1,
            query_lens_host=np.ones(num, np.int64),
            seq_lens_host=seq_lens_host,
            block_tables=block_tables,
            slot_mapping=self._slots(block_tables, positions),
        )
        self.states.num_computed_tokens[sample_rows] += 1
        return ModelInput(
            input_ids=sampled,
            positions=positions,
            logits_indices=arange[:num],
            sample_index=arange[:num],
            sample_index_host=np.arange(num),
            sample_rows=sample_rows,
            common=new_common,
            attn_metadata=self.metadata_builder.build(new_common, []),
        )

    def resume(self, prev: ModelInput | None, sampled: torch.Tensor | None, rows: np.ndarray,
               num_scheduled: np.ndarray) -> ModelInput | None:
        """Step 0 of a round that carries on where the previous round's last step (`prev`, which
        sampled `sampled`) left off, as `advance` carries on within a round: the same rows in the
        same order, every one decoding the token it just sampled. None where the round is anything
        else (a request came, finished, stopped, was aborted or preempted): `build` it then.

        Only the block tables are read again: the scheduler may have given rows blocks for this
        round's positions. At one stream of the small model a round's step 0 took 0.78 ms in
        process against 0.33 for the steps after it, the difference `build` and the sampling
        metadata's rebuild (`ModelRunner._run_steps` reuses that too).
        """
        if prev is None or sampled is None or len(rows) != prev.common.num_reqs:
            return None
        st, common = self.states, prev.common
        if (common.max_query_len != 1 or len(prev.sample_rows) != common.num_reqs
                or not np.array_equal(rows, prev.sample_rows) or not (num_scheduled == 1).all()):
            return None
        start = st.num_computed_tokens[rows]
        if not np.array_equal(start, common.seq_lens_host) or not np.array_equal(st.num_tokens[rows], start + 1):
            return None
        width = max(int(st.num_blocks[rows].max(initial=1)), 1)
        (block_tables,) = self._pack.transfer([st.block_table[rows, :width]])
        return self._advance_all(prev, sampled, block_tables)

    def _advance_all(self, prev: ModelInput, sampled: torch.Tensor,
                     block_tables: torch.Tensor | None = None) -> ModelInput:
        """`advance` where every row of `prev` decoded one token and decodes the next (a decode
        round's steady state): the batch's layout and its index tensors stay as they are, only
        positions, lengths and slots move on by one (and the block tables, when `block_tables`
        replaces them). Each small op left out here costs a multiple of its microbenchmark time
        right after a forward pass (cold caches), and at one stream of a small model these ops
        were a fifth of the step."""
        common = prev.common
        assert common.block_tables is not None and common.slot_mapping is not None
        tables = common.block_tables if block_tables is None else block_tables
        positions = prev.positions + 1
        seq_lens_host = common.seq_lens_host + 1
        if block_tables is None and ((seq_lens_host - 1) % self.block_size).all():
            slot_mapping = common.slot_mapping + 1  # no row starts a block: its next slot follows its last
        else:
            slot_mapping = self._slots(tables, positions)
        new_common = CommonAttentionMetadata(
            attn_type=AttentionType.DECODER,
            num_reqs=common.num_reqs,
            num_tokens=common.num_tokens,
            max_query_len=1,
            max_seq_len=common.max_seq_len + 1,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens + 1,
            query_lens_host=common.query_lens_host,
            seq_lens_host=seq_lens_host,
            block_tables=tables,
            slot_mapping=slot_mapping,
        )
        self.states.num_computed_tokens[prev.sample_rows] += 1
        return ModelInput(
            input_ids=sampled,
            positions=positions,
            logits_indices=prev.logits_indices,
            sample_index=prev.sample_index,
            sample_index_host=prev.sample_index_host,
            sample_rows=prev.sample_rows,
            common=new_common,
            attn_metadata=self.metadata_builder.advance(prev.attn_metadata, new_common),
        )

    def _slots(self, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """KV-cache slot of each row's token at `positions` (one token per row)."""
        bs = self.block_size
        return block_tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
