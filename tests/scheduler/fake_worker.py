"""A model-free worker that keeps the round protocol exactly, for driving the scheduler.

It tracks its own per-request state (tokens, computed count, block table), writes a
"KV" value into every slot it computes (a hash of the token prefix at that position), and
before sampling reads back every slot of the request, so a block that was reused, shared
or overwritten wrongly fails loudly. Tokens come from a deterministic function of the
token history, so a request's output does not depend on batching, chunking, preemption
or prefix-cache hits; `reference_output` replays that function alone.

Images (multimodal items) change what a placeholder position "means": its KV value mixes in
the image's content hash, so a prefix-cache hit across different images changes the output.
The worker also keeps an encoder cache and fails when a chunk needs an image that was never
encoded or already freed, when an image is encoded twice while cached, or when the cache
exceeds the capacity it reports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.execute import ExecuteRound, MultiModalItem, StepOutput, WorkerInfo
from shared.sampling import SamplingOptions
from shared.types import RequestKind

_MASK = (1 << 64) - 1
EOS_TOKEN_ID = 1
FIRST_NORMAL_TOKEN = 4


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, process-independent 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def chain(prefix_hash: int, token_id: int) -> int:
    """Hash of a token prefix extended by one token."""
    return _mix(prefix_hash ^ (token_id * 0x100000001B3))


ROOT = _mix(12345)


def _effective_tokens(token_ids: list[int], items: Sequence[MultiModalItem]) -> list[int]:
    """Placeholder tokens stand for their image's features: mix in the content hash and index."""
    tokens = list(token_ids)
    for item in items:
        key = ROOT
        for byte in item.hash.encode():
            key = chain(key, byte)
        for i in range(item.offset, min(item.end, len(tokens))):
            tokens[i] = _mix(key + i - item.offset) & 0xFFFFFFFF
    return tokens


def prefix_hashes(token_ids: list[int], items: Sequence[MultiModalItem] = ()) -> list[int]:
    out, h = [], ROOT
    for t in _effective_tokens(token_ids, items) if items else token_ids:
        h = chain(h, t)
        out.append(h)
    return out


def is_stop_token(token_id: int, sampling: SamplingOptions) -> bool:
    return (token_id == EOS_TOKEN_ID and not sampling.ignore_eos) or token_id in sampling.stop_token_ids


def sample_token(history_hash: int, num_output: int, sampling: SamplingOptions, vocab_size: int,
                 eos_period: int) -> int:
    """The fake model: next token from the hash of the whole history (min_tokens masks stops)."""
    x = _mix(history_hash)
    token = EOS_TOKEN_ID if x % eos_period == 0 else FIRST_NORMAL_TOKEN + (x >> 8) % (vocab_size - FIRST_NORMAL_TOKEN)
    while num_output < sampling.min_tokens and is_stop_token(token, sampling):
        x = _mix(x)
        token = FIRST_NORMAL_TOKEN + x % (vocab_size - FIRST_NORMAL_TOKEN)
    return token


def reference_output(prompt: list[int], sampling: SamplingOptions, max_model_len: int, vocab_size: int,
                     eos_period: int, mm_items: Sequence[MultiModalItem] = ()) -> list[int]:
    """What the request produces run alone: an independent oracle for the scheduler's stops."""
    h = prefix_hashes(prompt, mm_items)[-1]
    out: list[int] = []
    num_tokens = len(prompt)
    while True:
        token = sample_token(h, len(out), sampling, vocab_size, eos_period)
        out.append(token)
        num_tokens += 1
        h = chain(h, token)
        if len(out) > sampling.min_tokens and is_stop_token(token, sampling):
            return out
        if len(out) >= sampling.max_tokens or num_tokens >= max_model_len:
            return out


@dataclass
class _State:
    token_ids: list[int]
    hashes: list[int]
    num_computed: int
    block_table: list[int]
    sampling: SamplingOptions
    num_prompt: int
    mm_items: list[MultiModalItem] = field(default_factory=list)


@dataclass
class _Running:
    rnd: ExecuteRound
    next_step: int = 0
    samplers: list[str] = field(default_factory=list)


class ProtocolViolation(AssertionError):
    pass


