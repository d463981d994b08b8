"""Sending /v1/embeddings requests for the embedding benchmark, checking every answer as it comes.

A drop-in sender for `benchmarks.load_client.run_load` (which owns concurrency, timing and the
progress bar): it times one request and fails it, rather than counting it, when the server saw
other tokens than expected or returned the wrong number of vectors. With reference vectors it
also records each vector's cosine similarity to the reference (sentence-transformers').
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from benchmarks.load_client import LoadConfig
from benchmarks.metrics import RequestResult

ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbedBatch:
    """One /v1/embeddings request: which sentences (positions in the full list) and their token total.

    Attributes:
        indices: positions of `texts` in the benchmark's sentence list (rows of the reference).
        texts: the sentences sent.
        num_tokens: tokens the model must see for them (special tokens included, after truncation).
    """

    indices: tuple[int, ...]
    texts: tuple[str, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        if not self.texts or len(self.indices) != len(self.texts):
            raise ValueError(f"indices ({len(self.indices)}) and texts ({len(self.texts)}) must match and be non-empty")


def make_batches(sentences: Sequence[str], token_counts: Sequence[int], size: int) -> list[EmbedBatch]:
    """Consecutive groups of `size` sentences (the last may be shorter), in order."""
    if size < 1:
        raise ValueError(f"size={size} must be at least 1")
    if len(sentences) != len(token_counts):
        raise ValueError(f"{len(sentences)} sentences but {len(token_counts)} token counts")
    return [EmbedBatch(tuple(range(i, min(i + size, len(sentences)))), tuple(sentences[i:i + size]),
                       sum(token_counts[i:i + size])) for i in range(0, len(sentences), size)]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of `a` [n, d] with the same row of `b` [n, d]."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


def _decode(item: object, encoding_format: str) -> np.ndarray:
    embedding = item.get("embedding") if isinstance(item, dict) else None
    if encoding_format == "base64" and isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    if isinstance(embedding, list):
        return np.asarray(embedding, dtype=np.float32)
    raise ValueError(f"embedding is neither a float list nor base64: {type(embedding).__name__}")


@dataclass(slots=True)
class EmbeddingSender:
    """Sends one EmbedBatch per call (truncate=true) and checks the answer.

    Attributes:
        encoding_format: "float" (the OpenAI default) or "base64" (what the openai client asks for).
        reference: [num_sentences, dim] vectors to compare with, indexed by EmbedBatch.indices.
        cosines: one cosine per sentence answered so far (only with a reference).
    """

    encoding_format: str = "float"
    reference: np.ndarray | None = None
    cosines: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.encoding_format not in ENCODING_FORMATS:
            raise ValueError(f"encoding_format={self.encoding_format!r} is not one of {ENCODING_FORMATS}")

    @property
    def min_cosine(self) -> float | None:
        return min(self.cosines) if self.cosines else None

    def payload(self, batch: EmbedBatch, model: str) -> dict[str, object]:
        texts: str | list[str] = batch.texts[0] if len(batch.texts) == 1 else list(batch.texts)
        return {"model": model, "input": texts, "encoding_format": self.encoding_format, "truncate": True}

    async def __call__(self, session: aiohttp.ClientSession, config: LoadConfig, batch: EmbedBatch) -> RequestResult:
        """Never raises for server faults: they become the result's `error`."""
        result = RequestResult(prompt_len=batch.num_tokens, expected_output_tokens=0)
        start = time.perf_counter()
        try:
            async with session.post(config.url("embeddings"), json=self.payload(batch, config.model)) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return result
                body = await resp.json()
            result.e2e_s = time.perf_counter() - start
            result.error = self._check(batch, body)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # ValueError covers bad JSON
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    def _check(self, batch: EmbedBatch, body: dict[str, object]) -> str | None:
        """Why the answer is wrong, or None; records cosines against the reference."""
        data = body.get("data")
        usage = body.get("usage")
        if not isinstance(data, list) or len(data) != len(batch.texts):
            return f"expected {len(batch.texts)} embeddings, got {len(data) if isinstance(data, list) else data!r}"
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if prompt_tokens != batch.num_tokens:
            return f"server counted {prompt_tokens} prompt tokens, this client {batch.num_tokens}: tokens differ"
        ordered = sorted(data, key=lambda item: item.get("index", 0) if isinstance(item, dict) else 0)
        vectors = np.stack([_decode(item, self.encoding_format) for item in ordered])
        if self.reference is not None:
            reference = self.reference[list(batch.indices)]
            if vectors.shape != reference.shape:
                return f"embedding shape {vectors.shape} differs from the reference's {reference.shape}"
            self.cosines.extend(float(c) for c in cosine_rows(vectors, reference))
        return None
