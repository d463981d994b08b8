"""TLS on the frontend's public ports (https, grpcs) and mutual TLS on its link to the scheduler."""

from __future__ import annotations

import argparse
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from services.frontend.__main__ import add_arguments, config_from_args
from services.frontend.server import Frontend
from services.launcher import Launcher, ServeConfig
from shared.grpc_server import start_grpc
from shared.pb.spindle.v1 import generation_pb2 as pb
from shared.pb.spindle.v1 import generation_pb2_grpc, scheduler_pb2_grpc
from shared.tls import TlsFiles, grpc_server_credentials
from tests.frontend.conftest import MODEL_NAME, make_config
from tests.frontend.fake_scheduler import FakeScheduler
from tests.shared.certificates import CertificateAuthority


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def frontend(tokenizer_dir: Path, scheduler_addr: str, ca: CertificateAuthority) -> AsyncIterator[Frontend]:
    server = Frontend(make_config(tokenizer_dir, scheduler_addr, tls=ca.public_tls("frontend")))
    await server.start()
    await server.scheduler.wait_ready(10)
    yield server
    await server.stop(0)


async def test_https_serves_clients_that_trust_the_ca(frontend: Frontend, ca: CertificateAuthority) -> None:
    port = frontend.http_address.rsplit(":", 1)[1]
    trusting = ssl.create_default_context(cafile=str(ca.ca_file))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"https://localhost:{port}/health", ssl=trusting) as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):  # the system roots do not know our CA
            await session.get(f"https://localhost:{port}/health")
        with pytest.raises(aiohttp.ClientError):  # plaintext on a TLS port
            await session.get(f"http://localhost:{port}/health")
    http_client = DefaultAsyncHttpxClient(verify=trusting)
    async with AsyncOpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           http_client=http_client) as client:
        result = await client.completions.create(model=MODEL_NAME, prompt=[40, 41, 42], max_tokens=3)
    assert result.choices[0].text == frontend.tokenizer.decode([40, 41, 42])


async def test_grpcs_serves_clients_that_trust_the_ca(frontend: Frontend, ca: CertificateAuthority) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.ca_file.read_bytes())
    async with grpc.aio.secure_channel(frontend.grpc_address, credentials) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=[40, 41]),
                                     sampling=pb.SamplingParams(max_tokens=2))
        responses = [r async for r in stub.Generate(request)]
    assert [i for r in responses if r.HasField("chunk") for i in r.chunk.token_ids] == [40, 41]
    async with grpc.aio.insecure_channel(frontend.grpc_address) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_frontend_reaches_a_scheduler_that_requires_client_certificates(
        tokenizer_dir: Path, fake: FakeScheduler, ca: CertificateAuthority) -> None:
    scheduler = await start_grpc(
        "127.0.0.1:0", lambda s: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, s), [],
        credentials=grpc_server_credentials(ca.internal_tls("scheduler")))
    frontend = Frontend(make_config(tokenizer_dir, scheduler.address, internal_tls=ca.internal_tls("frontend")))
    await frontend.start()
    try:
        await frontend.scheduler.wait_ready(10)
        async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=[50]),
                                         sampling=pb.SamplingParams(max_tokens=1))
            responses = [r async for r in stub.Generate(request)]
        assert responses[-1].complete.usage.completion_tokens == 1
        assert [a.prompt_token_ids for a in fake.added] == [[50]]
    finally:
        await frontend.stop(0)
        await scheduler.server.stop(0)


def test_public_tls_flags_come_in_pairs_and_reach_serve(ca: CertificateAuthority, tmp_path: Path) -> None:
    cert, key = ca.issue("flags")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--tls-key-file missing"):
        config_from_args(parser.parse_args(["--model", "m", "--tls-cert-file", str(cert)]))
    config = config_from_args(parser.parse_args(["--model", "m", "--tls-cert-file", str(cert),
                                                 "--tls-key-file", str(key)]))
    assert config.tls == TlsFiles(str(cert), str(key)) and config.internal_tls is None
    # `spindle serve` probes its frontend over https and refuses a key file it cannot use before starting.
    serve = ServeConfig(model=str(tmp_path), port=8443, tls=config.tls)
    assert Launcher(serve).health_url() == "https://127.0.0.1:8443/health"
    with pytest.raises(ValueError, match="--api-key-file=.* cannot be read"):
        ServeConfig(model=str(tmp_path), api_key_file=str(tmp_path / "missing"))
