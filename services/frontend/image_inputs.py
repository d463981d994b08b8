"""A request's images as the scheduler and worker take them: pixels, placeholder ranges, hashes.

The frontend prepares images with the model directory's own image processor (transformers,
PIL path when torchvision is missing), in a thread pool so the event loop keeps serving. Each
image placeholder token in the prompt becomes `mm_tokens_per_item` copies (the number of
feature tokens its encoder output has); the content hash is a SHA-256 of the processed pixels
(the encoder's exact input), so equal images share encoder outputs and prefix-cache blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from services.frontend.images import ImageSource, decode_image, load_image_bytes
from services.frontend.limits import RequestLimits
from services.frontend.messages import IMAGE_MARKER, ChatMessage, SchedulerInfo
from shared.errors import InvalidArgumentError
from shared.execute import MultiModalItem


def image_token_id(model_dir: str) -> int | None:
    """The image placeholder token of a vision-language checkpoint (config.json), else None."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = config.get("image_token_id", config.get("image_token_index"))
    return None if value is None else int(value)


class ImageInputs:
    """Turns image sources into `MultiModalItem`s and expands the prompt's placeholders."""

    def __init__(self, model_dir: str, num_threads: int = 2) -> None:
        self.model_dir = model_dir
        self.image_token_id = image_token_id(model_dir)
        self._processor: Any = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="images")

    def _image_processor(self) -> Any:
        with self._lock:  # loaded once, on first use, in a pool thread
            if self._processor is None:
                from transformers import AutoImageProcessor

                self._processor = AutoImageProcessor.from_pretrained(self.model_dir)
            return self._processor

    async def process(
        self, sources: Sequence[ImageSource], token_ids: list[int], info: SchedulerInfo, limits: RequestLimits,
        bos_token_id: int | None = None,
    ) -> tuple[list[int], list[MultiModalItem]]:
        """(prompt with placeholders expanded, one item per image in prompt order)."""
        if info.mm_tokens_per_item <= 0 or self.image_token_id is None:
            raise InvalidArgumentError(f"model {info.model_id!r} takes no images")
        if len(sources) > info.limit_mm_per_prompt:
            raise InvalidArgumentError(f"the request has {len(sources)} images; at most {info.limit_mm_per_prompt} "
                                       "per prompt (--limit-mm-per-prompt)")
        data = await asyncio.gather(*(
            load_image_bytes(s, f"image {i}", limits.max_image_bytes, limits.max_image_fetch_seconds)
            for i, s in enumerate(sources)
        ))
        loop = asyncio.get_running_loop()
        pixels = await asyncio.gather(*(
            loop.run_in_executor(self._pool, self._preprocess, d, f"image {i}", limits.max_image_pixels)
            for i, d in enumerate(data)
        ))
        return expand_placeholders(token_ids, self.image_token_id, pixels, info.mm_tokens_per_item, bos_token_id)

    def _preprocess(self, data: bytes, where: str, max_pixels: int) -> np.ndarray:
        image = decode_image(data, where, max_pixels)
        out = self._image_processor()(images=[image], return_tensors="np")
        return np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)

    def with_image_tokens(self, messages: Sequence[ChatMessage], tokenizer: Any) -> list[ChatMessage]:
        """Messages with each `IMAGE_MARKER` replaced by the model's image token text."""
        if self.image_token_id is None:
            return list(messages)
        token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        return [dataclasses.replace(m, content=m.content.replace(IMAGE_MARKER, token)) if m.images else m
                for m in messages]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@functools.cache
def image_inputs(model_dir: str) -> ImageInputs:
    """One `ImageInputs` (processor and thread pool) per model directory, made on first use."""
    return ImageInputs(model_dir)


def expand_placeholders(
    token_ids: list[int], image_token: int, pixels: Sequence[np.ndarray], tokens_per_item: int,
    bos_token_id: int | None = None,
) -> tuple[list[int], list[MultiModalItem]]:
    """Each image placeholder -> `tokens_per_item` copies; items carry their ranges and hashes.

    With no placeholder in the prompt the images go first (after a leading BOS, when the
    tokenizer added one) — a gRPC text prompt with images but no "<image>" marker. Otherwise
    the number of placeholders must equal the number of images.
    """
    positions = [i for i, t in enumerate(token_ids) if t == image_token]
    if not positions and pixels:
        start = 1 if token_ids and bos_token_id is not None and token_ids[0] == bos_token_id else 0
        token_ids = token_ids[:start] + [image_token] * len(pixels) + token_ids[start:]
        positions = list(range(start, start + len(pixels)))
    if len(positions) != len(pixels):
        raise InvalidArgumentError(f"the prompt has {len(positions)} image placeholders for {len(pixels)} images")
    out: list[int] = []
    items: list[MultiModalItem] = []
    previous = 0
    for position, array in zip(positions, pixels, strict=True):
        out.extend(token_ids[previous:position])
        raw = array.tobytes()
        digest = hashlib.sha256(raw)
        digest.update(repr(array.shape).encode())
        items.append(MultiModalItem(digest.hexdigest(), len(out), tokens_per_item, raw, tuple(array.shape)))
        out.extend([image_token] * tokens_per_item)
        previous = position + 1
    out.extend(token_ids[previous:])
    return out, items

