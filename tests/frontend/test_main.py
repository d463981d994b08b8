"""`python -m services.frontend` per the entry-point contract: flags, readiness, clean SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from services.frontend.__main__ import add_arguments, config_from_args
from services.frontend.messages import ChatMessage
from services.frontend.tokenizer import Tokenizer
from shared.errors import InvalidArgumentError
from shared.ports import distinct_free_ports
from tests.frontend.fake_scheduler import FakeScheduler

REPO = Path(__file__).resolve().parents[2]


def test_flags_default_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_SCHEDULER_ADDR", "sched:1234")
    monkeypatch.setenv("SPINDLE_PORT", "8123")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--model", "/models/llama-3/"]))
    assert (config.scheduler_addr, config.http_port, config.grpc_port) == ("sched:1234", 8123, 50051)
    assert config.served_model_name == "llama-3"
    assert config.host == "0.0.0.0" and config.default_max_tokens == 256
    with pytest.raises(ValueError, match="grpc_port=70000"):
        config_from_args(parser.parse_args(["--model", "m", "--grpc-port", "70000"]))


async def test_chat_without_template_is_a_clear_invalid_argument(tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in os.listdir(tokenizer_dir):
        if name != "chat_template.jinja":
            (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    tokenizer = Tokenizer(str(tmp_path))
    assert not tokenizer.has_chat_template
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        await tokenizer.encode_chat([ChatMessage("user", "hi")])


async def test_process_serves_once_scheduler_ready_and_stops_on_sigterm(
        tokenizer_dir: Path, fake: FakeScheduler, scheduler_addr: str) -> None:
    http_port, grpc_port = distinct_free_ports(2)
    fake.ready = False
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.frontend", "--model", str(tokenizer_dir), "--scheduler-addr", scheduler_addr,
        "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port),
        cwd=REPO, stderr=asyncio.subprocess.PIPE, env={**os.environ, "SPINDLE_LOG_LEVEL": "INFO"})
    assert proc.stderr is not None
    try:
        url = f"http://127.0.0.1:{http_port}/health"
        statuses = []
        deadline = time.monotonic() + 60  # a cold start imports transformers: generous on a busy machine
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                try:
                    async with session.get(url) as resp:
                        statuses.append(resp.status)
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                if statuses and statuses[-1] == 503:
                    fake.ready = True
                await asyncio.sleep(0.05)
        assert statuses[0] == 503 and statuses[-1] == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        log = (await proc.stderr.read()).decode()
        assert f"listening on 127.0.0.1:{grpc_port}" in log
        assert "ready: serving" in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
