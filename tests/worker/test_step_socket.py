"""The worker's step socket over loopback with a real model: Execute's stream without gRPC.

The scheduler's own client (`stream_steps`, `WorkerClient`) drives it, so both ends are the
shipped code. Each step must leave from the compute thread (the point of the socket), errors
must end the stream with Execute's status, and nothing a peer does may stop the worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.scheduler.step_stream import STREAM_CLOSED, Outgoing, stream_steps
from services.scheduler.worker_client import WorkerClient
from services.worker.config import WorkerConfig
from services.worker.round_pipeline import RoundPipeline
from services.worker.step_socket import StepSender, StepSocket
from services.worker.worker import Worker
from shared.execute import AbortRows, CachedRequestData, ExecuteRound, NewRequestData, StepOutput
from shared.execute_wire import execute_request_to_proto
from shared.ports import free_port
from shared.sampling import SamplingOptions
from shared.step_frames import END, HEADER, REQUEST, frame, parse_end
from shared.step_listener import local_sockets_supported
from tests.worker.grpc_worker import worker_service

PROMPT = [0, 17, 99, 250, 311, 45, 46, 47]
GREEDY = SamplingOptions(temperature=0.0)


@pytest.fixture
def worker(llama_dir: Path) -> Worker:
    return Worker(WorkerConfig(model=str(llama_dir), kv_cache_bytes=4 * 2**20, num_threads=2))


@pytest.fixture(params=[{}])
async def port(worker: Worker, request: pytest.FixtureRequest) -> AsyncIterator[int]:
    """The step socket's port; parametrize indirectly with StepSocket's keyword arguments."""
    pipeline = RoundPipeline(worker.runner)
    step_socket = StepSocket(pipeline, **request.param)
    try:
        yield await step_socket.start("127.0.0.1", 0)
    finally:
        step_socket.close()
        pipeline.close()


QUICK_HEARTBEATS = {"heartbeat_s": 0.05, "silence_timeout_s": 0.5}


@pytest.fixture
def sending_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that wrote step frames."""
    names: list[str] = []
    real = StepSender.send_step

    def spy(self: StepSender, step: StepOutput) -> None:
        names.append(threading.current_thread().name)
        real(self, step)

    monkeypatch.setattr(StepSender, "send_step", spy)
    return names


async def run_stream(port: int, items: list[ExecuteRound | AbortRows]) -> tuple[list[StepOutput], str]:
    """Send `items`, end the scheduler's side; the steps that came back and why the stream ended."""
    outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
    for item in [*items, None]:
        outbox.put_nowait(item)
    steps: list[StepOutput] = []
    async with asyncio.timeout(60):
        why = await stream_steps("127.0.0.1", port, outbox, steps.append)
    return steps, why


def two_rounds() -> list[ExecuteRound | AbortRows]:
    return [
        ExecuteRound(round_id=0, num_steps=2, new_requests=[NewRequestData("a", PROMPT, len(PROMPT), 0, [4], GREEDY)],
                     num_scheduled_tokens=[len(PROMPT)]),
        ExecuteRound(round_id=1, num_steps=2, cached_requests=CachedRequestData(["a"], [[9]]),
                     num_scheduled_tokens=[1]),
    ]


async def test_rounds_stream_from_the_compute_thread_and_match_transformers(
    port: int, llama_dir: Path, sending_threads: list[str]
) -> None:
    steps, why = await run_stream(port, two_rounds())
    assert why == STREAM_CLOSED
    assert [(s.round_id, s.step_index, s.is_last_step) for s in steps] == [
        (0, 0, False), (0, 1, True), (1, 0, False), (1, 1, True)]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                           pad_token_id=3)[0, len(PROMPT):].tolist()
    assert [t for s in steps for t in s.token_ids] == expected
    assert sending_threads and all(name.startswith("spindle-compute") for name in sending_threads)


async def test_an_abort_reaches_the_round_in_flight(port: int) -> None:
    sampling = SamplingOptions(temperature=0.0, ignore_eos=True, logprobs=1)
    items: list[ExecuteRound | AbortRows] = [
        ExecuteRound(round_id=0, num_steps=8, num_scheduled_tokens=[len(PROMPT)] * 2,
                     new_requests=[NewRequestData(r, PROMPT, len(PROMPT), 0, blocks, sampling)
                                   for r, blocks in (("a", [4, 9]), ("b", [5, 10]))]),
        AbortRows(["b"]),
        ExecuteRound(round_id=1, num_steps=8, cached_requests=CachedRequestData(["a", "b"], [[], []]),
                     num_scheduled_tokens=[1, 1]),
    ]
    steps, why = await run_stream(port, items)
    assert why == STREAM_CLOSED
    later = [s for s in steps if s.round_id == 1]
    assert len(later) == 8 and all((s.token_ids[1], s.logprobs[1]) == (0, 0.0) for s in later)
    assert all(s.logprobs[0] < 0 for s in later)


