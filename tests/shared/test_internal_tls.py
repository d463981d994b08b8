"""Mutual TLS between services on loopback: start_grpc with credentials, open_channel, and the TLS flags."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scheduler.worker_client import WorkerClient
from shared.grpc_channel import open_channel
from shared.grpc_server import GrpcService, start_grpc
from shared.pb.spindle.v1 import worker_pb2_grpc
from shared.service_flags import add_internal_tls_arguments, internal_tls_from_args
from shared.tls import INTERNAL_TLS_FLAGS, TlsFiles, grpc_server_credentials
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.fake_worker_server import FakeWorkerServicer
from tests.shared.certificates import CertificateAuthority


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def server(ca: CertificateAuthority) -> AsyncIterator[GrpcService]:
    """A service (health only) that requires client certificates signed by `ca`, as scheduler and workers do."""
    service = await start_grpc("127.0.0.1:0", lambda _: None, [],
                               credentials=grpc_server_credentials(ca.internal_tls("worker")))
    await service.set_serving([])
    yield service
    await service.server.stop(0)


async def _check_health(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


async def test_client_with_a_certificate_from_the_ca_gets_through(server: GrpcService,
                                                                  ca: CertificateAuthority) -> None:
    async with open_channel(server.address, ca.internal_tls("scheduler")) as channel:
        assert await _check_health(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_client_without_a_certificate_is_refused(server: GrpcService, ca: CertificateAuthority) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.ca_file.read_bytes())
    async with grpc.aio.secure_channel(server.address, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _check_health(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_client_is_refused(server: GrpcService) -> None:
    async with open_channel(server.address, None) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _check_health(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_certificate_from_another_ca_is_refused_both_ways(server: GrpcService, ca: CertificateAuthority,
                                                                tmp_path: Path) -> None:
    intruder = CertificateAuthority.create(tmp_path, "other-ca")
    # A client certificate the server's CA did not sign...
    async with open_channel(server.address, intruder.internal_tls("intruder")) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await _check_health(channel)
    # ...and a server certificate our CA did not sign: the client does not trust it.
    rogue = await start_grpc("127.0.0.1:0", lambda _: None, [],
                             credentials=grpc_server_credentials(intruder.internal_tls("rogue")))
    try:
        async with open_channel(rogue.address, ca.internal_tls("scheduler")) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await _check_health(channel)
    finally:
        await rogue.server.stop(0)


async def test_worker_client_reaches_a_worker_that_requires_mutual_tls(ca: CertificateAuthority) -> None:
    worker = FakeWorker(32, 4, max_model_len=128)
    service = await start_grpc(
        "127.0.0.1:0", lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(FakeWorkerServicer(worker), s),
        [], credentials=grpc_server_credentials(ca.internal_tls("worker")))
    client = WorkerClient(0, service.address, ready_timeout_s=5, tls=ca.internal_tls("scheduler"))
    try:
        info = await client.wait_ready()
        assert info.num_kv_blocks == worker.info.num_kv_blocks
    finally:
        await client.close()
        await service.server.stop(0)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_internal_tls_arguments(parser)
    return parser.parse_args(argv)


def test_internal_tls_flags_all_or_none(ca: CertificateAuthority, monkeypatch: pytest.MonkeyPatch) -> None:
    assert internal_tls_from_args(_parse([])) is None
    cert, key = ca.issue("frontend")
    with pytest.raises(ValueError, match="--internal-tls-ca-file missing"):
        internal_tls_from_args(_parse(["--internal-tls-cert-file", str(cert), "--internal-tls-key-file", str(key)]))
    monkeypatch.setenv("SPINDLE_INTERNAL_TLS_CA_FILE", str(ca.ca_file))
    monkeypatch.setenv("SPINDLE_INTERNAL_TLS_CERT_FILE", str(cert))
    monkeypatch.setenv("SPINDLE_INTERNAL_TLS_KEY_FILE", str(key))
    assert internal_tls_from_args(_parse([])) == TlsFiles(str(cert), str(key), str(ca.ca_file), INTERNAL_TLS_FLAGS)


def test_a_missing_file_is_reported_with_its_flag(ca: CertificateAuthority, tmp_path: Path) -> None:
    cert, key = ca.issue("frontend")
    with pytest.raises(ValueError, match=r"--internal-tls-key-file='.*nowhere.key' is not a file"):
        TlsFiles(str(cert), str(tmp_path / "nowhere.key"), str(ca.ca_file), INTERNAL_TLS_FLAGS)
    with pytest.raises(ValueError, match=r"--tls-cert-file='.*nowhere.crt' is not a file"):
        TlsFiles(str(tmp_path / "nowhere.crt"), str(key))
