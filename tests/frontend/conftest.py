"""Fixtures for frontend tests: a real tiny tokenizer, a fake scheduler, a running frontend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.frontend.config import FrontendConfig
from services.frontend.server import Frontend
from shared.pb.spindle.v1 import generation_pb2_grpc
from shared.tiny_models import build_tokenizer
from tests.frontend.fake_scheduler import FakeScheduler, start_fake_scheduler

MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture
def fake() -> FakeScheduler:
    return FakeScheduler()


@pytest.fixture
async def scheduler_addr(fake: FakeScheduler) -> AsyncIterator[str]:
    server, address = await start_fake_scheduler(fake)
    yield address
    await server.stop(0)


def make_config(tokenizer_dir: Path, scheduler_addr: str, **overrides: object) -> FrontendConfig:
    values: dict[str, object] = dict(
        model=str(tokenizer_dir), served_model_name=MODEL_NAME, scheduler_addr=scheduler_addr,
        host="127.0.0.1", http_port=0, grpc_port=0, default_max_tokens=16, scheduler_backoff_max_s=0.1,
    )
    values.update(overrides)
    return FrontendConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
async def frontend(tokenizer_dir: Path, fake: FakeScheduler, scheduler_addr: str) -> AsyncIterator[Frontend]:
    server = Frontend(make_config(tokenizer_dir, scheduler_addr))
    await server.start()
    if fake.ready:
        await server.scheduler.wait_ready(10)
    yield server
    await server.stop(0)


@pytest.fixture
async def stub(frontend: Frontend) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)