async def test_a_failed_round_ends_the_stream_with_its_status_after_the_steps_before_it(port: int) -> None:
    rounds: list[ExecuteRound | AbortRows] = [
        ExecuteRound(round_id=0, new_requests=[NewRequestData("a", PROMPT, len(PROMPT), 0, [0], GREEDY)],
                     num_scheduled_tokens=[len(PROMPT)]),
        ExecuteRound(round_id=1, cached_requests=CachedRequestData(["nope"], [[]]), num_scheduled_tokens=[1]),
        ExecuteRound(round_id=2, cached_requests=CachedRequestData(["a"], [[]]), num_scheduled_tokens=[1]),
    ]
    steps, why = await run_stream(port, rounds)
    assert [s.round_id for s in steps] == [0]
    assert why.startswith("Execute stream broke (INVALID_ARGUMENT: round 1 failed")
    assert "unknown request id 'nope'" in why
    steps, why = await run_stream(port, rounds[:1])  # the next stream starts from clean state
    assert (why, [s.request_ids for s in steps]) == (STREAM_CLOSED, [["a"]])


async def _raw_exchange(port: int, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes, return the first frame the worker answers with."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        async with asyncio.timeout(20):
            size, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
            return kind, await reader.readexactly(size)
    finally:
        writer.close()


@pytest.mark.parametrize("data", [
    frame(7, b"hello"),  # a kind the worker does not take
    frame(REQUEST, b"\xff\xff\xff"),  # not an ExecuteRequest
    HEADER.pack(2**31, REQUEST),  # over the size limit
])
async def test_an_unreadable_frame_ends_that_stream_only(port: int, data: bytes) -> None:
    kind, payload = await _raw_exchange(port, data)
    code, message = parse_end(payload)
    assert (kind, code.name) == (END, "INVALID_ARGUMENT")
    assert message.startswith("unreadable frame")
    steps, why = await run_stream(port, two_rounds()[:1])  # the worker still serves
    assert (why, len(steps)) == (STREAM_CLOSED, 2)


async def test_a_second_stream_is_refused_while_one_runs(port: int) -> None:
    outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
    outbox.put_nowait(ExecuteRound(round_id=0))  # an empty round: one empty step back
    first_steps: list[StepOutput] = []
    first = asyncio.create_task(stream_steps("127.0.0.1", port, outbox, first_steps.append))
    async with asyncio.timeout(20):
        while not first_steps:
            await asyncio.sleep(0.01)
    steps, why = await run_stream(port, [ExecuteRound(round_id=0)])
    assert steps == []
    assert why == "Execute stream broke (UNAVAILABLE: another Execute stream is active on this worker)"
    outbox.put_nowait(None)
    async with asyncio.timeout(20):
        assert await first == STREAM_CLOSED


async def test_a_peer_that_leaves_mid_round_frees_the_worker(port: int) -> None:
    sampling = SamplingOptions(temperature=0.0, ignore_eos=True)
    long_round = ExecuteRound(round_id=0, num_steps=200, num_scheduled_tokens=[len(PROMPT)],
                              new_requests=[NewRequestData("a", PROMPT, len(PROMPT), 0, list(range(16)), sampling)])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(REQUEST, execute_request_to_proto(long_round).SerializeToString()))
    async with asyncio.timeout(20):
        await reader.readexactly(HEADER.size)  # the first step is out: the round is computing
    writer.transport.abort()  # gone without a goodbye (RST)
    async with asyncio.timeout(30):
        while True:  # the abandoned stream ends once the compute thread's next write fails
            steps, why = await run_stream(port, two_rounds()[:1])
            if why == STREAM_CLOSED:
                break
            assert "another Execute stream is active" in why
            await asyncio.sleep(0.05)
    assert len(steps) == 2


async def _run_client(address: str, use_socket: bool, offered_port: int | None = None, local: bool = True,
                      ) -> tuple[list[StepOutput], list[str]]:
    """Two rounds through a WorkerClient, then the end of its stream: (steps, failures reported).
    `offered_port`: the step socket's port as if the worker had offered that one instead (and no
    local socket); `local=False`: as if the worker had offered no local socket."""
    client = WorkerClient(0, address, step_socket=use_socket)
    assert (await client.wait_ready()).step_port > 0
    if offered_port is not None:
        client._step_port = offered_port
    if offered_port is not None or not local:
        client._step_local_socket = ""
    outputs: list[StepOutput] = []
    failures: list[str] = []
    done = asyncio.Event()

    def on_failure(index: int, why: str) -> None:
        failures.append(why)
        done.set()

    client.open(lambda index, step: outputs.append(step), on_failure)
    for item in two_rounds():
        client.send(item)
    client._outbox.put_nowait(None)  # end the stream as reset() does, to see it close
    async with asyncio.timeout(60):
        await done.wait()
    await client.close()
    return outputs, failures


