"""LLaVA on the worker: greedy tokens equal transformers' LlavaForConditionalGeneration.generate.

A tiny random LLaVA (CLIP tower + Llama) is built from a fixed seed; the transformers
processor prepares inputs for both sides. Rounds are driven by hand with a token budget
smaller than an image, so each image's placeholder range is split across chunks and its
encoder output must survive between them; identical images in concurrent requests are
encoded once; a round that needs an image the cache lacks is a protocol error.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from services.worker.attention import create_backend
from services.worker.kv_cache import allocate_kv_caches
from services.worker.model_runner import ModelRunner
from services.worker.models.loader import load_model, parse_config, read_hf_config
from services.worker.telemetry import WorkerMetrics, WorkerTelemetry
from shared.errors import InvalidArgumentError
from shared.execute import CachedRequestData, ExecuteRound, MultiModalItem, NewRequestData
from shared.sampling import SamplingOptions
from shared.tiny_vlm import build_vlm

MAX_TOKENS = 8
BLOCK = 16


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("vlm"))


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


def _prepare(processor, text: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor, list[MultiModalItem]]:
    """Token ids (placeholders expanded), pixel values and one item per image, in prompt order."""
    out = processor(images=images, text=text, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    pixels = out["pixel_values"]
    items, i, k = [], 0, 0
    while i < len(ids):
        if ids[i] != image_id:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_id:
            j += 1
        data = pixels[k].numpy().astype(np.float32).tobytes()
        items.append(MultiModalItem(hashlib.sha256(data).hexdigest(), i, j - i, data, tuple(pixels[k].shape)))
        i, k = j, k + 1
    return ids, pixels, items


def _runner(vlm_dir: Path, backend: str) -> ModelRunner:
    config = parse_config(read_hf_config(vlm_dir))
    attn = create_backend(backend, BLOCK)
    model = load_model(vlm_dir, attn, torch.float32, torch.device("cpu"))
    caches = allocate_kv_caches(config, 64, BLOCK, torch.float32, torch.device("cpu"))
    return ModelRunner(model, attn, caches, max_model_len=512, block_size=BLOCK, vocab_size=config.vocab_size,
                       eos_token_ids=(), device=torch.device("cpu"), encoder_cache_tokens=64)


def _generate(runner: ModelRunner, prompts: dict[str, tuple[list[int], list[MultiModalItem]]],
              budget: int) -> dict[str, list[int]]:
    """A toy scheduler: chunked prefill of all prompts under `budget`, then greedy decode.

    Encodes an image in the round whose chunk first reaches it; frees it after the last round
    that needs it (reference-counted by content hash across the requests, all admitted at once).
    """
    sampling = SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    blocks = {rid: list(range(i * 8, (i + 1) * 8)) for i, rid in enumerate(prompts)}
    computed = dict.fromkeys(prompts, 0)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    # Every request is admitted at once, so each holds its images from the start.
    needs = Counter(item.hash for _, items in prompts.values() for item in items)
    encoded: set[str] = set()
    sent: set[str] = set()
    round_id, frees = 0, []
    while any(len(o) < MAX_TOKENS for o in out.values()):
        rnd = ExecuteRound(round_id=round_id, encoder_free_hashes=frees)
        frees, left, counts = [], budget, {}
        for rid, (ids, items) in prompts.items():
            total = len(ids) + len(out[rid])
            n = min(total - computed[rid], left)
            if n <= 0 or len(out[rid]) >= MAX_TOKENS:
                continue
            start, end = computed[rid], computed[rid] + n
            for item in items:
                if item.offset < end and start < item.end and item.hash not in encoded:
                    encoded.add(item.hash)
                    rnd.encoder_hashes.append(item.hash)
                if start < item.end <= end:  # this chunk is the item's last user in this request
                    needs[item.hash] -= 1
                    if needs[item.hash] == 0:
                        frees.append(item.hash)
                        encoded.discard(item.hash)
            if rid in sent:
                rnd.cached_requests.request_ids.append(rid)
                rnd.cached_requests.new_block_ids.append([])
            else:
                rnd.new_requests.append(NewRequestData(rid, ids, len(ids), 0, blocks[rid], sampling, mm_items=items))
                sent.add(rid)
            counts[rid] = n
            computed[rid] = end
            left -= n
        # new requests first, then cached ones, as the protocol orders them
        order = [r.request_id for r in rnd.new_requests] + rnd.cached_requests.request_ids
        rnd.num_scheduled_tokens = [counts[rid] for rid in order]
        steps = []
        runner.execute_round(rnd, steps.append)
        for step in (s.to_step_output() for s in steps):
            for rid, tok in zip(step.request_ids, step.token_ids, strict=True):
                out[rid].append(tok)
        round_id += 1
    return out


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_greedy_tokens_match_transformers(vlm_dir: Path, backend: str) -> None:
    processor = AutoProcessor.from_pretrained(vlm_dir)
    hf = LlavaForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    cat, dog = _image(0, (40, 50)), _image(1, (64, 24))  # different sizes; the processor resizes
    cases = {
        "one": ("<s>user\n<image> what is this?", [cat]),
        "two": ("compare <image> and <image> now", [cat, dog]),
        "same": ("<s>user\n<image> what is this?", [cat]),  # identical to "one": encoded once
    }
    prompts, expected = {}, {}
    for name, (text, images) in cases.items():
        ids, pixels, items = _prepare(processor, text, images)
        prompts[name] = (ids, items)
        with torch.no_grad():
            gen = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=3)
        expected[name] = gen[0, len(ids):].tolist()
    runner = _runner(vlm_dir, backend)
    got = _generate(runner, prompts, budget=10)  # < 16 tokens per image: images split across chunks
    assert got == expected
    assert runner.encoder_cache is not None
    assert runner.encoder_cache.num_encoded == 2  # cat once for all three requests, dog once
    assert runner.encoder_cache.num_tokens == 0  # every output freed after its last chunk
    assert runner.encoder_cache.last_encode_seconds > 0


def test_round_needing_an_uncached_image_is_rejected(vlm_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(vlm_dir)
    ids, _, items = _prepare(processor, "<image> hi", [_image(0, (32, 32))])
    runner = _runner(vlm_dir, "sdpa")
    sampling = SamplingOptions(temperature=0.0, max_tokens=2)
    rnd = ExecuteRound(round_id=0, new_requests=[NewRequestData("a", ids, len(ids), 0, [0, 1], sampling,
                                                                mm_items=items)],
                       cached_requests=CachedRequestData(), num_scheduled_tokens=[len(ids)])
    with pytest.raises(InvalidArgumentError, match="not cached"):
        runner.execute_round(rnd, lambda step: None)


def test_encoder_telemetry_records_time_and_cache_size() -> None:
    metrics = WorkerMetrics()
    trace = WorkerTelemetry(metrics=metrics).start_round(ExecuteRound(round_id=0, encoder_hashes=["a"]))
    trace.encoder_done(1, 0.002, 16)
    trace.end()
    assert metrics.registry.get_sample_value("spindle:worker_encoder_duration_seconds_count") == 1
    assert metrics.registry.get_sample_value("spindle:worker_encoder_cache_tokens") == 16
