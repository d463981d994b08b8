"""Test helpers for the worker: build a runner on a tiny checkpoint, and a toy greedy scheduler.

`ToyScheduler` plays the scheduler's side of the round protocol in-process: it allocates KV
blocks, shares full prompt blocks between requests (prefix hits), chunks long prompts across
rounds under a token budget, runs `num_steps` steps per round and stops requests at
`max_tokens` (discarding tokens computed past the stop, as the real scheduler may).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.worker.attention import AttentionType, CommonAttentionMetadata, create_backend
from services.worker.kv_cache import allocate_kv_caches
from services.worker.model_runner import ModelRunner
from services.worker.models.loader import load_model, parse_config, read_hf_config
from services.worker.step_output import SampledStep
from shared.execute import CachedRequestData, ExecuteRound, NewRequestData, StepOutput
from shared.sampling import SamplingOptions


def make_runner(
    model_dir: str | Path,
    backend: str = "sdpa",
    num_blocks: int = 256,
    block_size: int = 16,
    max_model_len: int = 512,
    dtype: torch.dtype = torch.float32,
) -> ModelRunner:
    """A runner on `model_dir` with `dtype` activations and KV cache."""
    device = torch.device("cpu")
    config = parse_config(read_hf_config(model_dir))
    attn = create_backend(backend, block_size)
    model = load_model(model_dir, attn, dtype, device)
    caches = allocate_kv_caches(config, num_blocks, block_size, dtype, device, head_major=attn.head_major_cache)
    return ModelRunner(
        model,
        attn,
        caches,
        max_model_len=max_model_len,
        block_size=block_size,
        vocab_size=config.vocab_size,
        eos_token_ids=config.eos_token_ids,
        device=device,
    )


def prefill_logits(model_dir: Path, ids: torch.Tensor, backend_name: str = "sdpa") -> torch.Tensor:
    """Our model's logits for one prompt computed in one pass through the paged path."""
    backend = create_backend(backend_name, 16)
    model = load_model(model_dir, backend, torch.float32, torch.device("cpu"))
    cfg = model.config
    n = len(ids)
    blocks = -(-n // 16)
    caches = [torch.zeros(2, blocks, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    lens = np.array([n])
    common = CommonAttentionMetadata(
        AttentionType.DECODER,
        1,
        n,
        n,
        n,
        torch.tensor([0, n]),
        torch.tensor([n]),
        lens,
        lens,
        torch.arange(blocks)[None],
        torch.arange(n),
    )
    builder = backend.metadata_builder()
    meta = builder.build(
        common, [torch.from_numpy(a) for a in builder.prepare(lens, lens, AttentionType.DECODER)]
    )
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n), caches, meta))


def run_round(runner: ModelRunner, round_: ExecuteRound) -> list[StepOutput]:
    steps: list[SampledStep] = []
    runner.execute_round(round_, steps.append)
    return [s.to_step_output() for s in steps]


@dataclass
class ToyRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # scheduler's view: tokens whose KV is computed
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class ToyScheduler:
    def __init__(
        self,
        runner: ModelRunner,
        num_blocks: int,
        block_size: int,
        token_budget: int = 24,
        num_steps: int = 1,
    ) -> None:
        self.runner = runner
        self.block_size = block_size
        self.token_budget = token_budget
        self.num_steps = num_steps
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.prefix_blocks: dict[tuple[int, ...], int] = {}  # full-block token prefix -> block id
        self.requests: list[ToyRequest] = []
        self.finished: list[str] = []
        self.round_id = 0
        self.prefix_hit_tokens = 0  # tokens new requests skipped thanks to shared blocks
        self.max_chunks = 0  # most rounds one prompt's prefill took

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingOptions | None = None,
    ) -> ToyRequest:
        # The worker replays the stop rule it is given (round_stops.py): tell it the toy's own
        # (max_tokens, no EOS), as the real scheduler sends the rule it applies.
        sampling = dataclasses.replace(
            sampling or SamplingOptions(temperature=0.0), max_tokens=max_tokens, ignore_eos=True
        )
        req = ToyRequest(request_id, prompt, max_tokens, sampling)
        self.requests.append(req)
        return req

    def _ensure_blocks(self, req: ToyRequest, num_positions: int) -> list[int]:
        need = -(-num_positions // self.block_size) - len(req.block_ids)
        new = [self.free_blocks.pop() for _ in range(max(need, 0))]
        req.block_ids.extend(new)
        return new

    def _prefix_hit(self, req: ToyRequest) -> None:
        """Reuse full prompt blocks already computed for an earlier request (never the last token)."""
        bs = self.block_size
        for k in range((len(req.tokens) - 1) // bs):
            block = self.prefix_blocks.get(tuple(req.tokens[: (k + 1) * bs]))
            if block is None:
                break
            req.block_ids.append(block)
            req.num_computed = (k + 1) * bs

    def step(self) -> None:
        """Schedule and run one round."""
        new, cached, cached_blocks, scheduled, new_sched = [], [], [], [], []
        budget = self.token_budget
        for req in self.requests:
            if req.done or budget <= 0:
                continue
            if not req.sent:
                self._prefix_hit(req)
                self.prefix_hit_tokens += req.num_computed
            n = min(len(req.tokens) - req.num_computed, budget)
            budget -= n
            samples = req.num_computed + n == len(req.tokens)
            extra = self.num_steps - 1 if samples else 0
            blocks = self._ensure_blocks(req, req.num_computed + n + extra)
            if not req.sent:
                new.append(
                    NewRequestData(
                        req.request_id,
                        list(req.tokens),
                        len(req.prompt),
                        req.num_computed,
                        list(req.block_ids),
                        req.sampling,
                    )
                )
                new_sched.append((req, n))
                req.sent = True
            else:
                cached.append(req)
                cached_blocks.append(blocks)
                scheduled.append((req, n))
        order = new_sched + scheduled
        round_ = ExecuteRound(
            round_id=self.round_id,
            num_steps=self.num_steps,
            new_requests=new,
            cached_requests=CachedRequestData([r.request_id for r in cached], cached_blocks),
            num_scheduled_tokens=[n for _, n in order],
            finished_request_ids=self.finished,
        )
        self.round_id += 1
        self.finished = []
        outputs = run_round(self.runner, round_)
        assert len(outputs) == self.num_steps and outputs[-1].is_last_step
        by_id = {r.request_id: r for r in self.requests}
        for req, n in order:
            req.num_computed += n
        for out in outputs:
            for request_id, token in zip(out.request_ids, out.token_ids, strict=True):
                req = by_id[request_id]
                if out.step_index > 0:
                    req.num_computed += 1
                if not req.done:
                    req.output.append(token)
        for req, _ in order:
            self._register_full_blocks(req)
            if req.done and req.request_id not in self.finished:
                self.finished.append(req.request_id)

    def preempt(self, request_id: str) -> None:
        """Drop a running request's KV (recompute later): it returns as a new request."""
        req = next(r for r in self.requests if r.request_id == request_id)
        self.finished.append(request_id)
        req.sent, req.num_computed, req.block_ids = False, 0, []

    def _register_full_blocks(self, req: ToyRequest) -> None:
        bs = self.block_size
        for k in range(req.num_computed // bs):
            self.prefix_blocks.setdefault(tuple(req.tokens[: (k + 1) * bs]), req.block_ids[k])

    def run(self, max_rounds: int = 500) -> dict[str, list[int]]:
        for _ in range(max_rounds):
            if all(r.done for r in self.requests):
                break
            self.step()
        return {r.request_id: r.output for r in self.requests}
