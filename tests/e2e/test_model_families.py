"""Every newer model family through the three real services equals transformers, token for token.

One `spindle serve` per family named in issue 13 (the default attention backend of this host),
each checkpoint a tiny random one in the family's real config.json layout
(`shared.tiny_families`). A server start costs about 10 s of this suite's budget, so the RoPE
variants that differ from these only in their tables (linear, dynamic, Phi-4-mini's partial
rotary) are covered through the worker's runner in tests/worker/test_model_families.py. Four
concurrent gRPC streams and four HTTP requests (half streamed) per family, sequences running
past the 32-token original windows of the scaled RoPE variants, compared with
`generate(do_sample=False)`. Longrope sequences stay within their 48-token window, where
transformers and spindle define the same thing (see services/worker/models/rope_scaling.py;
tests/worker/test_model_families.py checks beyond it).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.worker.models.loader import parse_config, read_hf_config
from shared.tiny_families import build_family
from tests.e2e.oracle import greedy_tokens
from tests.e2e.server import spindle_serve
from tests.e2e.test_generate_matches_transformers import assert_equal_up_to_bf16_near_ties, run_both_apis

pytestmark = pytest.mark.e2e

FAMILIES = ["gemma2", "llama3", "phi3.5", "qwen2.5-yarn", "qwen3"]
# (prompt length, max_tokens): up to 48 positions, past 32 (llama3 / yarn original windows).
SHAPES = [(30, 18), (20, 28), (9, 12), (3, 40)]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-families")
    return {family: build_family(root / family, family, seed=10 + i) for i, family in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_greedy_matches_transformers(family_dirs: dict[str, Path], family: str) -> None:
    model_dir = family_dirs[family]
    rng = random.Random(family)
    jobs = [([rng.randrange(4, 512) for _ in range(n)], max_tokens) for n, max_tokens in SHAPES]
    expected = [greedy_tokens(model_dir, p, n) for p, n in jobs]
    eos = set(parse_config(read_hf_config(model_dir)).eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with spindle_serve(model_dir) as server:
        grpc_results, http_results = asyncio.run(run_both_apis(server, jobs))
    for (prompt, max_tokens), want, got in zip(jobs, expected, grpc_results, strict=True):
        finish = "stop" if want[-1] in eos else "length"
        assert got.token_ids == want, f"gRPC prompt {prompt} max_tokens {max_tokens}"
        assert got.finish_reason == finish
        assert got.text == tokenizer.decode(want, skip_special_tokens=True)
    for want, (text, finish) in zip(expected, http_results, strict=True):
        assert text == tokenizer.decode(want, skip_special_tokens=True)
        assert finish == ("stop" if want[-1] in eos else "length")


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_family_in_bf16_follows_transformers_in_bf16(family_dirs: dict[str, Path], family: str) -> None:
    """--dtype bfloat16 through the fused bf16 kernels where these families differ from Llama:
    Gemma 2's unit-offset norms, tanh-GELU and logit soft-capping, Qwen3's per-head q/k norms.
    Up to bf16 near-ties (test_generate_matches_transformers.py says why)."""
    import torch

    model_dir = family_dirs[family]
    rng = random.Random(f"{family}-bf16")
    jobs = [([rng.randrange(4, 512) for _ in range(n)], max_tokens) for n, max_tokens in SHAPES * 2]
    expected = [greedy_tokens(model_dir, p, n, dtype=torch.bfloat16) for p, n in jobs]
    with spindle_serve(model_dir, "--dtype", "bfloat16") as server:
        grpc_results, _ = asyncio.run(run_both_apis(server, jobs))
    assert_equal_up_to_bf16_near_ties(model_dir, jobs, expected, [r.token_ids for r in grpc_results])
