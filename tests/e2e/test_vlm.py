"""A vision-language model through the three real services equals transformers, token for token.

A tiny random LLaVA (CLIP tower + Llama) served by `spindle serve` with a token budget smaller
than an image, so images are split across prefill chunks; concurrently through the official
openai client: chat requests carrying data: URL images (two identical, sharing their encoder
output and prefix blocks, one different), a text-only completion, a gRPC Generate with image
bytes, and a chat request with a corrupt image (a 400 that disturbs nothing). Each output
equals `LlavaForConditionalGeneration.generate(do_sample=False)` on the same weights and inputs.
"""

from __future__ import annotations

import asyncio
import base64
import io
import urllib.request
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


def expected_chat(vlm_dir: Path, image: bytes, question: str) -> tuple[str, int]:
    """transformers' greedy answer text and prompt length for one image and a question."""
    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = LlavaForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], text=text, return_tensors="pt",
                       add_special_tokens=False)  # the chat template writes its own <s>
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=3)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    return processor.tokenizer.decode(new, skip_special_tokens=True), inputs["input_ids"].shape[1]


def expected_text(vlm_dir: Path, prompt_ids: list[int]) -> str:
    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = LlavaForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=3)
    return processor.tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


async def grpc_with_image(address: str, model: str, text: str, image: bytes) -> list[int]:
    async with grpc_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        sampling = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        request = generation_pb2.GenerateRequest(model=model, text=text, images=[image], sampling=sampling)
        return [t for response in [r async for r in stub.Generate(request)] if response.HasField("chunk")
                for t in response.chunk.token_ids]


def expected_grpc(vlm_dir: Path, image: bytes, text: str) -> list[int]:
    """No marker in the text: the image goes first, after BOS, as the processor places "<image>" there."""
    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = LlavaForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    inputs = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], text="<image>" + text,
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=3)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


async def chat(client: AsyncOpenAI, model: str, image: bytes, question: str):  # noqa: ANN201
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return await chat_url(client, model, url, question)


async def chat_url(client: AsyncOpenAI, model: str, url: str, question: str):  # noqa: ANN201
    return await client.chat.completions.create(
        model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": question}]}],
    )


def test_chat_with_images_matches_transformers(vlm_dir: Path) -> None:
    cat, dog = png(0, (40, 50)), png(1, (64, 24))
    question = "what is in the picture?"
    text_prompt = [0, 17, 230, 45, 99, 301, 12, 8, 77]
    # 16 tokens per step < prompt length: each 16-token image is split across chunks.
    with spindle_serve(vlm_dir, "--max-num-batched-tokens", "16", "--num-scheduler-steps", "4",
                       "--metrics-port", "0") as server:
        async def run():  # noqa: ANN202
            client = AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
            results = await asyncio.gather(
                chat(client, server.model_name, cat, question),
                chat(client, server.model_name, cat, question),
                chat(client, server.model_name, dog, question),
                client.completions.create(model=server.model_name, prompt=text_prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True}),
                grpc_with_image(server.grpc_address, server.model_name, question, cat),
                chat_url(client, server.model_name, "data:image/png;base64," + base64.b64encode(cat[:80]).decode(),
                         question),
                return_exceptions=True,
            )
            await client.close()
            return results

        same1, same2, other, text, grpc_tokens, corrupt = asyncio.run(run())
        with urllib.request.urlopen(server.http_url + "/v1/models", timeout=5) as resp:
            assert resp.status == 200
    want_cat, prompt_len = expected_chat(vlm_dir, cat, question)
    want_dog, _ = expected_chat(vlm_dir, dog, question)
    assert same1.choices[0].message.content == want_cat
    assert same2.choices[0].message.content == want_cat
    assert other.choices[0].message.content == want_dog
    assert want_cat != want_dog  # the image matters
    assert same1.usage.prompt_tokens == prompt_len  # placeholder expanded exactly as the processor does
    assert text.choices[0].text == expected_text(vlm_dir, text_prompt)
    assert grpc_tokens == expected_grpc(vlm_dir, cat, question)
    assert isinstance(corrupt, openai.BadRequestError) and "could not be decoded" in str(corrupt)
