"""A vision-language model through the three real services equals transformers, token for token.

A tiny random LLaVA (CLIP tower + Llama) served by `spindle serve` with a token budget smaller
than an image, so images are split across prefill chunks; concurrently through the official
openai client: 13 chat requests carrying data: URL images (one or two each, of different
sizes; identical ones share encoder outputs and prefix blocks, different ones at the same
place do not), a text-only completion, a gRPC Generate with image bytes, and a chat request
with a corrupt image (a 400 that disturbs nothing), with multi-step on. Each output
equals `LlavaForConditionalGeneration.generate(do_sample=False)` on the same weights and inputs.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from openai import AsyncOpenAI
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc
from shared.tiny_vlm import build_vlm
from tests.e2e.clients import grpc_channel
from tests.e2e.server import spindle_serve

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("models") / "tiny-llava")


def png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@functools.cache
def hf(vlm_dir: Path):  # noqa: ANN201 - (processor, model), loaded once
    model = LlavaForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    return AutoProcessor.from_pretrained(vlm_dir), model


def hf_generate(vlm_dir: Path, inputs: dict) -> list[int]:
    with torch.no_grad():
        out = hf(vlm_dir)[1].generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                      pad_token_id=3)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def rgb(image: bytes) -> Image.Image:
    return Image.open(io.BytesIO(image)).convert("RGB")


def expected_chat(vlm_dir: Path, images: tuple[bytes, ...], question: str) -> tuple[str, int]:
    """transformers' greedy answer text and prompt length for images followed by a question."""
    processor = hf(vlm_dir)[0]
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    inputs = processor(images=[rgb(i) for i in images], text=text, return_tensors="pt",
                       add_special_tokens=False)  # the chat template writes its own <s>
    return processor.tokenizer.decode(hf_generate(vlm_dir, inputs), skip_special_tokens=True), \
        inputs["input_ids"].shape[1]


def expected_text(vlm_dir: Path, prompt_ids: list[int]) -> str:
    new = hf_generate(vlm_dir, {"input_ids": torch.tensor([prompt_ids])})
    return hf(vlm_dir)[0].tokenizer.decode(new, skip_special_tokens=True)


async def grpc_with_image(address: str, model: str, text: str, image: bytes) -> list[int]:
    async with grpc_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        sampling = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        request = generation_pb2.GenerateRequest(model=model, text=text, images=[image], sampling=sampling)
        return [t for response in [r async for r in stub.Generate(request)] if response.HasField("chunk")
                for t in response.chunk.token_ids]


def expected_grpc(vlm_dir: Path, image: bytes, text: str) -> list[int]:
    """No marker in the text: the image goes first, after BOS, as the processor places "<image>" there."""
    inputs = hf(vlm_dir)[0](images=[rgb(image)], text="<image>" + text, return_tensors="pt")
    return hf_generate(vlm_dir, inputs)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


async def chat(client: AsyncOpenAI, model: str, images: tuple[bytes, ...], question: str):  # noqa: ANN201
    parts = [*({"type": "image_url", "image_url": {"url": data_url(i)}} for i in images),
             {"type": "text", "text": question}]
    return await client.chat.completions.create(
        model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": parts}],
    )


def test_chat_with_images_matches_transformers(vlm_dir: Path) -> None:
    cat, dog, fox = png(0, (40, 50)), png(1, (64, 24)), png(2, (32, 32))  # sizes differ; the processor resizes
    questions = ("what is in the picture?", "describe it")
    # 13 chats: identical images and prompts (encoder-cache and prefix hits), different images
    # at the same place, one and two images per request.
    pool = [(cat,), (dog,), (fox,), (cat, dog), (cat,), (dog, fox)]
    chats = [(pool[i % len(pool)], questions[i % 2]) for i in range(13)]
    text_prompt = [0, 17, 230, 45, 99, 301, 12, 8, 77]
    # 16 tokens per step < prompt length: each 16-token image is split across chunks.
    with spindle_serve(vlm_dir, "--max-num-batched-tokens", "16", "--num-scheduler-steps", "4") as server:
        async def run():  # noqa: ANN202
            client = AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
            corrupt = data_url(cat[:80])
            results = await asyncio.gather(
                *(chat(client, server.model_name, images, question) for images, question in chats),
                client.completions.create(model=server.model_name, prompt=text_prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True}),
                grpc_with_image(server.grpc_address, server.model_name, questions[0], cat),
                client.chat.completions.create(model=server.model_name, max_tokens=MAX_TOKENS, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": corrupt}}]}]),
                return_exceptions=True,
            )
            await client.close()
            return results

        *answers, text, grpc_tokens, corrupt = asyncio.run(run())
    wanted = {key: expected_chat(vlm_dir, *key) for key in set(chats)}
    for (images, question), answer in zip(chats, answers, strict=True):
        assert not isinstance(answer, BaseException), answer
        want, prompt_len = wanted[(images, question)]
        assert answer.choices[0].message.content == want
        assert answer.usage.prompt_tokens == prompt_len  # placeholders expanded as the processor does
    assert len({answer for answer, _ in wanted.values()}) == len(wanted)  # every image and prompt matters
    assert text.choices[0].text == expected_text(vlm_dir, text_prompt)
    assert grpc_tokens == expected_grpc(vlm_dir, cat, questions[0])
    assert isinstance(corrupt, openai.BadRequestError) and "could not be decoded" in str(corrupt)
