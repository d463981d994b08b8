"""Model families (Llama 3.x, linear / dynamic RoPE, Qwen2.5 YaRN, Qwen3, Phi-3.5, Phi-4-mini, Gemma 2)
against transformers, through the worker's runner.

Each family is a tiny random checkpoint in its real config.json layout (`shared.tiny_families`).
A toy scheduler drives the runner with chunked prefill, a prefix-cache hit and several requests
at once; greedy tokens must equal `generate(do_sample=False)`. Sequences run past
`original_max_position_embeddings` wherever transformers and spindle define the same thing
there; for longrope, transformers recomputes the whole sequence with the long factors once it
outgrows the window (see `rope_scaling.py`), so the oracle past the window is transformers'
own layers with the long factors applied by position.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from worker_harness import ToyScheduler, make_runner, prefill_logits

from services.worker.attention.naive import create as create_naive
from services.worker.attention.padded import PaddedBackend
from services.worker.config import WorkerConfig
from services.worker.kernels.build import kernels_error
from services.worker.models.loader import load_model, parse_config, read_hf_config
from services.worker.worker import Worker
from shared.tiny_families import FAMILY_CONFIGS, build_family

FAMILIES = sorted(FAMILY_CONFIGS)
MAX_TOKENS = 24


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    long = torch.randint(4, 512, (40,), generator=gen).tolist()
    return {
        "long": long,  # past the 32-token original windows and Gemma's 16-token sliding window
        "shared": long[:35] + [7, 8, 9],  # prefix-cache hit on "long"'s first two blocks
        "short": torch.randint(4, 512, (5,), generator=gen).tolist(),
        "mid": torch.randint(4, 512, (17,), generator=gen).tolist(),
        "one": [42],
    }


def _original_window(family: str) -> int | None:
    """Where transformers and spindle part ways: longrope's original window (else no limit)."""
    hf = FAMILY_CONFIGS[family]
    return hf.get("original_max_position_embeddings") if "longrope" in str(hf.get("rope_scaling")) else None


def _jobs(family: str) -> dict[str, tuple[list[int], int]]:
    window = _original_window(family)
    return {
        name: (prompt, MAX_TOKENS if window is None else min(MAX_TOKENS, window - len(prompt)))
        for name, prompt in _prompts().items()
    }


def _generate(model: nn.Module, jobs: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    with torch.inference_mode():
        return {
            name: model.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=3
            )[0, len(p) :].tolist()
            for name, (p, n) in jobs.items()
        }


_REFERENCES: dict[str, dict[str, list[int]]] = {}


def _reference(family: str, path: Path) -> dict[str, list[int]]:
    if family not in _REFERENCES:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        _REFERENCES[family] = _generate(model, _jobs(family))
    return _REFERENCES[family]


def _run_spindle(path: Path, backend: str, num_steps: int, jobs: dict[str, tuple[list[int], int]]) -> ToyScheduler:
    max_len = min(512, parse_config(read_hf_config(path)).max_position_embeddings)
    runner = make_runner(path, backend, num_blocks=96, max_model_len=max_len)
    scheduler = ToyScheduler(runner, num_blocks=96, block_size=16, token_budget=24, num_steps=num_steps)
    for name, (prompt, max_tokens) in jobs.items():
        scheduler.add(name, prompt, max_tokens)
    return scheduler


# The CPU default where its kernels load; naive (the reference) elsewhere. The logits test runs both torch backends.
_MULTI_STEP_BACKEND = "paged" if kernels_error() is None else "naive"


@pytest.mark.parametrize(("backend", "num_steps"), [("sdpa", 1), (_MULTI_STEP_BACKEND, 4)])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(
    family_models: dict[str, Path], family: str, backend: str, num_steps: int
) -> None:
    jobs = _jobs(family)
    scheduler = _run_spindle(family_models[family], backend, num_steps, jobs)
    got = scheduler.run()
    assert scheduler.prefix_hit_tokens >= 16
    assert got == _reference(family, family_models[family])
    rope = parse_config(read_hf_config(family_models[family])).rope
    longest = max(len(p) + n for p, n in jobs.values())
    if rope.rope_type in ("llama3", "yarn", "linear"):  # the point of scaling: past the original window
        assert longest > (rope.original_max_position_embeddings or rope.max_position_embeddings)


class _LongropeByPosition(nn.Module):
    """transformers' own short and long longrope frequencies, chosen per position (spindle's rule)."""

    def __init__(self, config, long_from: int | None = None) -> None:  # noqa: ANN001 - a Phi3Config
        super().__init__()
        window = config.rope_parameters["original_max_position_embeddings"]
        self.short, self.scale = ROPE_INIT_FUNCTIONS["longrope"](config, None)
        self.long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=window + 1)
        self.window = window if long_from is None else long_from

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.where(position_ids[..., None] >= self.window, self.long, self.short)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(x.dtype), (emb.sin() * self.scale).to(x.dtype)


@pytest.mark.parametrize("family", ["phi3.5", "phi4-mini"])
def test_longrope_past_the_original_window(family_models: dict[str, Path], family: str) -> None:
    jobs = {name: (prompt, MAX_TOKENS) for name, prompt in _prompts().items()}  # "long" ends at 64 > 48
    hf = AutoModelForCausalLM.from_pretrained(family_models[family], dtype=torch.float32)
    hf.model.rotary_emb = _LongropeByPosition(hf.config)
    expected = _generate(hf, jobs)
    got = _run_spindle(family_models[family], "sdpa", 2, jobs).run()
    assert got == expected
    hf.model.rotary_emb = _LongropeByPosition(hf.config, long_from=10**9)  # short factors everywhere
    assert got["long"] != _generate(hf, {"long": jobs["long"]})["long"]  # the long factors matter here


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family_models: dict[str, Path], family: str, backend: str) -> None:
    """One 40-token prefill: every row's logits (Gemma 2: soft-capped ones) equal transformers'."""
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    ours = prefill_logits(family_models[family], ids, backend)
    hf = AutoModelForCausalLM.from_pretrained(family_models[family], dtype=torch.float32)
    with torch.inference_mode():
        reference = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    if family == "gemma2":  # the final cap really acts at this size
        assert ours.abs().max() < 5.0 < (hf.lm_head(hf.model(ids[None]).last_hidden_state)).abs().max()


class _NoSoftcapBackend(PaddedBackend):
    supports_logit_softcap = False


def test_a_backend_without_softcapping_refuses_gemma2_at_start_up(family_models: dict[str, Path]) -> None:
    backend = _NoSoftcapBackend("plain", create_naive(16).kernel, 16)
    with pytest.raises(ValueError, match="'plain' does not support .*attn_logit_softcapping"):
        load_model(family_models["gemma2"], backend, torch.float32, torch.device("cpu"))
    llama = load_model(family_models["llama3"], backend, torch.float32, torch.device("cpu"))
    assert llama.config.rope.rope_type == "llama3"  # only the option it lacks is refused


def test_scaled_context_is_what_the_worker_serves(family_models: dict[str, Path]) -> None:
    """YaRN and linear scaling extend the context; dynamic NTK is served within its window only."""

    def worker(family: str, max_model_len: int | None = None) -> Worker:
        config = WorkerConfig(model=str(family_models[family]), max_model_len=max_model_len, num_threads=2)
        return Worker(config)

    assert worker("qwen2.5-yarn").info.max_model_len == 128  # original 32 x factor 4
    assert worker("llama-linear").info.max_model_len == 192  # 48 x 4
    assert worker("llama-dynamic").info.max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len=257 exceeds the model's 256 positions"):
        worker("llama-dynamic", 257)
