"""Embeddings and cross-encoder scores through gRPC and HTTP against the fake scheduler."""

from __future__ import annotations

import json
import math
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
from openai import AsyncOpenAI

from services.frontend.openai_pooling import float32_json_array
from services.frontend.pooling import model_normalizes, rank
from services.frontend.server import Frontend
from shared.pb.spindle.v1 import common_pb2, generation_pb2_grpc
from shared.pb.spindle.v1 import generation_pb2 as pb
from shared.tiny_models import build_wordpiece_tokenizer
from tests.frontend.conftest import MODEL_NAME
from tests.frontend.fake_scheduler import FakeScheduler

EMBED, SCORE = common_pb2.REQUEST_KIND_EMBED, common_pb2.REQUEST_KIND_SCORE
embed_model = pytest.mark.parametrize("fake", [EMBED], indirect=True, ids=["embed-model"])
# An older scheduler (no `normalizes_embeddings`), as a rolling upgrade that reached the frontends first meets.
embed_model_old_scheduler = pytest.mark.parametrize("fake", [(EMBED, False)], indirect=True, ids=["old-scheduler"])
score_model = pytest.mark.parametrize("fake", [SCORE], indirect=True, ids=["score-model"])
Stub = generation_pb2_grpc.GenerationServiceStub


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> FakeScheduler:
    task, normalizes = request.param if isinstance(request.param, tuple) else (request.param, True)
    return FakeScheduler(task=task, normalizes_embeddings=normalizes)


@pytest.fixture(scope="session")
def wordpiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wordpiece")
    build_wordpiece_tokenizer(path)
    return path


@pytest.fixture
def tokenizer_dir(tokenizer_dir: Path, wordpiece_dir: Path, fake: FakeScheduler) -> Path:
    """Cross-encoders get a BERT-style tokenizer, whose pairs carry segment ids."""
    return wordpiece_dir if fake.task == SCORE else tokenizer_dir


def _expected_embedding(frontend: Frontend, text: str) -> list[float]:
    ids = frontend.tokenizer.hf.encode(text)
    return [float(len(ids)), float(sum(ids) % 97), 1.0]


def _expected_score(frontend: Frontend, query: str, document: str) -> float:
    """The fake's logit is (number of second-segment tokens - 3) / 2; the frontend applies a sigmoid."""
    type_ids = frontend.tokenizer.hf(query, document)["token_type_ids"]
    return 1 / (1 + math.exp(-(sum(type_ids) - 3) / 2))


def test_rank_sorts_and_cuts() -> None:
    assert rank([0.1, 0.9, 0.5], sort=True, top_n=2) == [(1, 0.9), (2, 0.5)]
    assert rank([0.1, 0.9, 0.5], sort=False, top_n=2) == [(1, 0.9), (2, 0.5)]
    assert rank([0.5, 0.9, 0.1], sort=False, top_n=2) == [(0, 0.5), (1, 0.9)]
    assert rank([0.1, 0.9], sort=False, top_n=0) == [(0, 0.1), (1, 0.9)]


def test_normalize_follows_sentence_transformers_modules(tmp_path: Path) -> None:
    assert not model_normalizes(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Pooling"},
                                                       {"type": "sentence_transformers.models.Normalize"}]))
    assert model_normalizes(tmp_path)


@embed_model
async def test_grpc_embed_batches_inputs_and_asks_the_worker_to_normalize(stub: Stub, fake: FakeScheduler,
                                                                          frontend: Frontend) -> None:
    texts = ["hello world", "数据 模型", "x"]
    response = await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=texts))
    assert [list(e.values) for e in response.embeddings] == [_expected_embedding(frontend, t) for t in texts]
    assert fake.add_batches == [3]
    assert response.usage.prompt_tokens == sum(len(frontend.tokenizer.hf.encode(t)) for t in texts)
    assert [a.normalize for a in fake.added] == [False] * 3  # this model's pipeline has no Normalize module
    # Asked for, each input's scheduler request carries it; the vectors are passed on as they come
    # (the worker normalises: tests/worker/test_pooling.py, and against sentence-transformers in
    # tests/e2e/test_pooling_models.py).
    normalized = await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=texts, normalize=True))
    assert [a.normalize for a in fake.added[3:]] == [True] * 3
    assert [list(e.values) for e in normalized.embeddings] == [_expected_embedding(frontend, t) for t in texts]
    frontend.pooling.normalize_default = True  # a model whose pipeline ends in Normalize
    await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=texts[:1]))
    await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=texts[:1], normalize=False))
    assert [a.normalize for a in fake.added[6:]] == [True, False]


@embed_model_old_scheduler
async def test_behind_an_older_scheduler_the_frontend_normalizes(stub: Stub, fake: FakeScheduler,
                                                                 frontend: Frontend) -> None:
    texts = ["hello world", "x"]
    plain = await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=texts))
    assert [list(e.values) for e in plain.embeddings] == [_expected_embedding(frontend, t) for t in texts]
    normalized = await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=texts, normalize=True))
    for emb, text in zip(normalized.embeddings, texts, strict=True):
        want = _expected_embedding(frontend, text)
        norm = math.sqrt(sum(v * v for v in want))
        assert list(emb.values) == pytest.approx([v / norm for v in want], rel=1e-6)
    assert not any(a.normalize for a in fake.added)  # not asked of a scheduler that would drop it


