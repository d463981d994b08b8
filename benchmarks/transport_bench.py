"""CPU per message of one service-to-service stream, by transport: what a hop costs each side.

Why: at one stream of a small model the worker's step is ~0.4 ms in process and ~0.7 ms served,
and the difference is mostly host work around each step's message (README, "What stands in the
way of the one-stream goals"). This measures the floor under that, away from the model: one
sender streams `--messages` step messages (a worker's `ExecuteResponse` of `--rows` tokens) to
one receiver over loopback, `--pace-ms` apart (a decode step's spacing; 0: back to back), each
side in a process of its own on uvloop, as the services run, and each reports its CPU time
(user and system, every thread, from getrusage) per message:

  grpc                the services' transport as they run it: a gRPC aio bidirectional stream
                      (WorkerService.Execute, the sender as the server, like the worker), sockets
                      polled in gRPC's poller thread (shared/grpc_io.py)
  grpc-event-engine   the same on gRPC's default EventEngine I/O threads
                      (SPINDLE_GRPC_EVENT_ENGINE=1)
  stream              the step socket's frames (shared/step_frames.py) on a plain asyncio (uvloop)
                      TCP stream, written by the event loop: no gRPC
  step-socket         the step socket as the services run it: the worker's `StepSender` writes each
                      frame with a blocking send from a thread of its own (as the compute thread
                      does), the receiver reads frames as the scheduler does
  step-socket-local   the same on the step socket's local Unix socket (shared/step_listener.py), as
                      co-located services dial it

The sender's figure includes the pacing timer (the event loop's; step-socket's thread sleeps). Each cell is a
fresh pair of processes; run the command twice to see the host's noise.

    python -m benchmarks.transport_bench
    python -m benchmarks.transport_bench --pace-ms 0.7 --rows 64 --messages 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

from benchmarks.cli_args import comma_list
from shared.grpc_io import LEGACY_POLLING_EXPERIMENTS
from shared.step_listener import serve_local

TRANSPORTS = ("grpc", "grpc-event-engine", "stream", "step-socket", "step-socket-local")
# GRPC_EXPERIMENTS of each child (None: unset), fixed before it imports grpc: gRPC reads its
# experiments once, at start-up.
TRANSPORT_EXPERIMENTS = {"grpc": LEGACY_POLLING_EXPERIMENTS, "grpc-event-engine": None, "stream": None,
                         "step-socket": None, "step-socket-local": None}
_WARMUP = 20  # messages before either side starts counting (connection set up, caches warm)


@dataclass(frozen=True, slots=True)
class SideCpu:
    """CPU microseconds per message on one side of the stream."""

    user_us: float
    sys_us: float

    @property
    def total_us(self) -> float:
        return self.user_us + self.sys_us


@dataclass(frozen=True, slots=True)
class Cell:
    transport: str
    pace_ms: float
    sender: SideCpu
    receiver: SideCpu


def _cpu_s() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _per_message(before: tuple[float, float], count: int) -> dict[str, float]:
    user, system = _cpu_s()
    return {"user_us": (user - before[0]) / count * 1e6, "sys_us": (system - before[1]) / count * 1e6}


def _step_message(rows: int) -> bytes:
    from shared.pb.spindle.v1 import worker_pb2

    return worker_pb2.ExecuteResponse(round_id=7, step_index=3, request_ids=[f"req-{i:032x}" for i in range(rows)],
                                      token_ids=list(range(1000, 1000 + rows)), sampled_unix_ns=1).SerializeToString()


async def _send_grpc(port: int, payload: bytes, messages: int, pace_s: float, ready: int) -> dict[str, float]:
    import grpc

    from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc

    finished = asyncio.Event()
    result: dict[str, float] = {}

    class Sender(worker_pb2_grpc.WorkerServiceServicer):
        async def Execute(self, requests: AsyncIterator[worker_pb2.ExecuteRequest],  # noqa: N802
                          context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.ExecuteResponse]:
            message = worker_pb2.ExecuteResponse.FromString(payload)
            before = _cpu_s()
            try:
                for i in range(messages):
                    if i:
                        await asyncio.sleep(pace_s)
                    if i == _WARMUP:
                        before = _cpu_s()
                    yield message
            finally:  # the receiver cancels the call once it has every message, maybe before this resumes
                result.update(_per_message(before, messages - _WARMUP))
                finished.set()

    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(Sender(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    os.write(ready, b"1")
    await finished.wait()
    await server.stop(0.5)
    return result


async def _receive_grpc(port: int, messages: int) -> dict[str, float]:
    import grpc

    from shared.pb.spindle.v1 import worker_pb2, worker_pb2_grpc

    opened = asyncio.Event()

    async def requests() -> AsyncIterator[worker_pb2.ExecuteRequest]:
        yield worker_pb2.ExecuteRequest()
        await opened.wait()  # keep our side open until every message arrived

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(requests())
        count, before = 0, _cpu_s()
        async for _ in call:
            count += 1
            if count == _WARMUP:
                before = _cpu_s()
            if count == messages:
                break
        result = _per_message(before, messages - _WARMUP)
        opened.set()
        call.cancel()
    return result


def _local_name(port: int) -> str:
    return f"spindle-transport-bench-{port}"


async def _serve_once(port: int, ready: int,
                      send: Callable[[asyncio.StreamWriter], Awaitable[dict[str, float]]],
                      local: bool = False) -> dict[str, float]:
    """Listen on `port` (`local`: on a local Unix socket named after it), run `send` on the first
    connection, return what it measured."""
    finished = asyncio.Event()
    result: dict[str, float] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        result.update(await send(writer))
        writer.close()
        finished.set()

    if local:
        server = await serve_local(serve, _local_name(port), backlog=1)
    else:
        server = await asyncio.start_server(serve, "127.0.0.1", port)
    os.write(ready, b"1")
    await finished.wait()
    server.close()
    return result


async def _send_stream(port: int, payload: bytes, messages: int, pace_s: float, ready: int) -> dict[str, float]:
    from shared.step_frames import STEP, frame

    async def send(writer: asyncio.StreamWriter) -> dict[str, float]:
        before = _cpu_s()
        for i in range(messages):
            if i:
                await asyncio.sleep(pace_s)
            if i == _WARMUP:
                before = _cpu_s()
            writer.write(frame(STEP, payload))
            await writer.drain()
        return _per_message(before, messages - _WARMUP)

    return await _serve_once(port, ready, send)


async def _send_step_socket(port: int, payload: bytes, messages: int, pace_s: float, ready: int,
                            local: bool = False) -> dict[str, float]:
    from services.worker.step_socket import StepSender
    from shared.step_frames import STEP, frame

    def send_from_a_thread(sender: StepSender) -> dict[str, float]:
        before = _cpu_s()
        for i in range(messages):
            if i:
                time.sleep(pace_s)
            if i == _WARMUP:
                before = _cpu_s()
            sender.send(frame(STEP, payload))
        return _per_message(before, messages - _WARMUP)

    async def send(writer: asyncio.StreamWriter) -> dict[str, float]:
        sender = StepSender(writer.get_extra_info("socket"))
        try:
            return await asyncio.to_thread(send_from_a_thread, sender)
        finally:
            sender.close()

    return await _serve_once(port, ready, send, local)


async def _receive_frames(port: int, messages: int, local: bool = False) -> dict[str, float]:
    from shared.pb.spindle.v1 import worker_pb2
    from shared.step_dial import open_local
    from shared.step_frames import read_frame

    if local:
        reader, writer = await open_local(_local_name(port))
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    before = _cpu_s()
    for count in range(1, messages + 1):
        item = await read_frame(reader)
        assert item is not None, "the sender closed early"
        worker_pb2.ExecuteResponse.FromString(item[1])  # parsed, as gRPC's side does
        if count == _WARMUP:
            before = _cpu_s()
    writer.close()
    return _per_message(before, messages - _WARMUP)


# Each transport's two sides (the gRPC ones differ only in the experiments their processes start with).
_SIDES = {"grpc": (_send_grpc, _receive_grpc), "grpc-event-engine": (_send_grpc, _receive_grpc),
          "stream": (_send_stream, _receive_frames), "step-socket": (_send_step_socket, _receive_frames),
          "step-socket-local": (partial(_send_step_socket, local=True), partial(_receive_frames, local=True))}


def _run_pair(transport: str, port: int, messages: int, pace_s: float, rows: int) -> dict[str, dict[str, float]]:
    """Fork: the child sends, this process receives; returns both sides' CPU per message."""
    import uvloop

    ready_r, ready_w = os.pipe()
    result_r, result_w = os.pipe()
    payload = _step_message(rows)
    pid = os.fork()
    if pid == 0:  # the sender
        os.close(ready_r)
        send, _ = _SIDES[transport]
        sent = uvloop.run(send(port, payload, messages, pace_s, ready_w))
        os.write(result_w, json.dumps(sent).encode())
        os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)  # the sender listens
    _, receive = _SIDES[transport]
    received = uvloop.run(receive(port, messages))
    os.close(result_w)
    sent = json.loads(os.read(result_r, 1 << 16))
    os.waitpid(pid, 0)
    return {"sender": sent, "receiver": received}