async def test_the_scheduler_client_takes_the_step_socket_the_worker_offers(
    worker: Worker, sending_threads: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """WorkerClient reads the port and the local socket's name from GetWorkerInfo and streams on the
    local socket, on the port where no name is offered; `step_socket=False` keeps gRPC."""
    async with worker_service(worker, step_socket=True) as address:
        for use_socket, local in ((True, True), (True, False), (False, True)):
            sending_threads.clear()
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="shared.step_dial"):
                outputs, failures = await _run_client(address, use_socket, local=local)
            assert failures == [STREAM_CLOSED]
            assert [(s.round_id, s.step_index) for s in outputs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
            assert bool(sending_threads) == use_socket
            assert ("runs on its local socket" in caplog.text) == (use_socket and local and local_sockets_supported())


@pytest.mark.parametrize("port", [QUICK_HEARTBEATS], indirect=True)
async def test_a_scheduler_that_goes_silent_lets_go_of_the_worker(port: int) -> None:
    """It sent a round and then nothing, not even heartbeats, without closing: after the silence
    timeout the worker ends that stream, so the next scheduler's stream is not refused."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(REQUEST, execute_request_to_proto(ExecuteRound(round_id=0)).SerializeToString()))
    async with asyncio.timeout(10):
        while (await reader.read(4096)) != b"":  # its step, the worker's heartbeats, then the end
            pass
    writer.close()
    steps, why = await run_stream(port, two_rounds()[:1])
    assert (why, len(steps)) == (STREAM_CLOSED, 2)


@pytest.mark.parametrize("port", [QUICK_HEARTBEATS], indirect=True)
async def test_an_idle_scheduler_keeps_its_stream_with_heartbeats(port: int) -> None:
    outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
    steps: list[StepOutput] = []
    stream = asyncio.create_task(stream_steps("127.0.0.1", port, outbox, steps.append,
                                              heartbeat_s=0.05, silence_timeout_s=0.5))
    rounds = two_rounds()
    outbox.put_nowait(rounds[0])
    await asyncio.sleep(1.2)  # idle for over twice the silence timeout
    outbox.put_nowait(rounds[1])
    outbox.put_nowait(None)
    async with asyncio.timeout(20):
        assert await stream == STREAM_CLOSED
    assert [(s.round_id, s.step_index) for s in steps] == [(0, 0), (0, 1), (1, 0), (1, 1)]


async def test_a_step_socket_out_of_reach_leaves_the_stream_on_grpc(
    worker: Worker, sending_threads: list[str]
) -> None:
    """Offered but unreachable (a firewall letting only the gRPC port through): the stream runs on gRPC."""
    async with worker_service(worker, step_socket=True) as address:
        outputs, failures = await _run_client(address, use_socket=True, offered_port=free_port())
    assert failures == [STREAM_CLOSED]
    assert [(s.round_id, s.step_index) for s in outputs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sending_threads == []



async def test_a_step_socket_that_drops_every_connection_sends_the_streams_over_grpc(
    worker: Worker, sending_threads: list[str]
) -> None:
    """Offered, taking connections and dropping them (a proxy that cannot route the port): after three
    streams that never heard the worker, the scheduler's client streams over gRPC, and the rounds run."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    dropper = await asyncio.start_server(drop, "127.0.0.1", 0)
    failures: list[str] = []
    try:
        async with worker_service(worker, step_socket=True) as address:
            client = WorkerClient(0, address)
            await client.wait_ready()
            client._step_port = dropper.sockets[0].getsockname()[1]
            client._step_local_socket = ""  # (the worker's own would answer)
            for _ in range(4):
                outputs: list[StepOutput] = []
                done = asyncio.Event()

                def on_failure(index: int, why: str, done: asyncio.Event = done) -> None:
                    failures.append(why)
                    done.set()

                client.open(lambda index, step, outputs=outputs: outputs.append(step), on_failure)
                for item in two_rounds():
                    client.send(item)
                client._outbox.put_nowait(None)
                async with asyncio.timeout(60):
                    await done.wait()
                await client.reset()
            await client.close()
    finally:
        dropper.close()
    assert failures == ["the worker closed its step socket without ending the stream"] * 3 + [STREAM_CLOSED]
    assert [(s.round_id, s.step_index) for s in outputs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sending_threads == []