@embed_model
async def test_embed_input_checks(stub: Stub, frontend: Frontend) -> None:
    for request, message in [
        (pb.EmbedRequest(model=MODEL_NAME), "input is empty"),
        (pb.EmbedRequest(model=MODEL_NAME, inputs=["ok", ""]), "input[1] is an empty string"),
        (pb.EmbedRequest(model=MODEL_NAME, inputs=["word " * 200]), "more than the model's limit of 128 tokens"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Embed(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
    truncated = await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=["word " * 200], truncate=True))
    assert truncated.embeddings[0].values[0] == 128.0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Embed(pb.EmbedRequest(model="nope", inputs=["x"]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@embed_model
async def test_openai_embeddings_base64_and_float(frontend: Frontend, fake: FakeScheduler) -> None:
    url = f"http://{frontend.http_address}/v1"
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    try:
        # The openai client asks for base64 and decodes it itself.
        result = await client.embeddings.create(model=MODEL_NAME, input=["hello", "world 🙂"])
        assert [d.embedding for d in result.data] == [_expected_embedding(frontend, t) for t in ["hello", "world 🙂"]]
        assert [d.index for d in result.data] == [0, 1]
        floats = await client.embeddings.create(model=MODEL_NAME, input=[0, 40, 41], encoding_format="float")
        assert floats.data[0].embedding == [3.0, 81.0 % 97, 1.0]
        assert floats.usage.prompt_tokens == 3
    finally:
        await client.close()
    async with aiohttp.ClientSession() as session:
        for normalize in (True, False):  # spindle's own field, as vLLM's API has it: to the worker
            async with session.post(url + "/embeddings", json={"input": "hi", "normalize": normalize}) as resp:
                assert resp.status == 200
            assert fake.added[-1].normalize is normalize
        for body, message in [({"input": []}, "input is empty"), ({"input": "hi", "encoding_format": "hex"}, "hex"),
                              ({"input": {"a": 1}}, "input must be"), ({"input": [[5, 9999]]}, "input[0][1]=9999")]:
            async with session.post(url + "/embeddings", json=body) as resp:
                assert resp.status == 400
                assert message in (await resp.json())["error"]["message"]
        async with session.post(url + "/completions", json={"prompt": "hi"}) as resp:
            assert resp.status == 400
            assert "does not support text generation" in (await resp.json())["error"]["message"]


@score_model
async def test_grpc_score_sorts_and_cuts(stub: Stub, frontend: Frontend, fake: FakeScheduler) -> None:
    query, documents = "which fox", ["a", "the quick brown fox jumps", "hello world"]
    want = [_expected_score(frontend, query, d) for d in documents]
    response = await stub.Score(pb.ScoreRequest(model=MODEL_NAME, query=query, documents=documents))
    assert [s.index for s in response.scores] == [0, 1, 2]
    assert [s.score for s in response.scores] == pytest.approx(want)
    assert len(set(want)) == 3
    best = await stub.Score(pb.ScoreRequest(model=MODEL_NAME, query=query, documents=documents, sort=True, top_n=2))
    assert [s.index for s in best.scores] == sorted(range(3), key=lambda i: -want[i])[:2]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Score(pb.ScoreRequest(model=MODEL_NAME, query=query))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=["x"]))
    assert "does not support embeddings" in (info.value.details() or "")
    assert fake.added and not any(a.normalize for a in fake.added)  # a score's logit is never normalised


@score_model
async def test_http_score_and_rerank(frontend: Frontend) -> None:
    url = f"http://{frontend.http_address}/v1"
    query, documents = "which fox", ["a", "the quick brown fox jumps", "hello world"]
    want = [_expected_score(frontend, query, d) for d in documents]
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/score", json={"model": MODEL_NAME, "text_1": query, "text_2": documents}) as r:
            assert r.status == 200
            body = await r.json()
        assert [d["score"] for d in body["data"]] == pytest.approx(want)
        async with session.post(url + "/rerank", json={"query": query, "documents": documents, "top_n": 2}) as r:
            assert r.status == 200
            results = (await r.json())["results"]
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in results] == order
        assert [x["document"]["text"] for x in results] == [documents[i] for i in order]
        for path, body, message in [("/rerank", {"query": query, "documents": []}, "documents is empty"),
                                    ("/rerank", {"documents": ["a"]}, "query is required"),
                                    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2")]:
            async with session.post(url + path, json=body) as r:
                assert r.status == 400
                assert message in (await r.json())["error"]["message"]


def test_float_embeddings_are_written_short_and_read_back_as_the_same_float32_values() -> None:
    rng = np.random.default_rng(0)
    vector = np.concatenate([rng.standard_normal(380), [1e-38, -3.4e38, 0.0, 1.0]]).astype(np.float32)
    text = float32_json_array([float(v) for v in vector])
    assert np.array_equal(np.array(json.loads(text), dtype=np.float32), vector)  # every value exactly
    assert len(text) < len(json.dumps([float(v) for v in vector]))
    # JSON has no spelling for these: json's own (as json.dumps wrote the whole response before).
    assert float32_json_array([1.0, math.nan, math.inf]) == "[1.0, NaN, Infinity]"
