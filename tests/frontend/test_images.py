"""Image inputs on the frontend: sources, limits before decoding, placeholders, content hashes.

data: URLs (PNG, JPEG, WebP), http(s) URLs served by a loopback server (ok, 404, too large,
too slow), corrupt/truncated/unsupported images, the pixel limit checked from the header,
OpenAI image_url parts, and placeholder expansion (offsets, hashes, gRPC prompts without a
marker). Every failure is an InvalidArgumentError (HTTP 400 / INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from services.frontend.image_inputs import expand_placeholders
from services.frontend.images import decode_image, load_image_bytes
from services.frontend.messages import IMAGE_MARKER
from services.frontend.openai_protocol import parse_chat
from shared.errors import InvalidArgumentError

MAX_BYTES, MAX_PIXELS = 64 * 1024, 512 * 512


def encoded(fmt: str, size: tuple[int, int] = (20, 12), seed: int = 0) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def load(source: str | bytes, timeout_s: float = 5.0) -> bytes:
    return await load_image_bytes(source, "image 0", MAX_BYTES, timeout_s)


@pytest.mark.parametrize(("fmt", "mime"), [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
async def test_data_urls_decode_to_rgb(fmt: str, mime: str) -> None:
    image = decode_image(await load(data_url(encoded(fmt), mime)), "image 0", MAX_PIXELS)
    assert image.mode == "RGB" and image.size == (20, 12)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (data_url(b"not an image"), "could not be decoded"),
        (data_url(encoded("PNG")[:60]), "could not be decoded"),  # truncated
        (data_url(encoded("GIF"), "image/gif"), "unsupported image type"),
        (data_url(encoded("PNG"))[:-3] + "!!!", "not valid base64"),
        ("data:image/png," + "x", "base64"),
        ("ftp://example.com/a.png", "unsupported image URL"),
        (data_url(b"\0" * (MAX_BYTES + 16)), "max_image_bytes"),
    ],
)
async def test_bad_sources_are_invalid_arguments(source: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        decode_image(await load(source), "image 0", MAX_PIXELS)


def test_gif_bytes_and_pixel_limit_are_rejected_before_decoding() -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported image format"):
        decode_image(encoded("GIF"), "image 0", MAX_PIXELS)
    big = encoded("PNG", (1024, 1024))  # 1 Mpx > MAX_PIXELS; refused from the header
    with pytest.raises(InvalidArgumentError, match="max_image_pixels"):
        decode_image(big, "image 0", MAX_PIXELS)


@pytest.fixture
async def image_server() -> AsyncIterator[str]:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(body=encoded("JPEG"), content_type="image/jpeg")

    async def huge(_: web.Request) -> web.StreamResponse:
        return web.Response(body=b"\xff" * (MAX_BYTES * 2), content_type="image/png")

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response(body=b"")

    app = web.Application()
    app.router.add_get("/ok.jpg", ok)
    app.router.add_get("/huge.png", huge)
    app.router.add_get("/slow.png", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_http_urls_are_fetched_with_byte_and_time_limits(image_server: str) -> None:
    image = decode_image(await load(f"{image_server}/ok.jpg"), "image 0", MAX_PIXELS)
    assert image.size == (20, 12)
    with pytest.raises(InvalidArgumentError, match="HTTP 404"):
        await load(f"{image_server}/missing.png")
    with pytest.raises(InvalidArgumentError, match="max_image_bytes"):
        await load(f"{image_server}/huge.png")
    with pytest.raises(InvalidArgumentError, match="timed out"):
        await load(f"{image_server}/slow.png", timeout_s=0.3)


def test_openai_image_url_parts_become_markers_and_images() -> None:
    url = data_url(encoded("PNG"))
    parsed = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": " and "}, {"type": "image_url", "image_url": url}]},
    ]})
    generate = parsed.input
    assert generate.messages is not None
    assert generate.messages[0].content == f"look: {IMAGE_MARKER} and {IMAGE_MARKER}"
    assert generate.images == [url, url]
    with pytest.raises(InvalidArgumentError, match="url is required"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})


def test_placeholders_expand_with_offsets_and_content_hashes() -> None:
    a, b = np.zeros((3, 4, 4), np.float32), np.ones((3, 4, 4), np.float32)
    tokens, items = expand_placeholders([0, 5, 99, 6, 99, 7], 99, [a, b], 3)
    assert tokens == [0, 5, 99, 99, 99, 6, 99, 99, 99, 7]
    assert [(i.offset, i.length) for i in items] == [(2, 3), (6, 3)]
    assert items[0].hash != items[1].hash and items[0].shape == (3, 4, 4)
    _, again = expand_placeholders([99, 5], 99, [a.copy()], 3)
    assert again[0].hash == items[0].hash  # equal pixels, equal hash
    # A gRPC text prompt with images but no marker: images go first, after BOS.
    tokens, items = expand_placeholders([0, 5, 6], 99, [a], 2, bos_token_id=0)
    assert tokens == [0, 99, 99, 5, 6] and items[0].offset == 1
    with pytest.raises(InvalidArgumentError, match="2 image placeholders for 1 images"):
        expand_placeholders([99, 99], 99, [a], 2)
