"""WorkerService over loopback gRPC: info, a two-round Execute stream, a malformed round's error."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.worker.__main__ import add_arguments, config_from_args
from services.worker.config import WorkerConfig
from services.worker.worker import Worker
from shared.execute import AbortRows, CachedRequestData, ExecuteRound, NewRequestData, PoolingRequestData
from shared.execute_wire import abort_to_proto, round_to_proto, step_from_proto, worker_info_from_proto
from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc
from shared.sampling import SamplingOptions
from shared.types import RequestKind
from tests.worker.grpc_worker import as_requests, serve_worker

PROMPT = [0, 17, 99, 250, 311, 45, 46, 47]


@pytest.fixture
async def stub(llama_dir: Path) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    worker = Worker(WorkerConfig(model=str(llama_dir), kv_cache_bytes=4 * 2**20, num_threads=2))
    async with serve_worker(worker) as worker_stub:
        yield worker_stub


async def test_worker_info_reports_model_and_kv_capacity(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    info = worker_info_from_proto(await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest()))
    # 4 MiB / (2 layers * 2 (K, V) * 16 tokens * 2 heads * 16 dims * 4 bytes) = 512 blocks
    assert (info.model_id, info.num_kv_blocks, info.block_size) == ("llama", 512, 16)
    assert (info.task, info.pooled_size) == (RequestKind.GENERATE, 0)
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (512, 1024, (1,))
    # auto on the CPU: the in-place paged kernels (built by `make install` or at worker start)
    assert (info.attention_backend, info.dtype, info.device) == ("paged", "float32", "cpu")


async def test_execute_stream_runs_rounds_in_order(
    stub: worker_pb2_grpc.WorkerServiceStub, llama_dir: Path
) -> None:
    greedy = SamplingOptions(temperature=0.0)
    rounds = [
        ExecuteRound(
            round_id=0,
            num_steps=2,
            new_requests=[NewRequestData("a", PROMPT, len(PROMPT), 0, [4], greedy)],
            num_scheduled_tokens=[len(PROMPT)],
        ),
        # pipelined decode: the worker feeds its own last token; 8 + 4 positions need a second block
        ExecuteRound(
            round_id=1, num_steps=2, cached_requests=CachedRequestData(["a"], [[9]]), num_scheduled_tokens=[1]
        ),
    ]
    steps = [step_from_proto(m) async for m in stub.Execute(as_requests(rounds))]
    assert [(s.round_id, s.step_index, s.is_last_step) for s in steps] == [
        (0, 0, False),
        (0, 1, True),
        (1, 0, False),
        (1, 1, True),
    ]
    assert all(s.request_ids == ["a"] for s in steps)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    expected = hf.generate(
        torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=3
    )[0, len(PROMPT) :].tolist()
    assert [t for s in steps for t in s.token_ids] == expected


async def test_an_abort_between_rounds_stops_the_row_before_the_next_round(
    stub: worker_pb2_grpc.WorkerServiceStub,
) -> None:
    """AbortRows goes around the round queue: sent behind round 0, it lands while round 0 runs (or
    before), so round 1, queued behind it, computes nothing for the aborted request: every entry
    of "b" there is a placeholder (logprob exactly 0), while "a" keeps sampling real tokens."""
    sampling = SamplingOptions(temperature=0.0, ignore_eos=True, logprobs=1)

    async def requests() -> AsyncIterator[worker_pb2.ExecuteRequest]:
        yield round_to_proto(ExecuteRound(
            round_id=0, num_steps=8, num_scheduled_tokens=[len(PROMPT)] * 2,
            new_requests=[NewRequestData(r, PROMPT, len(PROMPT), 0, blocks, sampling)
                          for r, blocks in (("a", [4, 9]), ("b", [5, 10]))]))
        yield abort_to_proto(AbortRows(["b"]))
        yield round_to_proto(ExecuteRound(
            round_id=1, num_steps=8, cached_requests=CachedRequestData(["a", "b"], [[], []]),
            num_scheduled_tokens=[1, 1]))

    steps = [step_from_proto(m) async for m in stub.Execute(requests())]
    assert [(s.round_id, s.step_index) for s in steps] == [(r, i) for r in (0, 1) for i in range(8)]
    assert all(s.request_ids == ["a", "b"] for s in steps)
    later = [s for s in steps if s.round_id == 1]
    assert all(s.logprobs[0] < 0 for s in later)
    assert all((s.token_ids[1], s.logprobs[1]) == (0, 0.0) for s in later)


async def test_malformed_round_aborts_stream_with_clear_status(
    stub: worker_pb2_grpc.WorkerServiceStub,
) -> None:
    greedy = SamplingOptions(temperature=0.0)
    rounds = [
        ExecuteRound(
            round_id=0,
            new_requests=[NewRequestData("a", PROMPT, len(PROMPT), 0, [0], greedy)],
            num_scheduled_tokens=[len(PROMPT)],
        ),
        ExecuteRound(round_id=1, cached_requests=CachedRequestData(["nope"], [[]]), num_scheduled_tokens=[1]),
        ExecuteRound(round_id=2, cached_requests=CachedRequestData(["a"], [[]]), num_scheduled_tokens=[1]),
    ]
    call = stub.Execute(as_requests(rounds))
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async with asyncio.timeout(20):
            async for msg in call:
                received.append(msg.round_id)
    assert received == [0]  # round 0 streamed; rounds 1 (bad) and 2 (after it) produce nothing
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "round 1 failed" in err.value.details() and "unknown request id 'nope'" in err.value.details()
    # The next stream starts from clean state and works.
    steps = [m async for m in stub.Execute(as_requests(rounds[:1]))]
    assert len(steps) == 1 and list(steps[0].request_ids) == ["a"]


async def test_generative_worker_rejects_pooling_rounds(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    rounds = [ExecuteRound(round_id=0, pooling_requests=[PoolingRequestData("e", RequestKind.EMBED, PROMPT)])]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Execute(as_requests(rounds)):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot run pooling requests" in err.value.details()


def test_flags_default_from_spindle_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_WORKER_LISTEN", "127.0.0.1:7777")
    monkeypatch.setenv("SPINDLE_MAX_MODEL_LEN", "128")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--model", "/m", "--dtype", "bfloat16"]))
    assert (config.listen, config.max_model_len, config.dtype, config.block_size) == (
        "127.0.0.1:7777",
        128,
        "bfloat16",
        16,
    )
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        WorkerConfig(model="/m", gpu_memory_fraction=1.5)


async def test_second_concurrent_stream_is_rejected(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    release = asyncio.Event()

    async def hold_open() -> AsyncIterator[worker_pb2.ExecuteRequest]:
        yield round_to_proto(ExecuteRound(round_id=0))  # an empty round: one empty step back
        await release.wait()

    first = stub.Execute(hold_open())
    assert (await first.read()).is_last_step  # the first stream is live
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async with asyncio.timeout(10):
            async for _ in stub.Execute(as_requests([ExecuteRound(round_id=0)])):
                pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "another Execute stream is active" in err.value.details()
    release.set()
    async with asyncio.timeout(10):
        assert await first.read() == grpc.aio.EOF


async def test_the_model_loads_on_the_thread_that_runs_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """One OpenMP team per process: loading on another thread than the rounds' made every
    parallel op of every step wait for a sleeping thread (round_pipeline.py)."""
    import threading
    from types import SimpleNamespace

    from services.worker import service as worker_main
    from services.worker.step_phases import StepPhases

    threads: dict[str, int] = {}

    class FakeWorker:
        def __init__(self, config: WorkerConfig) -> None:
            threads["load"] = threading.get_ident()
            self.runner, self.info = SimpleNamespace(phases=StepPhases()), None
            self.device = torch.device("cpu")

    pipelines: list[object] = []

    class SpyPipeline(worker_main.RoundPipeline):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            pipelines.append(self)

    async def run_a_round_then_stop(service: object) -> None:
        (pipeline,) = pipelines
        threads["round"] = await asyncio.get_running_loop().run_in_executor(pipeline.executor, threading.get_ident)

    monkeypatch.setattr(worker_main, "Worker", FakeWorker)
    monkeypatch.setattr(worker_main, "RoundPipeline", SpyPipeline)
    monkeypatch.setattr(worker_main, "wait_for_shutdown", run_a_round_then_stop)
    await worker_main.serve(WorkerConfig(model="/m", listen="127.0.0.1:0", step_port=-1))
    assert threads["load"] == threads["round"] != threading.get_ident()