class FakeWorker:
    """Processes rounds one step at a time (`step()`), like a worker whose steps you can pause."""

    def __init__(self, num_blocks: int, block_size: int, *, vocab_size: int = 64, max_model_len: int = 256,
                 eos_period: int = 23, task: RequestKind = RequestKind.GENERATE, model_id: str = "fake",
                 verify_kv: bool = True, mm_tokens_per_item: int = 0, encoder_cache_tokens: int = 0) -> None:
        self.info = WorkerInfo(model_id=model_id, task=task, vocab_size=vocab_size, max_model_len=max_model_len,
                               block_size=block_size, num_kv_blocks=num_blocks,
                               eos_token_ids=(EOS_TOKEN_ID,), attention_backend="fake", dtype="none",
                               device="cpu", pooled_size=2, mm_tokens_per_item=mm_tokens_per_item,
                               encoder_cache_tokens=encoder_cache_tokens)
        self.encoder_cache: dict[str, int] = {}  # content hash -> feature tokens
        self.num_encoded = 0
        self.num_split_images = 0  # chunks that computed only part of an image's placeholders
        self.max_encoder_tokens_seen = 0
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_period = eos_period
        self.verify_kv = verify_kv  # off only for timing the scheduler: the check is O(sequence length)
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.requests: dict[str, _State] = {}
        self.queue: deque[ExecuteRound] = deque()
        self.current: _Running | None = None
        self.next_round_id = 0
        self.num_rounds = 0
        self.num_multi_step_rounds = 0
        self.num_partial_prefills = 0
        self.num_prefix_hit_tokens = 0
        self.aborted: list[str] = []  # ids of AbortRows messages, in arrival order

    # ---- protocol ----

    def submit(self, rnd: ExecuteRound) -> None:
        self._check(rnd.round_id == self.next_round_id, f"round {rnd.round_id}, expected {self.next_round_id}")
        self._check(rnd.num_steps >= 1 and not rnd.is_empty, f"round {rnd.round_id} is empty")
        self.next_round_id += 1
        self.queue.append(rnd)

    def abort(self, request_ids: list[str]) -> None:
        """An AbortRows message: only requests the worker holds or will hold (a round queued
        carries them), each once, may be aborted; this fake computes them on regardless."""
        rounds = [*self.queue, *([self.current.rnd] if self.current is not None else [])]
        queued = {new.request_id for rnd in rounds for new in rnd.new_requests}
        for request_id in request_ids:
            self._check(request_id in self.requests or request_id in queued, f"aborted unknown {request_id}")
        self.aborted.extend(request_ids)

    @property
    def has_work(self) -> bool:
        return self.current is not None or bool(self.queue)

    def step(self) -> StepOutput:
        if self.current is None:
            self.current = _Running(self.queue.popleft())
            return self._step0(self.current)
        return self._decode_step(self.current)

    def run_round(self) -> list[StepOutput]:
        outputs = [self.step()]
        while not outputs[-1].is_last_step:
            outputs.append(self.step())
        return outputs

    # ---- steps ----

    def _step0(self, run: _Running) -> StepOutput:
        rnd = run.rnd
        self.num_rounds += 1
        self.num_multi_step_rounds += rnd.num_steps > 1
        for request_id in rnd.finished_request_ids:
            self._check(self.requests.pop(request_id, None) is not None, f"finished unknown {request_id}")
        order: list[str] = []
        for new in rnd.new_requests:
            self._check(new.request_id not in self.requests, f"{new.request_id} added twice")
            state = _State(list(new.token_ids), prefix_hashes(new.token_ids, new.mm_items), new.num_computed_tokens,
                           list(new.block_ids), new.sampling, new.num_prompt_tokens, list(new.mm_items))
            self.requests[new.request_id] = state
            self._verify_kv(new.request_id, state, state.num_computed)  # prefix-cache hit content
            self.num_prefix_hit_tokens += new.num_computed_tokens
            order.append(new.request_id)
        self._apply_encoder(rnd)
        cached = rnd.cached_requests
        for request_id, blocks in zip(cached.request_ids, cached.new_block_ids, strict=True):
            self._check(request_id in self.requests, f"cached {request_id} unknown")
            self.requests[request_id].block_table.extend(blocks)
            order.append(request_id)
        self._check(len(order) == len(rnd.num_scheduled_tokens), "num_scheduled_tokens length")
        for request_id, n in zip(order, rnd.num_scheduled_tokens, strict=True):
            state = self.requests[request_id]
            self._check(n >= 1, f"{request_id} scheduled with {n} tokens")
            self._check(state.num_computed + n <= len(state.token_ids),
                        f"{request_id}: computes {state.num_computed}+{n} of {len(state.token_ids)} known tokens")
            for item in state.mm_items:
                if item.offset < state.num_computed + n and state.num_computed < item.end:
                    self._check(item.hash in self.encoder_cache, f"{request_id}: computes image {item.hash} at "
                                f"{item.offset} but its encoder output was never cached or already freed")
                    self.num_split_images += item.offset < state.num_computed or item.end > state.num_computed + n
            for _ in range(n):
                self._compute_next(request_id, state)
            if state.num_computed == len(state.token_ids):
                run.samplers.append(request_id)
            else:
                self.num_partial_prefills += 1
        pooled = {p.request_id: [float(len(p.token_ids)), float(sum(p.token_ids) % 97)]
                  for p in rnd.pooling_requests}
        return self._emit(run, 0, pooled)

    def _apply_encoder(self, rnd: ExecuteRound) -> None:
        """Frees first, then encodes (new requests are registered: they carry the pixels)."""
        for h in rnd.encoder_free_hashes:
            self._check(self.encoder_cache.pop(h, None) is not None, f"round {rnd.round_id} frees uncached {h}")
        carried = {item.hash: item.length for s in self.requests.values() for item in s.mm_items}
        for h in rnd.encoder_hashes:
            self._check(h in carried, f"round {rnd.round_id} encodes {h}, which no request carries")
            self._check(h not in self.encoder_cache, f"round {rnd.round_id} encodes {h} again while it is cached")
            self.encoder_cache[h] = carried[h]
            self.num_encoded += 1
        used = sum(self.encoder_cache.values())
        self.max_encoder_tokens_seen = max(self.max_encoder_tokens_seen, used)
        self._check(used <= self.info.encoder_cache_tokens or not used,
                    f"encoder cache holds {used} tokens; capacity {self.info.encoder_cache_tokens}")

    def _decode_step(self, run: _Running) -> StepOutput:
        step = run.next_step
        for request_id in run.samplers:
            state = self.requests[request_id]
            self._compute_next(request_id, state)
        return self._emit(run, step, {})

    def _compute_next(self, request_id: str, state: _State) -> None:
        """Write the KV of position num_computed (the token there must be known)."""
        pos = state.num_computed
        self._check(pos < self.info.max_model_len, f"{request_id}: position {pos} >= max_model_len")
        block_index = pos // self.block_size
        self._check(block_index < len(state.block_table), f"{request_id}: no block for position {pos}")
        block = state.block_table[block_index]
        self._check(0 <= block < len(self.kv), f"{request_id}: block id {block} out of range")
        self.kv[block][pos % self.block_size] = state.hashes[pos]
        state.num_computed += 1

    def _emit(self, run: _Running, step: int, pooled: dict[str, list[float]]) -> StepOutput:
        out = StepOutput(round_id=run.rnd.round_id, step_index=step, pooled=pooled,
                         is_last_step=step == run.rnd.num_steps - 1)
        wants_logprobs = any(self.requests[r].sampling.logprobs is not None for r in run.samplers)
        for request_id in run.samplers:
            state = self.requests[request_id]
            self._verify_kv(request_id, state, state.num_computed)
            token = sample_token(state.hashes[-1], len(state.token_ids) - state.num_prompt, state.sampling,
                                 self.vocab_size, self.eos_period)
            state.token_ids.append(token)
            state.hashes.append(chain(state.hashes[-1], token))
            out.request_ids.append(request_id)
            out.token_ids.append(token)
            if wants_logprobs:
                num_top = state.sampling.logprobs or 0
                out.logprobs.append(-float(token % 7))
                out.num_top_logprobs.append(num_top)
                out.top_token_ids.extend(token + k for k in range(num_top))
                out.top_logprobs.extend(-float(k) for k in range(num_top))
        run.next_step = step + 1
        if out.is_last_step:
            self.current = None
        return out

    def _verify_kv(self, request_id: str, state: _State, num_positions: int) -> None:
        if not self.verify_kv:
            return
        bs = self.block_size
        for pos in range(num_positions):
            got = self.kv[state.block_table[pos // bs]][pos % bs]
            if got != state.hashes[pos]:
                raise ProtocolViolation(f"{request_id}: KV at position {pos} (block "
                                        f"{state.block_table[pos // bs]}) was overwritten or never written")

    @staticmethod
    def _check(ok: bool, message: str) -> None:
        if not ok:
            raise ProtocolViolation(message)
