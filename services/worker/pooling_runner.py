"""`PoolingRunner`: executes rounds of prefill-only requests (embeddings, cross-encoder scores).

Rule (vLLM V2): this hot path is shared by all prefill-only models; feature logic lives
elsewhere (models/, attention/, pooling.py) and is called from here. A round's
`pooling_requests` run as ONE packed forward pass: tokens back to back with no padding
([num_tokens, hidden] through every layer), bidirectional attention per sequence through the
model's `EncoderAttention` (no padded copy on the CPU), then pooling, the model's head and
optional L2 normalisation. No KV cache and no per-request state: every request is complete
within its round. Inputs are built with numpy and reach the device in one copy. It never
touches grpc or protobuf.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.worker.attention import AttentionBackend, AttentionType, CommonAttentionMetadata
from services.worker.input_builder import TransferPack
from services.worker.models.bert import EncoderModel
from services.worker.pooling import PoolingConfig, PoolingMetadata, normalize_rows, pool
from services.worker.step_output import PooledStep
from services.worker.step_phases import StepPhases
from shared.errors import InvalidArgumentError
from shared.execute import ExecuteRound, PoolingRequestData

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PackedBatch:
    """Host arrays of one packed pooling batch (int64 unless noted)."""

    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens] position inside each sequence, from 0
    token_type_ids: np.ndarray  # [num_tokens]
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs]
    token_to_req: np.ndarray  # [num_tokens]
    normalize: np.ndarray  # [num_reqs] bool

    def arrays(self) -> list[np.ndarray]:
        """In field order, for one `TransferPack` copy."""
        return [
            self.input_ids,
            self.positions,
            self.token_type_ids,
            self.query_start_loc,
            self.seq_lens,
            self.token_to_req,
            self.normalize,
        ]


class PoolingRunner:
    """Holds an encoder model; turns each round's pooling requests into pooled vectors."""

    def __init__(
        self,
        model: EncoderModel,
        backend: AttentionBackend,
        pooling: PoolingConfig,
        *,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.task = model.task
        self.pooling = pooling
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.type_vocab_size = model.config.type_vocab_size
        self.device = device
        assert model.attention.backend is backend, "the model was built with another backend"
        self.metadata_builder = model.attention.metadata_builder(device)
        self._pack = TransferPack(device)
        self.phases = StepPhases()  # exposed as spindle:worker_step_phase_seconds_total

    def reset(self) -> None:
        """A new Execute stream: nothing to forget, pooling requests live for one round."""

    def abort(self, request_ids: list[str]) -> None:
        """Nothing to stop: a pooling request is one forward pass, done by the time an abort lands."""

    def execute_round(self, round_: ExecuteRound, on_step: Callable[[PooledStep], None]) -> None:
        """Pool every request of the round in step 0; later steps (if any) are empty."""
        if round_.new_requests or round_.cached_requests.request_ids:
            raise InvalidArgumentError(
                f"this worker serves {self.task.name} requests (a prefill-only model); "
                "it cannot run generate requests"
            )
        self.phases.start()
        num_steps = max(round_.num_steps, 1)
        step = PooledStep(round_.round_id, 0, num_steps == 1)
        if round_.pooling_requests:
            self._check(round_.round_id, round_.pooling_requests)
            with torch.inference_mode():
                step.values = self._run(round_.pooling_requests).cpu()
            self.phases.mark("pool")
            step.request_ids = [r.request_id for r in round_.pooling_requests]
            logger.debug("round %d: pooled %d requests", round_.round_id, len(step.request_ids))
        on_step(step)
        for index in range(1, num_steps):
            on_step(PooledStep(round_.round_id, index, index == num_steps - 1))
        self.phases.mark("deliver")

    def _check(self, round_id: int, requests: list[PoolingRequestData]) -> None:
        """Reject what would fail on the device or be ambiguous in the output (typed errors)."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"round {round_id} lists a pooling request twice")
        for r in requests:
            n = len(r.token_ids)
            if r.kind is not self.task:
                raise InvalidArgumentError(
                    f"request {r.request_id!r} is {r.kind.name}; this worker serves {self.task.name}"
                )
            if not 0 < n <= self.max_model_len:
                raise InvalidArgumentError(
                    f"request {r.request_id!r} has {n} tokens; must be 1..{self.max_model_len}"
                )
            if r.token_type_ids and len(r.token_type_ids) != n:
                raise InvalidArgumentError(
                    f"request {r.request_id!r} has {len(r.token_type_ids)} token_type_ids for {n} tokens"
                )

    def _pack_batch(self, requests: list[PoolingRequestData]) -> PackedBatch:
        """The packed batch on the host: a few numpy passes, no loop per token."""
        num_reqs = len(requests)
        lens = np.fromiter((len(r.token_ids) for r in requests), np.int64, num_reqs)
        total = int(lens.sum())
        input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in requests), np.int64, total)
        has_types = np.fromiter((bool(r.token_type_ids) for r in requests), bool, num_reqs)
        token_types = np.zeros(total, np.int64)
        if has_types.any():  # requests without token_type_ids keep segment 0
            token_types[np.repeat(has_types, lens)] = np.fromiter(
                chain.from_iterable(r.token_type_ids for r in requests), np.int64
            )
        for name, values, limit in (
            ("token id", input_ids, self.vocab_size),
            ("token type id", token_types, self.type_vocab_size),
        ):
            if not (values.min() >= 0 and values.max() < limit):
                raise InvalidArgumentError(f"a {name} is outside [0, {limit})")
        query_start_loc = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        token_to_req = np.repeat(np.arange(num_reqs), lens)
        return PackedBatch(
            input_ids=input_ids,
            positions=np.arange(total) - query_start_loc[token_to_req],
            token_type_ids=token_types,
            query_start_loc=query_start_loc,
            seq_lens=lens,
            token_to_req=token_to_req,
            normalize=np.fromiter((r.normalize for r in requests), bool, num_reqs),
        )

    def _run(self, requests: list[PoolingRequestData]) -> torch.Tensor:
        """One packed forward pass; [num_reqs, pooled_size] float32 on the device."""
        batch = self._pack_batch(requests)
        lens = batch.seq_lens
        extra = self.metadata_builder.prepare(lens, lens, AttentionType.ENCODER_ONLY)
        ids, positions, types, qsl, seq_lens, token_to_req, normalize, *extra_d = self._pack.transfer(
            [*batch.arrays(), *extra]
        )
        max_len = int(lens.max())
        common = CommonAttentionMetadata(
            attn_type=AttentionType.ENCODER_ONLY,
            num_reqs=len(lens),
            num_tokens=len(batch.input_ids),
            max_query_len=max_len,
            max_seq_len=max_len,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            query_lens_host=lens,
            seq_lens_host=lens,
        )
        metadata = self.metadata_builder.build(common, extra_d)
        self.phases.mark("prepare")
        hidden = self.model(ids, positions, types, metadata)
        self.phases.mark("forward")
        out = self.model.head(pool(hidden, self.pooling.method, PoolingMetadata(qsl, seq_lens, token_to_req)))
        if batch.normalize.any():
            out = normalize_rows(out, normalize.bool())
        return out