def measure(transport: str, pace_ms: float, messages: int, rows: int) -> Cell:
    """One cell in a fresh child process (gRPC's experiments are fixed per process)."""
    from shared.ports import free_port

    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if (experiments := TRANSPORT_EXPERIMENTS[transport]) is not None:
        env["GRPC_EXPERIMENTS"] = experiments
    cmd = [sys.executable, "-m", "benchmarks.transport_bench", "--pair", transport, "--port", str(free_port()),
           "--messages", str(messages), "--pace-ms", str(pace_ms), "--rows", str(rows)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    sides = json.loads(out.strip().splitlines()[-1])
    return Cell(transport, pace_ms, SideCpu(**sides["sender"]), SideCpu(**sides["receiver"]))


def format_table(cells: Sequence[Cell], rows: int) -> str:
    lines = [f"CPU per message of one stream, {rows} row(s) a step message (us: user + system)",
             "| transport | pace ms | sender | receiver | both |", "| --- | --- | --- | --- | --- |"]
    for c in cells:
        lines.append(f"| {c.transport} | {c.pace_ms:g} | {c.sender.user_us:.0f} + {c.sender.sys_us:.0f} "
                     f"| {c.receiver.user_us:.0f} + {c.receiver.sys_us:.0f} "
                     f"| {c.sender.total_us + c.receiver.total_us:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma list of {', '.join(TRANSPORTS)}")
    p.add_argument("--pace-ms", type=comma_list(float), default=(0.7, 0.0),
                   help="comma list: ms between messages (0: none)")
    p.add_argument("--messages", type=int, default=4000)
    p.add_argument("--rows", type=int, default=1, help="tokens in each step message (streams decoding)")
    p.add_argument("--pair", choices=TRANSPORTS, help=argparse.SUPPRESS)  # internal: one cell, in this process
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.messages <= _WARMUP:
        p.error(f"--messages must exceed the {_WARMUP} warm-up messages")
    if args.pair:
        print(json.dumps(_run_pair(args.pair, args.port, args.messages, args.pace_ms[0] / 1e3, args.rows)))
        return
    transports = [t for t in args.transports.split(",") if t]
    if unknown := set(transports) - set(TRANSPORTS):
        p.error(f"unknown transport(s) {sorted(unknown)}: choose from {', '.join(TRANSPORTS)}")
    cells = [measure(t, pace, args.messages, args.rows) for pace in args.pace_ms for t in transports]
    print(format_table(cells, args.rows))


if __name__ == "__main__":
    main()
