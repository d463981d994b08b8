"""Prefill-only workers: task detection and WorkerInfo, round validation, and pooled outputs over gRPC."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.worker.config import WorkerConfig
from services.worker.step_output import PooledStep
from services.worker.worker import Worker
from shared.errors import InvalidArgumentError
from shared.execute import ExecuteRound, NewRequestData, PoolingRequestData, StepOutput
from shared.execute_wire import step_from_proto, worker_info_from_proto
from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc
from shared.sampling import SamplingOptions
from shared.types import RequestKind
from tests.worker.grpc_worker import as_requests, serve_worker

CLS, SEP = 101, 102  # MiniLM's [CLS] / [SEP]


def _embed(request_id: str, n: int) -> PoolingRequestData:
    return PoolingRequestData(request_id, RequestKind.EMBED, [CLS] + [2000 + i for i in range(n - 2)] + [SEP])


@pytest.fixture(scope="module")
def minilm_worker(minilm_dir: Path) -> Worker:
    return Worker(WorkerConfig(model=str(minilm_dir), num_threads=2))


def _run(worker: Worker, round_: ExecuteRound) -> list[StepOutput]:
    steps: list[PooledStep] = []
    worker.runner.execute_round(round_, steps.append)
    return [s.to_step_output() for s in steps]


def test_embedding_model_info_follows_sentence_transformers_config(minilm_worker: Worker) -> None:
    info = minilm_worker.info
    assert (info.task, info.pooled_size, info.vocab_size) == (RequestKind.EMBED, 384, 30522)
    assert info.max_model_len == 256  # sentence_bert_config.json max_seq_length (positions: 512)
    assert (info.block_size, info.num_kv_blocks, info.eos_token_ids) == (0, 0, ())


def test_cross_encoder_info_and_max_model_len_flag(cross_encoder_dir: Path, minilm_dir: Path) -> None:
    info = Worker(WorkerConfig(model=str(cross_encoder_dir), num_threads=2)).info
    assert (info.task, info.pooled_size, info.vocab_size, info.max_model_len) == (RequestKind.SCORE, 1, 1024, 512)
    assert Worker(WorkerConfig(model=str(minilm_dir), max_model_len=400)).info.max_model_len == 400  # flag wins
    with pytest.raises(ValueError, match="max_model_len=600 exceeds the model's 512 positions"):
        Worker(WorkerConfig(model=str(minilm_dir), max_model_len=600))


def test_sentence_transformers_dir_with_an_mlm_head_serves_embeddings(tmp_path: Path, minilm_dir: Path) -> None:
    for item in minilm_dir.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item)
    config = json.loads((minilm_dir / "config.json").read_text()) | {"architectures": ["BertForMaskedLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert Worker(WorkerConfig(model=str(tmp_path))).info.task is RequestKind.EMBED
    (tmp_path / "modules.json").unlink()  # without sentence-transformers files: an unsupported head
    with pytest.raises(ValueError, match="unsupported architecture 'BertForMaskedLM'"):
        Worker(WorkerConfig(model=str(tmp_path)))


def test_multi_step_and_empty_rounds_keep_the_step_protocol(minilm_worker: Worker) -> None:
    steps = _run(minilm_worker, ExecuteRound(7, num_steps=3, pooling_requests=[_embed("a", 5), _embed("b", 3)]))
    assert [(s.round_id, s.step_index, s.is_last_step) for s in steps] == [(7, 0, False), (7, 1, False), (7, 2, True)]
    assert list(steps[0].pooled) == ["a", "b"] and len(steps[0].pooled["a"]) == 384
    assert not steps[1].pooled and not steps[2].pooled
    empty = _run(minilm_worker, ExecuteRound(8, finished_request_ids=["a", "b"]))
    assert [(s.step_index, s.is_last_step, s.pooled) for s in empty] == [(0, True, {})]


def _alone_and_in_a_batch(worker: Worker) -> tuple[list[float], list[float]]:
    alone = _run(worker, ExecuteRound(0, pooling_requests=[_embed("x", 9)]))[0].pooled["x"]
    batch = [_embed("a", 30), _embed("x", 9), _embed("b", 2)]
    return alone, _run(worker, ExecuteRound(1, pooling_requests=batch))[0].pooled["x"]


def test_same_input_pools_the_same_alone_or_in_a_batch(minilm_dir: Path) -> None:
    """With float32 GEMMs, packing sentences into one round changes nothing: bit-identical vectors."""
    alone, together = _alone_and_in_a_batch(Worker(WorkerConfig(model=str(minilm_dir), num_threads=2,
                                                                 encoder_matmul="float32")))
    assert together == alone


def test_bf16_gemms_pool_alike_alone_or_in_a_batch(minilm_worker: Worker) -> None:
    """The default on a CPU with bf16 math rounds the GEMMs' inputs to bf16. oneDNN's AMX kernels
    sum in an order that depends on the row count (seen on a 2-core Xeon with AMX, 2026-12-01:
    up to 2e-3 apart, cosine 0.999994; none on AVX512-BF16 alone), so a sentence's vector may move
    by a bf16 rounding with its batch-mates, never by more: another sentence leaking into it would
    move it far more."""
    alone, together = _alone_and_in_a_batch(minilm_worker)
    a, b = np.asarray(alone), np.asarray(together)
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.99999
    assert np.abs(a - b).max() < 5e-3


def test_pooled_rounds_fill_their_step_phases(minilm_worker: Worker) -> None:
    phases = minilm_worker.runner.phases
    before = dict(phases.totals)
    start = time.perf_counter()
    _run(minilm_worker, ExecuteRound(3, num_steps=2, pooling_requests=[_embed("a", 40), _embed("b", 7)]))
    wall = time.perf_counter() - start
    spent = {p: phases.totals[p] - before[p] for p in phases.totals}
    assert all(spent[p] > 0 for p in ("prepare", "forward", "pool", "deliver")), spent
    assert spent["encode"] == spent["logits"] == spent["sample"] == 0.0  # a decoder's phases
    assert sum(spent.values()) <= wall


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (PoolingRequestData("s", RequestKind.SCORE, [CLS, SEP]), "request 's' is SCORE; this worker serves EMBED"),
        (PoolingRequestData("e", RequestKind.EMBED, []), "has 0 tokens; must be 1..256"),
        (_embed("long", 257), "has 257 tokens; must be 1..256"),
        (PoolingRequestData("v", RequestKind.EMBED, [CLS, 30522, SEP]), "token id is outside \\[0, 30522\\)"),
        (PoolingRequestData("t", RequestKind.EMBED, [CLS, SEP], [0, 2]), "token type id is outside \\[0, 2\\)"),
        (PoolingRequestData("n", RequestKind.EMBED, [CLS, SEP], [0]), "1 token_type_ids for 2 tokens"),
    ],
)
def test_bad_pooling_requests_are_invalid_arguments(
    minilm_worker: Worker, request_: PoolingRequestData, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        _run(minilm_worker, ExecuteRound(0, pooling_requests=[_embed("ok", 4), request_]))


def test_pooling_worker_rejects_generate_requests_and_duplicates(minilm_worker: Worker) -> None:
    generate = NewRequestData("g", [CLS, SEP], 2, 0, [0], SamplingOptions())
    with pytest.raises(InvalidArgumentError, match=r"serves EMBED requests \(a prefill-only model\); it cannot"):
        _run(minilm_worker, ExecuteRound(0, new_requests=[generate], num_scheduled_tokens=[2]))
    with pytest.raises(InvalidArgumentError, match="lists a pooling request twice"):
        _run(minilm_worker, ExecuteRound(0, pooling_requests=[_embed("d", 3), _embed("d", 4)]))


@pytest.fixture
async def pooling_stub(minilm_worker: Worker) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with serve_worker(minilm_worker) as stub:
        yield stub


async def test_servicer_streams_pooled_outputs(
    pooling_stub: worker_pb2_grpc.WorkerServiceStub, minilm_worker: Worker
) -> None:
    info = worker_info_from_proto(await pooling_stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest()))
    assert info == minilm_worker.info
    rounds = [
        ExecuteRound(0, pooling_requests=[_embed("a", 6), _embed("b", 12)]),
        ExecuteRound(1, pooling_requests=[_embed("c", 3)], finished_request_ids=["a", "b"]),
    ]
    steps = [step_from_proto(m) async for m in pooling_stub.Execute(as_requests(rounds))]
    assert [(s.round_id, s.is_last_step, list(s.pooled)) for s in steps] == [(0, True, ["a", "b"]), (1, True, ["c"])]
    direct = _run(minilm_worker, rounds[0])[0].pooled
    assert steps[0].pooled["b"] == pytest.approx(direct["b"], abs=1e-6)  # float32 on the wire


async def test_servicer_rejects_generate_rounds_on_a_pooling_worker(
    pooling_stub: worker_pb2_grpc.WorkerServiceStub,
) -> None:
    generate = NewRequestData("g", [CLS, SEP], 2, 0, [0], SamplingOptions())
    rounds = [ExecuteRound(0, new_requests=[generate], num_scheduled_tokens=[2])]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in pooling_stub.Execute(as_requests(rounds)):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot run generate requests" in err.value.details()
