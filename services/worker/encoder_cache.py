"""The worker's encoder cache: image features keyed by content hash, and their merge into inputs.

The scheduler owns the budget and decides, per round, which outputs to drop
(`encoder_free_hashes`) and which items to encode (`encoder_hashes`); this module only obeys
and checks: a hash the round needs but the cache lacks, or a cache past its capacity, is a
protocol error (the scheduler broke the contract), never a silent re-encode. Keyed by
content, not request, so identical images in concurrent requests are encoded once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from services.worker.models.llava import LlavaForConditionalGeneration
from shared.errors import InvalidArgumentError
from shared.execute import ExecuteRound, MultiModalItem


class EncoderCache:
    """Features [length, hidden] per content hash, plus the items of the requests the worker holds."""

    def __init__(self, model: LlavaForConditionalGeneration, capacity_tokens: int, device: torch.device) -> None:
        self.model = model
        self.capacity_tokens = capacity_tokens
        self.device = device
        self.features: dict[str, torch.Tensor] = {}
        self.num_tokens = 0
        self.num_encoded = 0  # items encoded since start (tests, metrics)
        self.last_encode_seconds = 0.0  # the last round's encoder time (telemetry)
        self._items: dict[str, list[MultiModalItem]] = {}  # request id -> its items
        self._pixels: dict[str, MultiModalItem] = {}  # hash -> an item carrying its pixels

    # ---- requests ----

    def add_request(self, request_id: str, items: Sequence[MultiModalItem]) -> None:
        if items:
            self._items[request_id] = list(items)
            for item in items:
                self._pixels.setdefault(item.hash, item)

    def remove_requests(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._items.pop(request_id, None)
        if request_ids:
            live = {item.hash for items in self._items.values() for item in items}
            self._pixels = {h: item for h, item in self._pixels.items() if h in live}

    # ---- round ----

    def apply_round(self, round_: ExecuteRound) -> None:
        """Drop the outputs the scheduler freed, then encode what this round needs (one batch)."""
        for h in round_.encoder_free_hashes:
            features = self.features.pop(h, None)
            if features is None:
                raise InvalidArgumentError(f"round {round_.round_id} frees encoder output {h!r}, which is not cached")
            self.num_tokens -= features.shape[0]
        todo = [h for h in dict.fromkeys(round_.encoder_hashes) if h not in self.features]
        if not todo:
            return
        items = []
        for h in todo:
            item = self._pixels.get(h)
            if item is None:
                raise InvalidArgumentError(f"round {round_.round_id} encodes {h!r}, which no request carries")
            items.append(item)
        needed = self.num_tokens + sum(item.length for item in items)
        if needed > self.capacity_tokens:
            raise InvalidArgumentError(
                f"round {round_.round_id} would fill the encoder cache to {needed} tokens; it holds "
                f"{self.capacity_tokens}"
            )
        started = time.perf_counter()
        encoded = self._encode(items)
        self.last_encode_seconds = time.perf_counter() - started
        for h, features in zip(todo, encoded, strict=True):
            self.features[h] = features
            self.num_tokens += features.shape[0]
        self.num_encoded += len(todo)

    def _encode(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode items in batches of equal pixel shape; features in item order."""
        out: list[torch.Tensor | None] = [None] * len(items)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, item in enumerate(items):
            by_shape.setdefault(item.shape, []).append(i)
        for shape, indices in by_shape.items():
            pixels = np.stack(
                [np.frombuffer(items[i].pixel_values, np.float32).reshape(shape) for i in indices]
            )
            features = self.model.encode_images(torch.from_numpy(pixels).to(self.device))
            for i, f in zip(indices, features, strict=True):
                if f.shape[0] != items[i].length:
                    raise InvalidArgumentError(
                        f"image {items[i].hash!r} has {items[i].length} placeholder tokens; the encoder "
                        f"produced {f.shape[0]}"
                    )
                out[i] = f
        return [f for f in out if f is not None]

    # ---- step 0 inputs ----

    def merge(
        self,
        input_ids: torch.Tensor,
        request_ids: Sequence[str],
        starts: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> torch.Tensor | None:
        """Token embeddings with image features over the placeholders this step computes.

        Row i computes positions [starts[i], starts[i] + num_scheduled[i]); its tokens sit at
        packed indices from the row's query start. None when no row touches an image.
        """
        token_index: list[np.ndarray] = []
        slices: list[torch.Tensor] = []
        query_start = 0
        for request_id, start, n in zip(request_ids, starts.tolist(), num_scheduled.tolist(), strict=True):
            end = start + n
            for item in self._items.get(request_id, ()):
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo >= hi:
                    continue
                features = self.features.get(item.hash)
                if features is None:
                    raise InvalidArgumentError(
                        f"request {request_id!r} computes image {item.hash!r} at [{lo}, {hi}), whose encoder "
                        f"output is not cached"
                    )
                token_index.append(np.arange(query_start + lo - start, query_start + hi - start))
                slices.append(features[lo - item.offset : hi - item.offset])
            query_start += n
        if not slices:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        index = torch.from_numpy(np.concatenate(token_index)).to(self.device)
        embeds[index] = torch.cat(slices).to(embeds.dtype)
        return embeds
