"""The model runner: executes scheduler rounds (one or more forward passes each).

Rule (vLLM V2): this hot path is shared by all models; feature logic lives elsewhere
(request state, input building, attention, sampling, penalties) and is called from here.
Multi-step is the small loop in `execute_round`: step k+1 is launched before step k's tokens
are awaited on the host, and every step's tokens go to `on_step` as soon as they arrive.
With structured-output rows in the batch, a step's tokens are awaited before the next step
samples (the forward pass is already launched): the grammar matchers advance on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from services.worker.attention import AttentionBackend
from services.worker.encoder_cache import EncoderCache
from services.worker.grammar_state import GrammarState
from services.worker.input_builder import ModelInput, ModelInputBuilder
from services.worker.request_states import RequestStates
from services.worker.sampler import Sampler
from services.worker.sampling_state import SamplingMetadata, SamplingState
from services.worker.step_output import HostCopier, SampledStep
from shared.errors import InvalidArgumentError
from shared.execute import ExecuteRound

logger = logging.getLogger(__name__)


class ModelRunner:
    """Holds the model, its KV cache and the per-request state of one Execute stream."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        encoder_cache_tokens: int = 0,
        model_dir: str | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.copier = HostCopier(device)
        self.generator = torch.Generator(device=device)
        self.generator.seed()
        self.encoder_cache_tokens = encoder_cache_tokens
        # Structured output (grammar matchers, compiled-grammar cache) outlives Execute streams.
        self.grammar_state = GrammarState(model_dir, vocab_size, eos_token_ids, device)
        self.reset()

    def reset(self) -> None:
        """Forget every request (a new Execute stream starts from scratch); the KV cache stays."""
        self.states = RequestStates(self.max_model_len, self.block_size)
        self.sampling_state = SamplingState(self.vocab_size, self.eos_token_ids, self.device)
        self.input_builder = ModelInputBuilder(self.states, self.backend.metadata_builder(), self.device)
        self.sampler = Sampler(self.sampling_state.penalty_tables, self.generator)
        self.grammar_state.clear()
        # Vision-language models only: image features by content hash (see encoder_cache.py).
        self.encoder_cache = (
            EncoderCache(self.model, self.encoder_cache_tokens, self.device)  # type: ignore[arg-type]
            if hasattr(self.model, "encode_images") else None
        )

    def execute_round(self, round_: ExecuteRound, on_step: Callable[[SampledStep], None]) -> None:
        """Run `round_.num_steps` forward passes; call `on_step` once per step, in order."""
        if round_.pooling_requests:
            raise InvalidArgumentError(
                "this worker serves a generative model; it cannot run pooling requests"
            )
        released = self.states.remove(round_.finished_request_ids)
        self.sampling_state.release(released)
        self.grammar_state.release(released)
        rows, num_scheduled = self.states.add_and_extend(round_)
        for row, new in zip(rows.tolist(), round_.new_requests, strict=False):
            self.sampling_state.add(row, new)
            if new.sampling.grammar is not None:
                self.grammar_state.add(row, new.sampling.grammar, new.token_ids[new.num_prompt_tokens :])
        num_steps = max(round_.num_steps, 1)
        with torch.inference_mode():
            if self.encoder_cache is not None:
                self._prepare_encoder(round_)
            self._run_steps(round_.round_id, num_steps, rows, num_scheduled, on_step)

    def _run_steps(
        self,
        round_id: int,
        num_steps: int,
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        on_step: Callable[[SampledStep], None],
    ) -> None:
        inputs: ModelInput | None = None
        metadata: SamplingMetadata | None = None
        request_ids: list[str] = []
        pending: SampledStep | None = None
        sampled: torch.Tensor | None = None
        starts = np.zeros(0, np.int64)  # step 0's first position per row (image merging)
        for step in range(num_steps):
            out = SampledStep(round_id, step, step == num_steps - 1, request_ids)
            if metadata is not None and inputs is not None:
                out.rows = inputs.sample_rows
            if step == 0 and len(rows):
                starts = self.states.num_computed_tokens[rows].copy()
                inputs = self.input_builder.build(rows, num_scheduled)
                if len(inputs.sample_rows):
                    metadata = self.sampling_state.build(inputs.sample_rows)
                    request_ids = [self.states.request_ids[r] or "" for r in inputs.sample_rows.tolist()]
                    out.request_ids, out.rows = request_ids, inputs.sample_rows
            elif metadata is not None and inputs is not None and sampled is not None:
                inputs = self.input_builder.advance(inputs, sampled)
            else:
                inputs = None  # nothing left to compute in this round: an empty step
            if inputs is not None:
                embeds = None
                if step == 0 and self.encoder_cache is not None:
                    ids = [self.states.request_ids[r] or "" for r in rows.tolist()]
                    embeds = self.encoder_cache.merge(inputs.input_ids, ids, starts, num_scheduled)
                if embeds is None:
                    hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
                else:
                    hidden = self.model(
                        inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, embeds
                    )
                if metadata is not None:
                    logits = self.model.compute_logits(hidden[inputs.logits_indices])
                    grammar_mask = None
                    if self.grammar_state.active:
                        if pending is not None:  # the matchers need the previous step's tokens first
                            self._deliver(pending, on_step)
                            pending = None
                        grammar_mask = self.grammar_state.mask(inputs.sample_rows)
                    result = self.sampler(logits, metadata, step, grammar_mask)
                    sampled = result.token_ids
                    self.copier.start(result, out, metadata.num_logprobs)
            if pending is not None:
                self._deliver(pending, on_step)
            pending = out
        if pending is not None:
            self._deliver(pending, on_step)
        if metadata is not None and inputs is not None:
            self.sampling_state.record_round(inputs.sample_rows, num_steps)

    def _prepare_encoder(self, round_: ExecuteRound) -> None:
        """Register new requests' images, free and encode what the scheduler says, before step 0."""
        assert self.encoder_cache is not None
        self.encoder_cache.remove_requests(round_.finished_request_ids)
        for new in round_.new_requests:
            self.encoder_cache.add_request(new.request_id, new.mm_items)
        self.encoder_cache.apply_round(round_)

    def _deliver(self, step: SampledStep, on_step: Callable[[SampledStep], None]) -> None:
        """Wait for a step's host copy, record its tokens in the request state, hand it on."""
        step.wait()
        if step.token_ids is not None and step.rows is not None:
            self.states.append_tokens(step.rows, step.token_ids.numpy())
            if self.grammar_state.active:
                self.grammar_state.consume(step.rows, step.token_ids.numpy())
        on_step(step)
