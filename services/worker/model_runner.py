"""The model runner: executes scheduler rounds (one or more forward passes each).

Rule (vLLM V2): this hot path is shared by all models; feature logic lives elsewhere
(request state, input building, attention, sampling, penalties) and is called from here.
Multi-step is the small loop in `_run_steps`, and every step's tokens go to `on_step` as soon
as they are on the host. On CUDA step k+1 is launched before step k's tokens are awaited (the
copy overlaps the next forward pass); on CPU nothing runs asynchronously, so step k is handed
on right after it is sampled, before step k+1 computes: otherwise every token would reach the
client one forward pass late. With structured-output rows in the batch (CUDA), a step's
tokens are awaited before the next step samples (the forward pass is already launched): the
grammar matchers advance on the host. Rows that finished, or that the scheduler aborted while
the round computed (`abort`, from the event loop), leave the round's later steps
(round_stops.py). A decode step whose rows all sample greedily with nothing reshaping their
logits runs its forward pass, LM head and argmax in one kernel call (`_greedy_step`,
models/greedy_step.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack, nullcontext

import numpy as np
import torch
from torch import nn

from services.worker.attention import AttentionBackend
from services.worker.encoder_cache import EncoderCache
from services.worker.grammar_state import GrammarState
from services.worker.input_builder import ModelInput, ModelInputBuilder
from services.worker.models.fused import fused_kernels_error
from services.worker.models.native_stack import fits_pool, work_pool_scope
from services.worker.request_states import RequestStates
from services.worker.round_stops import Aborts, RoundRows, StopTable
from services.worker.sampler import Sampler, SamplerOutput
from services.worker.sampling_state import SamplingMetadata, SamplingState
from services.worker.step_output import HostCopier, SampledStep
from services.worker.step_phases import StepPhases
from shared.errors import InvalidArgumentError
from shared.execute import ExecuteRound
from shared.switches import switch_on

logger = logging.getLogger(__name__)
# SPINDLE_DISABLE_POOLED_DECODE_AFTER_PROMPT=1: a round whose step 0 is too big for spindle's pool
# keeps its decode steps on OpenMP too (`_run_steps`; side-by-side runs).
POOLED_DECODE_AFTER_PROMPT = not switch_on("SPINDLE_DISABLE_POOLED_DECODE_AFTER_PROMPT")


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
        self.aborts = Aborts()
        self.phases = StepPhases()  # exposed as spindle:worker_step_phase_seconds_total
        self.reset()

    def reset(self) -> None:
        """Forget every request (a new Execute stream starts from scratch); the KV cache stays."""
        self.states = RequestStates(self.max_model_len, self.block_size)
        self.sampling_state = SamplingState(self.vocab_size, self.eos_token_ids, self.device)
        self.input_builder = ModelInputBuilder(self.states, self.backend.metadata_builder(), self.device)
        self.sampler = Sampler(self.sampling_state.penalty_tables, self.generator,
                               argmax_kernel=fused_kernels_error(self.device) is None)
        self.stops = StopTable(self.eos_token_ids)
        self.aborts = Aborts()
        self.grammar_state.clear()
        # The last round's last step, which the next round's step 0 may carry on from (`_resume`).
        self._carry: tuple[ModelInput, torch.Tensor, SamplingMetadata] | None = None
        # Vision-language models only: image features by content hash (see encoder_cache.py).
        self.encoder_cache = (
            EncoderCache(self.model, self.encoder_cache_tokens, self.device)  # type: ignore[arg-type]
            if hasattr(self.model, "encode_images") else None
        )

    def abort(self, request_ids: list[str]) -> None:
        """The scheduler aborted these requests; any thread, applied at the next step boundary."""
        self.aborts.receive(request_ids)

    def execute_round(self, round_: ExecuteRound, on_step: Callable[[SampledStep], None]) -> None:
        """Run `round_.num_steps` forward passes; call `on_step` once per step, in order."""
        self.phases.start()
        if round_.pooling_requests:
            raise InvalidArgumentError(
                "this worker serves a generative model; it cannot run pooling requests"
            )
        if round_.new_requests or round_.finished_request_ids:
            self._carry = None  # a row may now hold another request: step 0 is built from scratch
        self.aborts.apply(self.states, self.stops)  # ids that arrived before this round: not yet forgotten
        self.aborts.forget(round_.finished_request_ids)
        released = self.states.remove(round_.finished_request_ids)
        self.sampling_state.release(released)
        self.grammar_state.release(released)
        rows, num_scheduled = self.states.add_and_extend(round_)
        for row, new in zip(rows.tolist(), round_.new_requests, strict=False):
            self.sampling_state.add(row, new)
            self.stops.add(row, new.sampling)
            if new.sampling.grammar is not None:
                self.grammar_state.add(row, new.sampling.grammar, new.token_ids[new.num_prompt_tokens :])
        num_steps = max(round_.num_steps, 1)
        # Rounds whose every layer runs spindle's kernels split them on spindle's pool (native_stack.py).
        pooled = self.encoder_cache is None and fits_pool(self.model, num_scheduled)
        with torch.inference_mode(), work_pool_scope() if pooled else nullcontext(), ExitStack() as decode_pool:
            if self.encoder_cache is not None:
                self.phases.mark("prepare")
                self._prepare_encoder(round_)
                self.phases.mark("encode")
            later_on_pool = not pooled and self.encoder_cache is None and POOLED_DECODE_AFTER_PROMPT
            self._run_steps(round_.round_id, num_steps, rows, num_scheduled, on_step,
                            decode_pool if later_on_pool else None)

    def _run_steps(
        self,
        round_id: int,
        num_steps: int,
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        on_step: Callable[[SampledStep], None],
        decode_pool: ExitStack | None = None,
    ) -> None:
        """The round's steps. With `decode_pool` (a round whose step 0 is too big for spindle's
        pool: a prefill chunk on oneDNN's OpenMP threads), its decode steps go on the pool where
        their rows fit: left to OpenMP, each of them waited at OpenMP's barriers for a thread
        the host services had taken (small model, one stream: the seven decode steps after a
        prompt took 1.4-1.9 ms each, the pooled ones after them 1.1)."""
        samplers, rows, num_scheduled = self._start_round(rows, num_scheduled)
        request_ids = [self.states.request_ids[r] or "" for r in samplers.rows.tolist()]
        hand_on_now = not self.copier.is_async  # CPU: no copy to overlap, the next step would only delay it
        inputs: ModelInput | None = None
        metadata: SamplingMetadata | None = None
        sampled: torch.Tensor | None = None
        pending: SampledStep | None = None
        starts = self.states.num_computed_tokens[rows].copy()  # step 0's first position per row (images)
        phases = self.phases
        for step in range(num_steps):
            if step == 1 and decode_pool is not None and fits_pool(self.model, np.ones(len(samplers.live), np.int64)):
                decode_pool.enter_context(work_pool_scope())
            if step == 0:
                inputs, metadata = self._resume(rows, num_scheduled)
                if inputs is None:
                    inputs = self.input_builder.build(rows, num_scheduled) if len(rows) else None
                    if inputs is not None and len(inputs.sample_rows):
                        metadata = self.sampling_state.build(inputs.sample_rows)
            elif inputs is not None and metadata is not None and sampled is not None:
                self.aborts.apply(self.states, self.stops)
                keep = samplers.narrow(step)
                if not len(samplers.live):
                    inputs = None  # every sampling row finished: the rest of the round is empty steps
                else:
                    inputs = self.input_builder.advance(inputs, sampled, keep)
                    if keep is not None:
                        metadata = self.sampling_state.build(inputs.sample_rows)
            else:
                inputs = None  # nothing left to compute in this round: an empty step
            out = SampledStep(round_id, step, step == num_steps - 1, request_ids, live=samplers.live)
            phases.mark("prepare")
            if inputs is not None:
                result = None if metadata is None else self._greedy_step(inputs, metadata)
                if result is not None:
                    phases.mark("forward")  # the whole step, LM head and argmax included
                else:
                    hidden = self._forward(inputs, rows, num_scheduled, starts if step == 0 else None)
                    phases.mark("forward")
                    if metadata is not None:
                        logits = self.model.compute_logits(hidden[inputs.logits_indices])
                        phases.mark("logits")
                        grammar_mask = None
                        if self.grammar_state.active:
                            if pending is not None:  # the matchers need the previous step's tokens first
                                self._deliver(pending, on_step)
                                pending = None
                            grammar_mask = self.grammar_state.mask(inputs.sample_rows)
                        result = self.sampler(logits, metadata, step, grammar_mask)
                if metadata is not None and result is not None:
                    sampled = result.token_ids
                    out.rows = inputs.sample_rows
                    self.copier.start(result, out, metadata.num_logprobs)
                    samplers.sampled()
                    phases.mark("sample")
            if pending is not None:
                self._deliver(pending, on_step)
                pending = None
            if hand_on_now:
                self._deliver(out, on_step)
            else:
                pending = out
            phases.mark("deliver")
        if pending is not None:
            self._deliver(pending, on_step)
            phases.mark("deliver")
        self.sampling_state.record_round(samplers.rows, samplers.num_sampled)
        self._carry = None
        if inputs is not None and metadata is not None and sampled is not None:  # the last step computed
            self._carry = (inputs, sampled, metadata)

    def _greedy_step(self, inputs: ModelInput, metadata: SamplingMetadata) -> SamplerOutput | None:
        """The step's forward pass and sampling in one kernel call (models/greedy_step.py) where
        every row decodes one token and samples it greedily with nothing that reshapes its
        logits; None where it does not apply (the step then runs forward, logits, sampler)."""
        common = inputs.common
        if not (metadata.argmax_only and not self.grammar_state.active and self.encoder_cache is None
                and common.max_query_len == 1 and len(inputs.sample_rows) == common.num_reqs):
            return None
        greedy_tokens = getattr(self.model, "greedy_tokens", None)
        tokens = None if greedy_tokens is None else greedy_tokens(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        return None if tokens is None else SamplerOutput(tokens)

    def _resume(self, rows: np.ndarray, num_scheduled: np.ndarray) -> tuple[ModelInput | None, SamplingMetadata | None]:
        """Step 0 of a round that carries on from the last round's last step (`ModelInputBuilder.resume`),
        with that round's sampling metadata where nothing in it depends on the round (min_tokens
        counts the tokens generated before the round); (None, None) when it does not carry on."""
        carry, self._carry = self._carry, None
        if carry is None or self.encoder_cache is not None:
            return None, None
        prev, sampled, metadata = carry
        inputs = self.input_builder.resume(prev, sampled, rows, num_scheduled)
        if inputs is None:
            return None, None
        return inputs, (metadata if metadata.min_tokens is None else self.sampling_state.build(inputs.sample_rows))

    def _start_round(self, rows: np.ndarray, num_scheduled: np.ndarray) -> tuple[RoundRows, np.ndarray, np.ndarray]:
        """The round's sampling rows, and its step-0 batch without the sampling rows that stopped
        already (the scheduler sent this round before it saw their stop; it discards their tokens)
        and without aborted rows.

        An aborted row computes nothing, but its counters move as if it had, so that a round
        queued before the abort still lists the request as sampling (placeholders) wherever the
        scheduler planned it to, however early the abort landed: a dropped prefill chunk counts
        as computed, and a sampling row is left one token short of what it knows, as a decoding
        row is (it appends no tokens, so the next round's one token again reaches the end).
        """
        st = self.states
        self.aborts.apply(st, self.stops)
        known = st.num_tokens[rows]
        samples = st.num_computed_tokens[rows] + num_scheduled == known  # as build() decides
        aborted = self.stops.aborted[rows]
        if aborted.any():
            dropped = aborted & ~samples
            st.num_computed_tokens[rows[dropped]] += num_scheduled[dropped]
            st.num_computed_tokens[rows[aborted & samples]] = known[aborted & samples] - 1
        samplers = RoundRows(self.stops, rows[samples], st.num_output(rows[samples]))
        batch = ~samples & ~aborted
        batch[np.flatnonzero(samples)[samplers.live]] = True
        return samplers, rows[batch], num_scheduled[batch]

    def _forward(
        self, inputs: ModelInput, rows: np.ndarray, num_scheduled: np.ndarray, starts: np.ndarray | None
    ) -> torch.Tensor:
        """One forward pass; at step 0 (`starts` given) with image features merged in (VLMs)."""
        embeds = None
        if starts is not None and self.encoder_cache is not None:
            ids = [self.states.request_ids[r] or "" for r in rows.tolist()]
            embeds = self.encoder_cache.merge(inputs.input_ids, ids, starts, num_scheduled)
        if embeds is None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, embeds)

    def _prepare_encoder(self, round_: ExecuteRound) -> None:
        """Register new requests' images, free and encode what the scheduler says, before step 0."""
        assert self.encoder_cache is not None
        self.encoder_cache.remove_requests(round_.finished_request_ids)
        for new in round_.new_requests:
            self.encoder_cache.add_request(new.request_id, new.mm_items)
        self.encoder_cache.apply_round(round_)

    def _deliver(self, step: SampledStep, on_step: Callable[[SampledStep], None]) -> None:
        """Wait for a step's host copy, record its tokens (and stops) in the request state, hand it on."""
        step.wait()
        if step.token_ids is not None and step.rows is not None:
            tokens = step.token_ids.numpy()
            self.states.append_tokens(step.rows, tokens)
            self.stops.observe(step.rows, tokens, self.states.num_output(step.rows))
            if self.grammar_state.active:
                self.grammar_state.consume(step.rows, tokens)
        on_step(step)
