"""The embedding benchmark's sender, rows and plan against a mock /v1/embeddings server (no model).

The mock answers with vectors and usage it is told to, so every check the sender makes (token
count, number of vectors, cosine against the reference, base64) can be made to pass and to fail.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from aiohttp import web

from benchmarks import embed_bench
from benchmarks.embed_bench import SPINDLE, SPINDLE_BATCHED, EmbedContext, EmbedSettings, Job, plan
from benchmarks.embed_client import EmbeddingSender, cosine_rows, make_batches
from benchmarks.embed_report import ST, EmbedRow, format_table, ratio_to_st, row_from_load, rows_to_json
from benchmarks.load_client import LoadConfig, run_load
from tests.benchmarks.mock_http import serve_app

DIM = 4


@dataclass
class MockEmbeddings:
    """Vectors per text, the token count each text claims, and what was received."""

    vectors: dict[str, list[float]] = field(default_factory=dict)
    tokens_per_text: int = 3
    drop_one: bool = False
    bodies: list[dict[str, object]] = field(default_factory=list)


MOCK = web.AppKey("mock", MockEmbeddings)


async def _embeddings(request: web.Request) -> web.Response:
    mock = request.app[MOCK]
    body = await request.json()
    mock.bodies.append(body)
    texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
    if body["model"] != "m":
        return web.json_response({"error": {"message": "no such model"}}, status=404)
    if mock.drop_one:
        texts = texts[:-1]
    data = []
    for i, text in enumerate(texts):
        vector = mock.vectors[text]
        if body.get("encoding_format") == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    data.reverse()  # the sender must order by "index", not by position
    usage = {"prompt_tokens": mock.tokens_per_text * len(texts), "total_tokens": mock.tokens_per_text * len(texts)}
    return web.json_response({"object": "list", "data": data, "model": "m", "usage": usage})


@pytest.fixture
async def mock_server() -> AsyncIterator[tuple[str, MockEmbeddings]]:
    mock = MockEmbeddings()
    app = web.Application()
    app[MOCK] = mock
    app.router.add_post("/v1/embeddings", _embeddings)
    async with serve_app(app) as url:
        yield url, mock


SENTENCES = [f"sentence {i}" for i in range(5)]
REFERENCE = np.random.default_rng(0).normal(size=(5, DIM)).astype(np.float32)


def _serve_reference(mock: MockEmbeddings, scale: float = 2.0) -> None:
    # A positive scale keeps the direction: cosine 1 although the vectors differ.
    mock.vectors = {s: [float(x) * scale for x in REFERENCE[i]] for i, s in enumerate(SENTENCES)}


def test_make_batches_groups_in_order() -> None:
    batches = make_batches(SENTENCES, [1, 2, 3, 4, 5], 2)
    assert [b.indices for b in batches] == [(0, 1), (2, 3), (4,)]
    assert [b.texts for b in batches] == [tuple(SENTENCES[0:2]), tuple(SENTENCES[2:4]), (SENTENCES[4],)]
    assert [b.num_tokens for b in batches] == [3, 7, 5]
    with pytest.raises(ValueError, match="token counts"):
        make_batches(SENTENCES, [1], 2)
    with pytest.raises(ValueError, match="size"):
        make_batches(SENTENCES, [1] * 5, 0)


def test_cosine_rows() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0]])
    b = np.array([[2.0, 0.0], [-1.0, -1.0]])
    assert cosine_rows(a, b) == pytest.approx([1.0, -1.0])


@pytest.mark.parametrize(("encoding", "per_request"), [("float", 1), ("base64", 2)])
async def test_sender_checks_and_compares_with_reference(mock_server: tuple[str, MockEmbeddings], encoding: str,
                                                         per_request: int) -> None:
    url, mock = mock_server
    _serve_reference(mock)
    batches = make_batches(SENTENCES, [3] * 5, per_request)
    sender = EmbeddingSender(encoding_format=encoding, reference=REFERENCE)
    run = await run_load(LoadConfig(url, "m", concurrency=2, show_progress=False), batches, sender)

    assert run.summary.num_failed == 0, run.summary.errors
    assert len(sender.cosines) == 5 and sender.min_cosine == pytest.approx(1.0, abs=1e-6)
    assert run.summary.total_input_tokens == 15
    assert all(b["truncate"] is True and b["encoding_format"] == encoding for b in mock.bodies)
    assert isinstance(mock.bodies[0]["input"], str if per_request == 1 else list)
    row = row_from_load(SPINDLE, 2, per_request, batches, run, sender.min_cosine)
    assert row.num_embedded == 5 and row.total_tokens == 15
    assert row.sentences_per_s == pytest.approx(5 / run.summary.duration_s)


async def test_sender_reports_a_wrong_vector_through_cosine(mock_server: tuple[str, MockEmbeddings]) -> None:
    url, mock = mock_server
    _serve_reference(mock, scale=-1.0)
    sender = EmbeddingSender(reference=REFERENCE)
    await run_load(LoadConfig(url, "m", show_progress=False), make_batches(SENTENCES, [3] * 5, 5), sender)
    assert sender.min_cosine == pytest.approx(-1.0, abs=1e-6)


async def test_sender_fails_requests_with_other_tokens_or_vectors(mock_server: tuple[str, MockEmbeddings]) -> None:
    url, mock = mock_server
    _serve_reference(mock)
    config = LoadConfig(url, "m", concurrency=1, show_progress=False)
    batches = make_batches(SENTENCES, [4] * 5, 1)  # the mock counts 3 tokens per text
    run = await run_load(config, batches, EmbeddingSender())
    assert run.summary.num_failed == 5 and "tokens differ" in run.summary.errors[0]
    row = row_from_load(SPINDLE, 1, 1, batches, run, None)
    assert row.num_embedded == 0 and row.total_tokens == 0 and row.num_failed_requests == 5

    mock.drop_one = True
    run = await run_load(config, make_batches(SENTENCES, [3] * 5, 5), EmbeddingSender())
    assert run.summary.num_failed == 1 and "expected 5 embeddings, got 4" in run.summary.errors[0]

    run = await run_load(LoadConfig(url, "other", show_progress=False), batches[:1], EmbeddingSender())
    assert run.summary.errors[0].startswith("HTTP 404")


def test_rows_ratio_and_table() -> None:
    rows = [EmbedRow(ST, 32, 32, 100, 100, 2.0, 10_000),
            EmbedRow(SPINDLE, 8, 1, 100, 100, 4.0, 10_000, min_cosine=0.99999),
            EmbedRow(SPINDLE, 256, 1, 100, 0, 0.0, 0, error="AssertionError: exited")]
    assert rows[0].sentences_per_s == 50.0 and rows[1].tokens_per_s == 2500.0
    assert ratio_to_st(rows[1], rows) == pytest.approx(0.5)
    assert ratio_to_st(rows[0], rows) is None and ratio_to_st(rows[2], rows) is None
    assert ratio_to_st(rows[1], rows[1:]) is None  # no sentence-transformers row
    again = [*rows, EmbedRow(ST, 32, 32, 100, 100, 1.0, 10_000)]  # timed again at 100 sentences/s
    assert ratio_to_st(rows[1], again) == pytest.approx(25.0 / 75.0)  # to the mean of the two
    table = format_table(rows)
    assert "| spindle | 8 | 1 | 25.0 | 2,500 |  |  | 0.50 | 0.99999 |  |" in table
    assert "FAILED: AssertionError: exited" in table
    data = rows_to_json(rows)
    assert data[1]["ratio_vs_st"] == pytest.approx(0.5) and data[0]["latency_ms"] is None


def test_worker_busy_section_shows_phase_shares_and_idle() -> None:
    busy = {"prepare": 0.02, "encode": 0.0, "forward": 0.7, "pool": 0.005, "deliver": 0.001}
    rows = [EmbedRow(ST, 32, 32, 100, 100, 2.0, 10_000),
            EmbedRow(SPINDLE, 256, 1, 100, 100, 1.5, 10_000, worker_busy=busy)]
    table = format_table(rows)
    assert "| config | conc | prepare | forward | pool | deliver | idle |" in table  # phases never used left out
    assert "| spindle | 256 | 2.0% | 70.0% | 0.5% | 0.1% | 27.4% |" in table
    assert rows_to_json(rows)[1]["worker_busy"] == busy
    assert "step phase" not in format_table(rows[:1])  # nothing measured, no section


def test_cpu_section_shows_each_process_per_request() -> None:
    cpu = {"worker": 23.08, "frontend": 1.63, "load client": 1.06}
    rows = [EmbedRow(ST, 32, 32, 100, 100, 2.0, 10_000),
            EmbedRow(SPINDLE, 1, 1, 100, 100, 1.5, 10_000, cpu_ms_per_request=cpu)]
    table = format_table(rows)
    assert "| worker | frontend | load client |" in table
    assert f"| {SPINDLE} | 1 | 23.08 | 1.63 | 1.06 |" in table
    assert rows_to_json(rows)[1]["cpu_ms_per_request"] == cpu
    assert "CPU ms per request" not in format_table(rows[:1])  # nothing measured, no section


def test_plan_times_sentence_transformers_first_and_last() -> None:
    settings = EmbedSettings(model_dir="m", concurrencies=(1, 32), batch_size=16, batch_concurrencies=(2,),
                             configs=(SPINDLE_BATCHED, SPINDLE, ST))
    jobs = plan(settings)
    assert [(j.config, j.concurrency, j.sentences_per_request) for j in jobs] == [
        (ST, 16, 16), (SPINDLE, 1, 1), (SPINDLE, 32, 1), (SPINDLE_BATCHED, 2, 16), (ST, 16, 16)]
    alone = plan(EmbedSettings(model_dir="m", configs=(ST,)))
    assert [j.config for j in alone] == [ST]  # timed again only where spindle ran between
    with pytest.raises(ValueError, match="configs"):
        EmbedSettings(model_dir="m", configs=("infinity",))


class _FakeST:
    """encode() returns a constant per instance: which load's vectors became the reference."""

    def __init__(self, value: float) -> None:
        self.value = value

    def encode(self, sentences: list[str], **_: object) -> np.ndarray:
        return np.full((len(sentences), DIM), self.value, dtype=np.float32)


def test_later_sentence_transformers_runs_are_timed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    loads = iter([_FakeST(2.0), _FakeST(3.0)])
    monkeypatch.setattr(embed_bench, "_load_st", lambda _settings: next(loads))
    ctx = EmbedContext(EmbedSettings(model_dir="m"), "stem", ["a", "b"], [3, 4], ["w"] * 4, [2] * 4, 256,
                       st_model=_FakeST(1.0))
    job = Job(ST, 2, 2)
    first = embed_bench._run_st(job, ctx)
    assert ctx.st_model is None and ctx.reference is not None and ctx.reference[0, 0] == 1.0
    second = embed_bench._run_st(job, ctx)  # the model loaded again, its vectors not kept
    assert ctx.st_model is None and ctx.reference[0, 0] == 1.0 and next(loads).value == 3.0
    assert first.num_embedded == second.num_embedded == 2 and second.total_tokens == 7
